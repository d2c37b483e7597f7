"""The training runs bench/gpu/gpu_check.py's checks compare: one recipe through launch/train.py on N
devices (or N CPU processes), read back as its --metrics-out records with the GEMM paths it took
(bench/gpu/gpu_check_train.py); the one-document corpus of the document-mask check; and the numbers
the summary table shows of two runs."""
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, NamedTuple, Sequence

from bench import REPO
from bench.gpu.gpu_check_train import GEMM_PATHS_ENV
from launch.engine.distributed import launcher_command

TRAIN = REPO / "bench" / "gpu" / "gpu_check_train.py"  # launch/train.py, then the GEMM paths it took


class Run(NamedTuple):
    records: List[dict]
    """One metrics record per step (launch/instruments/metrics.py)."""
    gemm_paths: Dict[str, List[str]]
    """bench/gpu/gpu_check_train.py's {"fusion": [...], "grouped": [...]} over every rank."""


class RunFailed(RuntimeError):
    """A training run exited non-zero; the message is one line: the run and its cause."""


def train(recipe: Path, sets: Sequence[str], tp: int, pp: int, steps: int, out: Path, on_cpu: bool) -> Run:
    """`steps` steps of `recipe` with `sets` at (tp, pp, 1): one process through
    bench/gpu/gpu_check_train.py (launch/train.py), several through DeepSpeed's launcher. On CPU the
    ranks are CPU processes over gloo whatever the machine has. A failed run raises RunFailed
    after printing the end of its output (the check's log keeps it)."""
    env = dict(os.environ, **{GEMM_PATHS_ENV: str(out.with_suffix(".gemm"))})
    if on_cpu:
        env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    cmd = [sys.executable, str(TRAIN)] if tp * pp == 1 else launcher_command(tp * pp, TRAIN)
    cmd += ["--recipe", str(recipe), "--tp", str(tp), "--pp", str(pp), "--steps", str(steps), "--metrics-out", str(out)]
    for item in sets:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        # The end of each stream: a DeepSpeed or compiler traceback runs to a few thousand characters.
        print(f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-10000:]}", file=sys.stderr, flush=True)
        raise RunFailed(f"{recipe.stem} at tp={tp} pp={pp} exited {proc.returncode}: "
                        f"{error_line(proc.stderr + proc.stdout)}")
    records = [json.loads(line) for line in out.read_text().splitlines()]
    return Run(records, merged_gemm_paths(out.parent.glob(out.with_suffix(".gemm").name + ".rank*.json")))


def error_line(output: str) -> str:
    """The line of a failed run's output that names the cause: train.py's one line ("error: rank
    0: ..."), else the last line naming an error, else the last line."""
    lines = [line.strip() for line in output.strip().splitlines() if line.strip()] or ["no output"]
    return next((line for line in reversed(lines) if line.startswith("error") or "Error" in line), lines[-1])[:300]


def merged_gemm_paths(files) -> Dict[str, List[str]]:
    """The union of the ranks' GEMM path files."""
    merged = {"fusion": set(), "grouped": set()}
    for file in files:
        for probe, paths in json.loads(Path(file).read_text()).items():
            merged[probe].update(paths)
    return {probe: sorted(paths) for probe, paths in merged.items()}


def one_document_corpus(path: Path) -> Path:
    """A JSON Lines file of one document: every documentation topic CPython ships (pydoc_data,
    about 465k characters, some 120k tokens of the embedded tokenizer) joined into one text. Its
    only EOS is the stream's last token, which falls in no full window (checked by the caller's
    losses): every window is inside the document, so the document mask is the causal mask."""
    from pydoc_data.topics import topics
    path.write_text(json.dumps({"text": "\n\n".join(topics[k] for k in sorted(topics))}) + "\n")
    return path


def max_relative_difference(reference: List[dict], other: List[dict], keys=("loss", "grad_norm")) -> float:
    """The largest |other - reference| / |reference| over every step and key."""
    assert len(reference) == len(other), (len(reference), len(other))
    return max(abs(o[k] - r[k]) / abs(r[k]) for r, o in zip(reference, other) for k in keys)


def identical(reference: List[dict], other: List[dict], keys=("loss", "grad_norm")) -> bool:
    """Every step's values equal to the bit (the JSON keeps a float's every digit)."""
    return len(reference) == len(other) and all(r[k] == o[k] for r, o in zip(reference, other) for k in keys)


def median_step_time(records: List[dict], warmup: int) -> float:
    """Median step time, the first `warmup` steps left out (start-up: allocator growth, cuBLAS
    heuristics, compiling)."""
    return statistics.median(r["step_time_s"] for r in records if r["step"] > warmup)


def step_time_ratio(run: List[dict], reference: List[dict], warmup: int) -> float:
    """Median step time of `run` over that of `reference`, the first `warmup` steps left out."""
    return median_step_time(run, warmup) / median_step_time(reference, warmup)
