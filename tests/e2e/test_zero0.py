"""ZeRO stage 0 in fp32: what a run on one data rank builds (launch/analysis/engine_memory.py:
built_zero_stage), with our gradient norm and clipping (launch/optim/grad_norm.py).

DeepSpeed 0.19.8 gives no norm in that mode (`get_global_grad_norm()` is None) and its own
clipping miscounts replicated parameters across pipeline stages; the parity runs at dp 1 (the
reference, (2,1,1), (1,2,1), (4,4,1)) now train at ZeRO-0 and must match those at dp 2, which train
at ZeRO-1 with DeepSpeed's norm and clipping (an independent implementation), clipping active.
A dp 1 checkpoint saved by ZeRO-1 (every one before the change) resumes at ZeRO-0, its state
re-sharded (launch/checkpoints/reshard.py, zero0_state.py)."""
import pytest

from helpers.parity_runs import REFERENCE, SAVE_AT, STEPS
from helpers.launcher import TINY, launch_forked, read_metrics

pytestmark = pytest.mark.slow  # multi-process training runs (the fast tier: tests/e2e/test_parity.py)
RTOL = 1e-5  # tests/e2e/test_parity.py: fp32 rounding between layouts


def _optimizer_files(run):
    return sorted(p.name for p in (run["dir"] / "ck" / f"step{SAVE_AT:08d}").glob("*optim_states.pt"))


def test_one_data_rank_builds_zero0_and_matches_zero1(parity_runs):
    """DeepSpeed's own files say which stage ran: ZeRO-1 writes a partition file per data rank,
    ZeRO-0 none (its optimizer state is in the model-states file)."""
    assert _optimizer_files(parity_runs[(2, 2, 2)]) and _optimizer_files(parity_runs[(1, 1, 2)])
    zero1 = parity_runs[(2, 2, 2)]["metrics"]
    assert sum(r["grad_norm"] > 0.5 for r in zero1) >= 3  # tiny.yaml's grad_clip 0.5 acts
    for layout in (REFERENCE, (4, 4, 1)):
        assert _optimizer_files(parity_runs[layout]) == [], layout
        for g, r in zip(parity_runs[layout]["metrics"], zero1, strict=True):
            for key in ("loss", "grad_norm"):
                assert abs(g[key] - r[key]) <= RTOL * r[key], (layout, r["step"], key, g[key], r[key])


def test_a_zero1_checkpoint_at_dp1_resumes_at_zero0(parity_runs, tmp_path):
    """Saved after step 3 by ZeRO-1 at (1,1,1) (the recipe's deepspeed section forces the stage),
    resumed without it: the engine is ZeRO-0, the state re-sharded into it, the RNG states kept,
    and steps 4-5 match the uninterrupted reference."""
    ck = tmp_path / "ck"
    common = ["--recipe", str(TINY), "--steps", str(STEPS)]
    proc = launch_forked(1, common + ["--save", str(ck), "--save-every", str(SAVE_AT), "--set",
                                      "deepspeed.zero_optimization.stage=1", "--metrics-out", str(tmp_path / "a.jsonl")])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    saved = ck / f"step{SAVE_AT:08d}"
    assert list(saved.glob("*optim_states.pt"))  # ZeRO-1's partition file
    proc = launch_forked(1, common + ["--load", str(saved), "--metrics-out", str(tmp_path / "b.jsonl")])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"at step {SAVE_AT} ({SAVE_AT * 16} samples consumed), ZeRO-1 state re-sharded for ZeRO-0\n" in proc.stdout
    again, reference = read_metrics(tmp_path / "b.jsonl"), parity_runs[REFERENCE]["metrics"]
    assert [r["step"] for r in again] == list(range(SAVE_AT + 1, STEPS + 1))
    for g, r in zip(again, reference[SAVE_AT:], strict=True):
        assert g["lr"] == r["lr"]
        for key in ("loss", "grad_norm", "val_loss"):
            assert abs(g[key] - r[key]) <= RTOL * r[key], (r["step"], key, g[key], r[key])
