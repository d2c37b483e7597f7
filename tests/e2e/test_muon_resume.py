"""Muon's checkpoints: the shared (2,2,2) Muon parity run with sequence parallelism saves
after step 3 (its momentum in DeepSpeed's ZeRO-1 partition files, next to AdamW's moments of the
other parameters). Resumed there, steps 4-5 are the uninterrupted run's bits; resumed at (1,2,4),
launch/checkpoints/reshard.py re-shards the momentum like Adam's moments (merged over TP, cut for
the new shards and partitions) and steps 4-5 match within fp32 rounding; resumed with AdamW, one line.
In bf16 (DeepSpeed's BF16 optimizer's partition files) and fp16 (ZeRO-1 with a dynamic loss scale,
which changes every 2 steps here), the (1,1,2) Muon runs resume at their layout bit for bit."""
import pytest

from helpers.launcher import TINY, launch_forked, read_metrics
from helpers.parity_runs import SAVE_AT, STEPS, precision_args, precision_env

pytestmark = pytest.mark.slow  # multi-process training runs
SAVED = (2, 2, 2, "sp", "muon")
RTOL = 1e-5
MUON = ["--set", "train.optimizer=muon"]


def _resume(checkpoint, layout, metrics, extra, env=None):
    tp, pp, dp = layout
    proc = launch_forked(tp * pp * dp, ["--recipe", str(TINY), "--tp", str(tp), "--pp", str(pp), "--steps", str(STEPS),
                                        "--load", str(checkpoint), "--metrics-out", str(metrics)] + extra, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, read_metrics(metrics)


@pytest.mark.parametrize("layout", [(2, 2, 2), (1, 2, 4), (1, 2, 1)],
                         ids=["same-layout", "re-sharded-1-2-4", "re-sharded-into-zero0-1-2-1"])
def test_muon_resumes(parity_runs, tmp_path, layout):
    run = parity_runs[SAVED]
    sp = ["--set", "model.sequence_parallel=true"] if layout == SAVED[:3] else []
    out, again = _resume(run["dir"] / "ck" / f"step{SAVE_AT:08d}", layout, tmp_path / "m.jsonl", MUON + sp)
    assert [m["step"] for m in again] == list(range(SAVE_AT + 1, STEPS + 1))
    if layout == SAVED[:3]:
        assert "re-sharded" not in out
        assert [(m["loss"], m["grad_norm"], m.get("val_loss")) for m in again] == \
            [(m["loss"], m["grad_norm"], m.get("val_loss")) for m in run["metrics"][SAVE_AT:]]
        return
    assert "re-sharded from tp=2 pp=2 dp=2" in out
    assert ("ZeRO-1 state re-sharded for ZeRO-0" in out) == (layout[2] == 1)  # one data rank: ZeRO-0
    for x, y in zip(run["metrics"][SAVE_AT:], again):
        assert x["lr"] == y["lr"]
        for key in ("loss", "grad_norm", "val_loss"):
            assert abs(x[key] - y[key]) <= RTOL * abs(x[key]), (layout, key, x, y)


def test_muon_zero0_checkpoint_resumes_at_zero1(parity_runs, tmp_path):
    """The single process's Muon run built ZeRO-0: its momentum, by parameter name in the
    model-states file (launch/checkpoints/zero0_state.py), re-sharded into (1,1,2)'s ZeRO-1
    partitions; steps 4-5 match the uninterrupted run within fp32 rounding."""
    run = parity_runs[(1, 1, 1, "muon")]
    out, again = _resume(run["dir"] / "ck" / f"step{SAVE_AT:08d}", (1, 1, 2), tmp_path / "m.jsonl", MUON)
    assert "ZeRO-0 state re-sharded for ZeRO-1, re-sharded from tp=1 pp=1 dp=1" in out, out[-2000:]
    for x, y in zip(run["metrics"][SAVE_AT:], again, strict=True):
        assert x["lr"] == y["lr"]
        for key in ("loss", "grad_norm", "val_loss"):
            assert abs(x[key] - y[key]) <= RTOL * abs(x[key]), (key, x, y)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_muon_resumes_bitwise_in_half_precision(parity_runs, tmp_path, precision):
    run = parity_runs[(1, 1, 2, precision, "muon")]
    _, again = _resume(run["dir"] / "ck" / f"step{SAVE_AT:08d}", (1, 1, 2), tmp_path / "m.jsonl",
                       MUON + precision_args(precision), env=precision_env(precision))
    assert [(m["loss"], m["grad_norm"], m["loss_scale"], m.get("val_loss")) for m in again] == \
        [(m["loss"], m["grad_norm"], m["loss_scale"], m.get("val_loss")) for m in run["metrics"][SAVE_AT:]]
