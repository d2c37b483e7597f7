"""Muon at every layout: the first 5 steps of recipes/tiny.yaml with train.optimizer=muon
(fp32, ZeRO-1: Muon inside DeepSpeed's ZeRO-1 optimizer, gradient clipping active) give the same
loss, gradient norm and validation loss, relative difference <= 1e-5, as at (1,1,1): at (tp, pp, dp) =
(2,2,2) and (4,1,2) with sequence parallelism (flat dp partitions sent to and from their owner
ranks, each owned matrix finished by one of the owner's TP peers from every peer's shard, fused
[Q; K; V] split), at (1,4,1) (stages without the embeddings), at
(1,1,2) with context parallelism 2 (the flat partitions over dp x cp = 4 ranks). recipes/moe-tiny.yaml
at (2,1,2) with expert parallelism 2 (each expert's fused gate-up and down, TP-gathered, owned within
the expert-data-parallel group) against its own (1,1,1) Muon run.
Muon's options at a layout, each against a (1,1,1) Muon run with the same options: (4,1,2) runs
Keller Jordan's lr rule (the whole matrix's shape, never a shard's: a shard's would scale the attention
output's update by 2 and c_fc's by 1/2 at tp 4) with an AdamW group of its own lr, betas and weight decay
(tests/helpers/parity_runs.py: MUON_TAGS). Newton-Schulz in bf16 is checked in process
(tests/runtime/test_muon.py): launched, a layout's fp32 rounding flips a few bf16 roundings of the
Newton-Schulz input, which Newton-Schulz amplifies (measured against the bf16 (1,1,1): (1,1,2) at
cp 2 2.0e-4 in gradient norm, 1.9e-6 in loss; (4,1,2) with SP 1.4e-4, 1.2e-6), as far as fp32's
Newton-Schulz lies from bf16's (1.6e-4, 1.3e-6), so such a run could not tell the option from its absence.
In bf16 (DeepSpeed's BF16 optimizer holds the fp32 master partition Muon updates, its pieces cut
otherwise than ZeRO-1's: launch/optim/muon_partitions.py), (1,1,2) against the bf16 (1,1,1) Muon
run, within the bf16 parity tolerances (tests/helpers/parity_runs.py: BF16_RTOL).
The update against Moonlight's written out per matrix: tests/runtime/test_muon.py."""
import pytest

from helpers.parity_runs import BF16_RTOL, MUON_TAGS, REFERENCE, STEPS

RTOL = 1e-5
# (tp, pp, dp) and tags (tests/helpers/parity_runs.py); each against the (1,1,1) Muon run of its recipe.
# (1,4,1): middle stages hold no embedding; DeepSpeed's ZeRO-1 norm needs as many param groups on every
# stage (launch/engine/engine.py: _muon_param_groups), else the step hangs.
# (4,1,2) with SP: four TP peers share each owner's Newton-Schulz (launch/optim/muon_tp_owners.py),
# with Keller Jordan's lr rule and the AdamW group's own settings ("keller").
LAYOUTS = [(2, 2, 2, "sp", "muon"), (4, 1, 2, "sp", "muon", "keller"), (1, 4, 1, "muon"), (1, 1, 2, "cp2", "muon"),
           (2, 1, 2, "moe", "ep2", "muon")]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: "-".join(map(str, layout)))
def test_muon_layout_matches_single_process(parity_runs, layout):
    recipe = ("moe",) if "moe" in layout else ()
    options = tuple(tag for tag in layout[3:] if tag in MUON_TAGS)
    ref = parity_runs[REFERENCE + recipe + ("muon",) + options]["metrics"]
    got = parity_runs[layout]["metrics"]
    assert len(got) == len(ref) == STEPS
    assert ref[-1]["loss"] < ref[0]["loss"] - 0.02, [m["loss"] for m in ref]  # Muon trains (moe-tiny: lr 1e-3)
    if options:  # the options change the run: the comparison is of runs with them
        default = parity_runs[REFERENCE + recipe + ("muon",)]["metrics"]
        assert _rel(ref[1]["loss"], default[1]["loss"]) > 100 * RTOL, (ref[1]["loss"], default[1]["loss"])
    if not recipe:  # and is not AdamW: the second step's loss differs by far more than the tolerance
        adamw = parity_runs[REFERENCE]["metrics"]
        assert _rel(ref[1]["loss"], adamw[1]["loss"]) > 100 * RTOL, (ref[1]["loss"], adamw[1]["loss"])
    for r, g in zip(ref, got):
        assert g["lr"] == r["lr"] and g["tokens"] == r["tokens"] and ("val_loss" in g) == ("val_loss" in r)
        for key in ("loss", "grad_norm", "val_loss"):
            if key in r:
                assert _rel(g[key], r[key]) <= RTOL, (layout, r["step"], key, g[key], r[key])


@pytest.mark.slow
def test_muon_bf16_matches_single_process(parity_runs):
    ref = parity_runs[REFERENCE + ("bf16", "muon")]["metrics"]
    got = parity_runs[(1, 1, 2, "bf16", "muon")]["metrics"]
    assert len(got) == len(ref) == STEPS and ref[-1]["loss"] < ref[0]["loss"] - 0.02, [m["loss"] for m in ref]
    fp32 = parity_runs[REFERENCE + ("muon",)]["metrics"]
    assert _rel(ref[1]["loss"], fp32[1]["loss"]) > 1e-5  # bf16 computes otherwise: the comparison is of bf16 runs
    for r, g in zip(ref, got):
        for key, rtol in BF16_RTOL.items():
            if key in r:
                assert _rel(g[key], r[key]) <= rtol, ("bf16", r["step"], key, g[key], r[key])
