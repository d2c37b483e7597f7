"""Resuming the parity runs' checkpoints (tests/conftest.py: parity_runs saves after step 3).

At the saved layout the continuation is bit-identical to the uninterrupted run, at every layout
of the parity test, and the metrics file continues from step 4. At another layout
(launch/checkpoints/reshard.py re-shards the weights and Adam moments: ZeRO-1's partitions, or the
parameters of ZeRO-0, which a run on one data rank builds) steps 4-5 match the
uninterrupted run within fp32 rounding, like the layouts themselves do; a checkpoint of a
sequence-parallel run re-shards the same way, and so does one of a context-parallel run to another cp.
"""
import json

import pytest

from helpers.parity_runs import LAYOUTS, REFERENCE, SAVE_AT, STEPS, layout_id
from helpers.launcher import TINY, launch_forked, read_metrics

pytestmark = pytest.mark.slow  # multi-process training runs (the fast tier: tests/e2e/test_parity.py)
RTOL = 1e-5


def _resume(checkpoint, layout, metrics, extra=(), env=None, cp=1):
    tp, pp, dp = layout
    proc = launch_forked(tp * pp * dp * cp, ["--recipe", str(TINY), "--tp", str(tp), "--pp", str(pp), "--steps", str(STEPS),
                                 "--cp", str(cp), "--load", str(checkpoint), "--metrics-out", str(metrics)] + list(extra),
                         env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


# Every parity layout but the 16-rank (4,4,1), whose resume costs the suite 13 s and adds no path that
# (2,2,2) (tp, pp and dp together) and the fault soak's (1,2,1) do not resume bit for bit already.
@pytest.mark.parametrize("layout", [REFERENCE] + [layout for layout in LAYOUTS if layout != (4, 4, 1)], ids=layout_id)
def test_resume_continues_bitwise(parity_runs, tmp_path, layout):
    run = parity_runs[layout]
    # The interrupted run's file, with steps 4-5 it trained after the checkpoint marked stale (loss
    # and norm -1): the resumed run keeps steps 1-3 and must write 4-5 again.
    resumed = tmp_path / "resumed.jsonl"
    resumed.write_text("".join(json.dumps(r if r["step"] <= SAVE_AT else dict(r, loss=-1.0, grad_norm=-1.0)) + "\n"
                               for r in run["metrics"]))
    # (1,1,2)'s parity run logged to wandb offline: the resumed run continues that wandb run.
    wandb = layout == (1, 1, 2)
    out = _resume(run["dir"] / "ck" / f"step{SAVE_AT:08d}", layout, resumed, ["--wandb", "offline"] if wandb else [],
                  env={"WANDB_DIR": str(tmp_path)})
    assert f"at step {SAVE_AT} ({SAVE_AT * 16} samples consumed)" in out and "re-sharded" not in out
    if wandb:  # offline-run-<time>-<id>: the first run's directory and the resumed run's share the id
        run_ids = [d.name.rsplit("-", 1)[1] for directory in (run["dir"], tmp_path)
                   for d in (directory / "wandb").glob("offline-run-*")]
        assert len(run_ids) == 2 and run_ids[0] == run_ids[1], run_ids
    full, again = run["metrics"], read_metrics(resumed)
    assert [m["step"] for m in again] == list(range(1, STEPS + 1))
    for x, y in zip(full, again):
        assert (x["loss"], x["grad_norm"], x["lr"], x.get("val_loss")) == \
            (y["loss"], y["grad_norm"], y["lr"], y.get("val_loss")), (layout, x, y)


@pytest.mark.parametrize("saved,layout", [((2, 2, 2), (1, 1, 1)), ((2, 2, 2), (1, 4, 2)), ((2, 2, 2), (4, 1, 2)),
                                          ((2, 2, 2, "sp"), (1, 1, 1))],
                         ids=lambda l: layout_id(l))
def test_resume_at_another_layout_matches(parity_runs, tmp_path, saved, layout):
    """Saved at tp=2 pp=2 dp=2 (with and without sequence parallelism), resumed at another
    (tp, pp, dp), optimizer state included: the continuation matches the uninterrupted run at
    the saved layout (and so the reference)."""
    metrics = tmp_path / "resumed.jsonl"
    out = _resume(parity_runs[saved]["dir"] / "ck" / f"step{SAVE_AT:08d}", layout, metrics)
    assert f"at step {SAVE_AT}" in out and "re-sharded from tp=2 pp=2 dp=2" in out
    # One data rank builds ZeRO-0: ZeRO-1's partitions re-sharded into its parameters.
    assert ("ZeRO-1 state re-sharded for ZeRO-0" in out) == (layout[2] == 1), out[-2000:]
    again = read_metrics(metrics)
    assert [m["step"] for m in again] == list(range(SAVE_AT + 1, STEPS + 1))
    for original in (parity_runs[saved]["metrics"], parity_runs[REFERENCE]["metrics"]):
        for x, y in zip(original[SAVE_AT:], again):
            assert x["lr"] == y["lr"]
            for key in ("loss", "grad_norm", "val_loss"):
                assert abs(x[key] - y[key]) <= RTOL * abs(x[key]), (layout, key, x, y)


def test_resume_at_another_cp(parity_runs, tmp_path):
    """Context parallelism: the weights do not depend on cp, only the ZeRO-1 partition
    over DeepSpeed's data axis (dp x cp ranks) does. Saved at (tp, cp, pp, dp) = (1,2,1,2): resumed
    there, bit for bit; at cp=1 (re-sharded over 2 data ranks instead of 4), and the single process's
    checkpoint at cp=2, within fp32 rounding of the uninterrupted runs (which match each other)."""
    saved = parity_runs[(1, 1, 2, "cp2")]
    checkpoint = saved["dir"] / "ck" / f"step{SAVE_AT:08d}"

    def resume(name, ckpt, layout, cp):
        metrics = tmp_path / f"{name}.jsonl"
        return _resume(ckpt, layout, metrics, cp=cp), read_metrics(metrics)

    out, same = resume("same", checkpoint, (1, 1, 2), 2)
    assert "re-sharded" not in out
    assert [(m["loss"], m["grad_norm"]) for m in same] == [(m["loss"], m["grad_norm"]) for m in saved["metrics"][SAVE_AT:]]
    for name, ckpt, layout, cp, full in [
            ("cp1", checkpoint, (1, 1, 2), 1, saved["metrics"]),
            ("cp2", parity_runs[REFERENCE]["dir"] / "ck" / f"step{SAVE_AT:08d}", (1, 1, 1), 2,
             parity_runs[REFERENCE]["metrics"])]:
        out, other = resume(name, ckpt, layout, cp)
        assert "re-sharded" in out, out[-2000:]
        # The single process's checkpoint is ZeRO-0's, read into cp=2's ZeRO-1 partitions.
        assert ("ZeRO-0 state re-sharded for ZeRO-1" in out) == (name == "cp2"), out[-2000:]
        assert [m["step"] for m in other] == [SAVE_AT + 1, STEPS]
        for got, want in zip(other, full[SAVE_AT:]):
            for key in ("loss", "grad_norm"):
                assert abs(got[key] - want[key]) <= RTOL * abs(want[key]), (name, got["step"], key, got[key], want[key])


def test_resume_at_another_partition_matches(parity_runs, tmp_path):
    """Saved at (1,2,1) with the balanced cut (blocks [3, 1]), resumed at the same layout cut by
    block count ([2, 2]): each rank's ZeRO-1 partition holds other layers, so the state is
    re-sharded, and steps 4-5 match the uninterrupted run (the losses do not depend on the cut)."""
    saved, metrics = parity_runs[(1, 2, 1)], tmp_path / "resumed.jsonl"
    out = _resume(saved["dir"] / "ck" / f"step{SAVE_AT:08d}", (1, 2, 1), metrics, ["--set", "train.partition=blocks"])
    assert "re-sharded from tp=1 pp=2 dp=1 (stage boundaries [0, 5, 8] -> [0, 4, 8])" in out
    again = read_metrics(metrics)
    for original in (saved["metrics"], parity_runs[REFERENCE]["metrics"]):
        for x, y in zip(original[SAVE_AT:], again, strict=True):
            for key in ("loss", "grad_norm", "val_loss"):
                assert abs(x[key] - y[key]) <= RTOL * abs(x[key]), (key, x, y)


def test_bf16_resume_at_another_layout(tmp_path):
    """bf16 with pp>1 runs DeepSpeed's bf16 optimizer, not ZeRO's: its state re-shards too.
    Saved at tp=1 pp=2 after step 2, resumed at tp=2 pp=1: steps 3-4 match the uninterrupted
    run within bf16 rounding (the layouts themselves differ by about 1e-4 here)."""
    full, resumed = tmp_path / "full.jsonl", tmp_path / "resumed.jsonl"
    bf16 = ["--recipe", str(TINY), "--steps", "4", "--set", "train.precision=bf16"]
    proc = launch_forked(2, bf16 + ["--pp", "2", "--save", str(tmp_path / "ck"), "--save-every", "2", "--metrics-out", str(full)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    proc = launch_forked(2, bf16 + ["--tp", "2", "--load", str(tmp_path / "ck" / "step00000002"), "--metrics-out", str(resumed)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "re-sharded from tp=1 pp=2 dp=1" in proc.stdout
    for x, y in zip(read_metrics(full)[2:], read_metrics(resumed)):
        assert x["step"] == y["step"] and x["lr"] == y["lr"]
        assert abs(x["loss"] - y["loss"]) <= 1e-3 * x["loss"] and abs(x["grad_norm"] - y["grad_norm"]) <= 1e-2 * x["grad_norm"]


def test_one_command_rerun_after_each_failure_trains_the_uninterrupted_model(parity_runs, tmp_path):
    """A scheduler's requeue (docs/resilience.md, "Requeues"): the same `--save DIR --load DIR` command run
    three times. The first starts at step 1 on a DIR that does not exist and fails at step 3
    (GPT3D_FAULT_INJECT), the second resumes from its step-2 checkpoint and fails at step 5, the
    third resumes from step 4 and finishes: steps 1-5 are bitwise the uninterrupted (1,1,1) run's."""
    ck, metrics = tmp_path / "ck", tmp_path / "metrics.jsonl"
    command = ["--recipe", str(TINY), "--steps", str(STEPS), "--save", str(ck), "--load", str(ck),
               "--save-every", "2", "--metrics-out", str(metrics)]
    outputs = []
    for fault in ("0:3", "0:5", None):
        proc = launch_forked(1, command, env={"GPT3D_FAULT_INJECT": fault} if fault else None)
        assert (proc.returncode != 0) == (fault is not None), proc.stdout[-3000:] + proc.stderr[-3000:]
        outputs.append(proc.stdout)
    assert "no checkpoint there yet; starting at step 1" in outputs[0]
    assert "at step 2 (32 samples consumed)" in outputs[1] and "at step 4 (64 samples consumed)" in outputs[2]
    reference = parity_runs[REFERENCE]["metrics"]
    got = read_metrics(metrics)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(got, reference):
        assert (a["loss"], a["grad_norm"], a.get("val_loss")) == (b["loss"], b["grad_norm"], b.get("val_loss")), (a, b)
