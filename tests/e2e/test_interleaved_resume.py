"""Checkpoints of interleaved runs (train.virtual_stages, launch/engine/interleaved.py), against one
uninterrupted 6-step run at v = 2 that saves after step 3:

- resumed at v = 2, steps 4-6 equal the uninterrupted run's to the bit (DeepSpeed's own loader);
- resumed at v = 1, and that run's own checkpoint of step 4 resumed at v = 2 again: the change of v
  re-shards (launch/checkpoints/reshard.py reads each parameter's state by name; at another v each
  rank's flat optimizer state holds other layers), and the losses and gradient norms match the
  uninterrupted run within fp32 rounding, as a resume at another (tp, pp, dp) does (test_resume.py).
  Each resume trains two steps or more: the first step's loss and norm come from the weights alone
  (the layer files, named by layer at any v), the second's from the optimizer state too."""
import pytest

from helpers.launcher import TINY, launch_forked, read_metrics

pytestmark = pytest.mark.slow  # four multi-process training runs

ARGS = ["--recipe", str(TINY), "--pp", "2", "--steps", "6", "--set", "model.n_layer=8", "--set", "train.eval_every=0"]
RTOL = 1e-5  # tests/e2e/test_resume.py's, for a resume at another layout


def _run(v: int, *extra: str) -> str:
    proc = launch_forked(2, ARGS + ["--set", f"train.virtual_stages={v}", *extra])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _close(got: list, want: dict) -> None:
    for m in got:
        for key in ("loss", "grad_norm"):
            assert abs(m[key] - want[m["step"]][key]) <= RTOL * abs(want[m["step"]][key]), (m["step"], key, m, want)


def test_interleaved_checkpoint_resumes_at_its_v_and_at_another(tmp_path):
    full = tmp_path / "full.jsonl"
    _run(2, "--save", str(tmp_path / "ck"), "--save-every", "3", "--metrics-out", str(full))
    uninterrupted = {m["step"]: m for m in read_metrics(full)}
    checkpoint = tmp_path / "ck" / "step00000003"

    resumed = tmp_path / "resumed.jsonl"
    out = _run(2, "--load", str(checkpoint), "--metrics-out", str(resumed))
    assert "re-sharded" not in out, out[-2000:]
    again = read_metrics(resumed)
    assert [m["step"] for m in again] == [4, 5, 6]
    for m in again:
        assert (m["loss"], m["grad_norm"]) == (uninterrupted[m["step"]]["loss"], uninterrupted[m["step"]]["grad_norm"])

    at_v1 = tmp_path / "v1.jsonl"
    out = _run(1, "--load", str(checkpoint), "--metrics-out", str(at_v1), "--save", str(tmp_path / "ck1"),
               "--save-every", "4")
    assert "re-sharded from tp=1 pp=2 dp=1 virtual_stages=2" in out, out[-2000:]
    assert [m["step"] for m in read_metrics(at_v1)] == [4, 5, 6]
    _close(read_metrics(at_v1), uninterrupted)

    at_v2 = tmp_path / "v2.jsonl"
    out = _run(2, "--load", str(tmp_path / "ck1" / "step00000004"), "--metrics-out", str(at_v2))
    assert "re-sharded from tp=1 pp=2 dp=1 virtual_stages=1" in out, out[-2000:]
    assert [m["step"] for m in read_metrics(at_v2)] == [5, 6]
    _close(read_metrics(at_v2), uninterrupted)
