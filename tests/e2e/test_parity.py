"""The acceptance test (docs/design.md, The acceptance test): every layout trains the same model.

The first 5 optimizer steps of recipes/tiny.yaml (fp32, ZeRO-1, gradient clipping active, a
learning rate that moves the loss) give the same loss and gradient norm, relative difference
<= 1e-5, at (tp, pp, dp) = (1,1,1), (2,1,1), (1,2,1), (1,1,2), (2,2,2) and (4,4,1), and with
sequence parallelism (`model.sequence_parallel`) at (2,2,2) and (4,1,1), with context parallelism
(--cp 2) at (tp, cp, pp, dp) = (1,2,1,1), (2,2,1,1), (1,2,2,1), (1,2,1,2) and, with SP,
(2,2,2,1); in bf16, (2,2,2) with
sequence parallelism, (1,2,1) and (tp, cp, pp, dp) = (1,2,1,1) within BF16_RTOL of a bf16 (1,1,1). Each layout is launched
once per session, when a test first asks for it (conftest.py: parity_runs, its ranks forked as
DeepSpeed's launcher starts them; tests/e2e/test_resume.py resumes the checkpoints these runs save)."""
import json
import math

import pytest

from helpers.parity_runs import (ACCEPTANCE_RUNS, BF16_RTOL, CP_LAYOUTS, LAYOUTS, REFERENCE, SP_LAYOUTS, STEPS,
                                 layout_id)
from helpers.launcher import TINY, launch_forked, read_metrics

RTOL = 1e-5
# (2,2,2) with sequence parallelism: DeepSpeed's BF16 optimizer (pp > 1) keeps the gradients in its
# own fp32 buffers, which the once-per-step TP sum of the sequence-parallel parameters must reach.
# (tp, pp, dp) = (1,1,1) at cp 2: the fused fp32 accumulation and the fp32 DP all-reduce over DeepSpeed's
# data axis, which holds the CP ranks too, with the CP loss weighting in bf16.
BF16_LAYOUTS = [(2, 2, 2, "sp", "bf16"), (1, 2, 1, "bf16"), (1, 1, 1, "bf16", "cp2")]
GRAD_CLIP = 0.5  # recipes/tiny.yaml
METRIC_KEYS = {"step", "loss", "grad_norm", "lr", "tokens", "tokens_per_s", "elapsed_s"}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def test_reference_run_learns_with_clipping_active(parity_runs):
    ref = parity_runs[REFERENCE]["metrics"]
    assert [m["step"] for m in ref] == list(range(1, STEPS + 1))
    assert all(METRIC_KEYS <= set(m) for m in ref)
    assert all(math.isfinite(m["loss"]) for m in ref)
    assert ref[-1]["loss"] < ref[0]["loss"] - 0.1, [m["loss"] for m in ref]  # the lr moves the loss
    assert sum(m["grad_norm"] > GRAD_CLIP for m in ref) >= 3, [m["grad_norm"] for m in ref]  # clipping acts
    assert ref[-1]["tokens"] == STEPS * 16 * 32  # global batch 16 x seq_len 32


@pytest.mark.parametrize("layout", [pytest.param(layout, marks=[] if layout in ACCEPTANCE_RUNS else pytest.mark.slow)
                                    for layout in LAYOUTS + SP_LAYOUTS + CP_LAYOUTS], ids=layout_id)
def test_layout_matches_single_process(parity_runs, layout):
    ref, got = parity_runs[REFERENCE]["metrics"], parity_runs[layout]["metrics"]
    assert len(got) == STEPS
    for r, g in zip(ref, got):
        assert _rel(g["loss"], r["loss"]) <= RTOL, (layout, r["step"], g["loss"], r["loss"])
        assert _rel(g["grad_norm"], r["grad_norm"]) <= RTOL, (layout, r["step"], g["grad_norm"], r["grad_norm"])
        assert g["lr"] == r["lr"] and g["tokens"] == r["tokens"]
        assert ("val_loss" in g) == ("val_loss" in r)
        if "val_loss" in r:  # validation through eval_batch (tiny.yaml: every 2 steps and the last)
            assert _rel(g["val_loss"], r["val_loss"]) <= RTOL, (layout, r["step"], g["val_loss"], r["val_loss"])


@pytest.mark.slow
@pytest.mark.parametrize("layout", BF16_LAYOUTS, ids=layout_id)
def test_bf16_layout_matches_single_process(parity_runs, layout):
    ref, got = parity_runs[REFERENCE + ("bf16",)]["metrics"], parity_runs[layout]["metrics"]
    assert len(got) == len(ref) == STEPS
    assert ref[-1]["loss"] < ref[0]["loss"] - 0.1  # bf16 trains: the tolerance is small against it
    for r, g in zip(ref, got):
        assert g["lr"] == r["lr"] and g["tokens"] == r["tokens"] and ("val_loss" in g) == ("val_loss" in r)
        for key, rtol in BF16_RTOL.items():
            if key in r:
                assert _rel(g[key], r[key]) <= rtol, (layout, r["step"], key, g[key], r[key])


