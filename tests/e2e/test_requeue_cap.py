"""A requeue never loops (launch/resilience/restarts.py): one command line (`--save DIR --load DIR`)
rerun after each failure, as a scheduler's requeue does, is refused once
train.max_starts_without_progress (3) starts in a row began at the same checkpoint. The record's
logic in process: tests/runtime/test_restarts.py."""
import re

import pytest

from helpers.launcher import TINY, launch_forked

pytestmark = pytest.mark.slow  # five launches


def _files(root):
    """Every file under `root` with its bytes: what a refused start must leave as it was."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_requeue_that_fails_the_same_way_is_refused_after_three_starts(tmp_path):
    """Rank 1 fails before step 3 at every start. The first start saves step 2 (progress) and
    fails; the next three begin at step 2 and fail the same way; the fifth is refused in one line
    (exit 2, no traceback) naming the directory, the count, the step, the last failure and what to
    do, with DIR unchanged."""
    ck = tmp_path / "ck"
    args = ["--recipe", str(TINY), "--pp", "2", "--steps", "4", "--save-every", "2", "--save", str(ck),
            "--load", str(ck)]
    env = {"GPT3D_FAULT_INJECT": "1:3"}
    for start in range(4):
        proc = launch_forked(2, args, env=env)
        assert proc.returncode == 1, (start, proc.stdout[-2000:] + proc.stderr[-2000:])
        assert (ck / "latest").read_text() == "step00000002"
    before = _files(ck)
    proc = launch_forked(2, args, env=env)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert re.fullmatch(re.escape(
        f"error: --save {ck}: the last 3 starts all began at the checkpoint of step 2 and none saved a newer one "
        f"(train.max_starts_without_progress=3); the last failure: stopping: rank 1 failed: RuntimeError: fault "
        f"injected by GPT3D_FAULT_INJECT=1:3 before step 3 (at launch/resilience/failure.py:LINE in "
        f"maybe_inject_fault). Another start would fail the same way: fix the cause, then remove "
        f"{ck / 'starts.jsonl'} or raise train.max_starts_without_progress (0: no cap)").replace("LINE", r"\d+"),
        lines[0]), lines[0]
    assert _files(ck) == before
