"""The training runs bench/gpu_check.py compares: one recipe through launch/train.py on N devices
(or N CPU processes), read back as its --metrics-out records; the one-document corpus of the
document-mask check; and the numbers the summary table shows of two runs."""
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import List, Sequence

from launch.runtime.distributed import launcher_command

REPO = Path(__file__).resolve().parent.parent


def train(recipe: Path, sets: Sequence[str], tp: int, pp: int, steps: int, out: Path, on_cpu: bool) -> List[dict]:
    """The metrics records of `steps` steps of `recipe` with `sets` at (tp, pp, 1): one process
    through `python launch/train.py`, several through DeepSpeed's launcher. On CPU the ranks are
    CPU processes over gloo whatever the machine has."""
    env = dict(os.environ)
    if on_cpu:
        env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    script = REPO / "launch" / "train.py"
    cmd = [sys.executable, str(script)] if tp * pp == 1 else launcher_command(tp * pp, script)
    cmd += ["--recipe", str(recipe), "--tp", str(tp), "--pp", str(pp), "--steps", str(steps), "--metrics-out", str(out)]
    for item in sets:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{recipe.name} at tp={tp} pp={pp} {' '.join(sets)} failed:\n"
                         f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return [json.loads(line) for line in out.read_text().splitlines()]


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


def step_time_ratio(run: List[dict], reference: List[dict], warmup: int) -> float:
    """Median step time of `run` over that of `reference`, the first `warmup` steps left out
    (start-up: allocator growth, cuBLAS heuristics, compiling)."""
    def median(records: List[dict]) -> float:
        return statistics.median(r["step_time_s"] for r in records if r["step"] > warmup)
    return median(run) / median(reference)