@pytest.mark.slow
def test_zero_bubble_with_context_parallelism_is_bitwise_1f1b(parity_runs):
    """ZB-H1 at (tp, cp, pp, dp) = (1,2,2,1): the W passes defer weight gradients past the
    all-to-alls' backward, and reorder nothing within a sum, so the losses and norms are 1F1B's bits."""
    zb, one_f_one_b = parity_runs[(1, 2, 1, "cp2", "zb-h1")], parity_runs[(1, 2, 1, "cp2")]
    assert "schedule zb-h1" in zb["stdout"]
    assert [(m["loss"], m["grad_norm"], m.get("val_loss")) for m in zb["metrics"]] == \
        [(m["loss"], m["grad_norm"], m.get("val_loss")) for m in one_f_one_b["metrics"]]


@pytest.mark.slow
def test_evaluation_does_not_change_training(parity_runs, tmp_path):
    proc = launch_forked(1, ["--recipe", str(TINY), "--steps", str(STEPS), "--set", "train.eval_every=0",
                      "--metrics-out", str(tmp_path / "m.jsonl")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    without = read_metrics(tmp_path / "m.jsonl")
    with_eval = parity_runs[REFERENCE]["metrics"]
    assert [m["loss"] for m in without] == [m["loss"] for m in with_eval]
    assert [m["grad_norm"] for m in without] == [m["grad_norm"] for m in with_eval]
    assert not any("val_loss" in m for m in without)
    assert [m["step"] for m in with_eval if "val_loss" in m] == [2, 4, 5]


@pytest.mark.slow
def test_role_map_names_groups_and_stages(parity_runs):
    out = parity_runs[(2, 2, 2)]["stdout"]
    assert "world 8 = tp 2 x pp 2 x dp 2" in out
    assert "TP groups  (split each weight matrix):  [0, 1] [2, 3] [4, 5] [6, 7]" in out
    assert "pipelines  (split the layers, stage 0 first): [0, 4] [1, 5] [2, 6] [3, 7]" in out
    assert "DP groups  (split the data, all-reduce grads): [0, 2] [1, 3] [4, 6] [5, 7]" in out
    # The balanced cut (launch/analysis/partition.py): tiny's 4096-word head is worth about 5 blocks.
    assert "stage 0: layers 0-4: embed (tied), wpe, block 0, block 1, block 2 | 34% of the predicted compute" in out
    assert "stage 1: layers 5-7: block 3, ln_f, lm_head (tied embed) | 66% of the predicted compute" in out
    assert "activations: (b, T, h) = (2, 32, h) per rank between TP linears and across stages; recompute none" in out
    assert "activations: (b, T/tp, h) = (2, 16, h): sequence parallel" in parity_runs[(2, 2, 2, "sp")]["stdout"]


@pytest.mark.slow
def test_role_map_shows_the_context_parallel_axis(parity_runs):
    """TP adjacent, then CP (data index = dp_rank * cp + cp_rank); DeepSpeed's data-parallel groups
    hold dp x cp ranks; the activations are each CP rank's T/cp tokens."""
    out = parity_runs[(2, 1, 1, "cp2")]["stdout"]
    assert "world 4 = tp 2 x cp 2 x pp 1 x dp 1 (axis order pipe, data, model: TP ranks adjacent, then CP)" in out
    assert "TP groups  (split each weight matrix):  [0, 1] [2, 3]" in out
    assert "CP groups  (split each sequence, all-to-all in attention): [0, 2] [1, 3]" in out
    assert "activations: (b, T/cp, h) = (2, 16, h) per rank" in out
    out = parity_runs[(1, 1, 2, "cp2")]["stdout"]
    assert "CP groups  (split each sequence, all-to-all in attention): [0, 1] [2, 3]" in out
    assert "DP groups  (split the data, all-reduce grads over dp x cp): [0, 1, 2, 3]" in out


@pytest.mark.slow
def test_wandb_offline_writes_a_run_directory(parity_runs):
    """Offline mode needs no account and leaves a real run directory with the run's history."""
    run_dirs = list((parity_runs[(1, 1, 2)]["dir"] / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 1, run_dirs  # the logging rank only
    run_files = list(run_dirs[0].glob("run-*.wandb"))
    assert run_files and run_files[0].stat().st_size > 0
    # The run file is a log of protobuf records; JSON values and keys are stored verbatim.
    # (wandb 0.31 reads it in its Go core only; these bytes are what `wandb sync` uploads.)
    content = run_files[0].read_bytes()
    for key in (b"n_layer", b"global_batch_size", b"layout", b"grad_norm", b"tokens_per_s"):
        assert key in content, key
    for m in parity_runs[(1, 1, 2)]["metrics"]:
        assert json.dumps(m["loss"]).encode() in content, m
