"""`python bench/gpu/gpu_check_train.py ARGS`: `python launch/train.py ARGS`, which then writes the GEMM
paths its process took, for bench/gpu/gpu_check.py's rows (bench/gpu/gpu_check_runs.py starts it).

The paths are the choices of two probes, each made once per device type the first time a bf16
weight gradient is added into its fp32 main gradient on a GPU (train.grad_accum_fusion):
model/parallel/weight_grad.py's for a linear's weight (`_CHOSEN_PATH`), and
model/transformer/grouped_gemm.py's for the experts' weights (`_CHOSEN_GROUPED_PATH`). Only the
process that trained knows them, so it writes them itself: to `$GPU_CHECK_GEMM_PATHS.rankR.json`,
one file per rank. No file where the run failed (it exits inside train.py)."""
import json
import os
import sys
from pathlib import Path
from typing import Dict, List

GEMM_PATHS_ENV = "GPU_CHECK_GEMM_PATHS"


def gemm_paths_taken() -> Dict[str, List[str]]:
    """The paths the probes chose in this process, {"fusion": [...], "grouped": [...]}; a list is
    empty where its probe never ran (CPU, fp32, the fusion off, or, for grouped, no experts)."""
    from model.parallel.weight_grad import _CHOSEN_PATH
    from model.transformer.grouped_gemm import _CHOSEN_GROUPED_PATH
    return {"fusion": sorted(set(_CHOSEN_PATH.values())), "grouped": sorted(set(_CHOSEN_GROUPED_PATH.values()))}


def main(argv: List[str]) -> int:
    from launch.train import main as train
    code = train(argv)
    prefix = os.environ.get(GEMM_PATHS_ENV)
    if prefix:
        rank = os.environ.get("RANK", "0")  # set by DeepSpeed's launcher; one process: rank 0
        Path(f"{prefix}.rank{rank}.json").write_text(json.dumps(gemm_paths_taken()))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
