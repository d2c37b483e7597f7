"""A clock outside the training loop for the throughput tests: runs started with `env(directory)`
load tests/helpers/step_clock_site/sitecustomize.py, which times every engine.train_batch and counts the
tokens it draws; `read(directory, world)` gives each rank's [{"seconds", "tokens"}, ...] per step."""
import json
import os
from pathlib import Path
from typing import Dict, List

SITE = Path(__file__).resolve().parent / "step_clock_site"


def env(directory: Path) -> Dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(SITE), os.environ.get("PYTHONPATH")])),
            "GPT3D_STEP_CLOCK_DIR": str(directory)}


def read(directory: Path, world: int) -> List[List[dict]]:
    return [[json.loads(line) for line in (directory / f"rank{rank}.jsonl").read_text().splitlines()]
            for rank in range(world)]


def implied_step_time_fits(tokens_per_s: float, tokens: int, seconds: float) -> bool:
    """The step time a logged tokens/s implies for `tokens`, against this clock's `seconds` of the
    same train_batch: the loop's clock encloses the call (never shorter), and adds little: the
    step's draws and its token-count all-reduce, which took up to 12 ms on a loaded 2-core CI
    machine against a 63 ms step (a wrong formula, e.g. per rank, would be off 2x)."""
    implied = tokens / tokens_per_s
    return seconds * (1 - 1e-9) <= implied <= seconds * 1.1 + 0.03
