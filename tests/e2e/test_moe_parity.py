"""Layout parity for the mixture of experts (docs/design.md contract 18): recipes/moe-tiny.yaml
(every block MoE: 8 experts, 2 per token, one shared expert, Qwen3's q/k norm; clipping active) gives
the same losses, gradient norms, validation losses and router losses (load-balancing and z-loss),
fp32, relative difference <= 1e-5 per step, at (tp, pp, dp, ep) = (1,1,2,2), (2,2,2,2), (1,2,4,4),
(1,2,2,2) and, with sequence parallelism, (2,1,4,2), as at (1,1,1); the expert load of every block
(assignments per expert per step) is the same integer count; and ZB-H1, whose W passes defer the
experts' weight gradients too, is 1F1B to the bit at (1,2,2,2). The runs are the session's parity
runs (conftest.py: parity_runs, tags "moe" and "ep<N>").

The other balancing options, model.moe.balance=bias (the routers' expert biases) and
balance_scope=global_batch (f counted over the previous step's global batch), each the same at
(tp, cp, pp, dp, ep) = (1,2,1,1,2) as at (1,1,1), with a resume of the bias run at that layout
(the biases are read back from the checkpoint); and bf16 with the gradient-accumulation fusion at
(1,2,2,2) within bf16's tolerance of a bf16 (1,1,1)."""
import pytest

from helpers.launcher import MOE_TINY, launch_forked, read_metrics
from helpers.parity_runs import BALANCE_TAGS, BF16_RTOL, SAVE_AT, STEPS

RTOL = 1e-5
REFERENCE = (1, 1, 1, "moe")
LAYOUTS = [(1, 1, 2, "moe", "ep2"), (2, 2, 2, "moe", "ep2"), (1, 2, 4, "moe", "ep4"), (1, 2, 2, "moe", "ep2"),
           (2, 1, 4, "moe", "sp", "ep2")]
KEYS = ("loss", "grad_norm", "val_loss", "aux_loss", "z_loss")


def _id(layout) -> str:
    return "-".join(map(str, layout))


def assert_same_steps(ref, got, where) -> None:
    """Step by step: each of KEYS present in both or neither and within RTOL, the expert load the
    same integer counts."""
    for r, g in zip(ref, got):
        for key in KEYS:
            assert (key in g) == (key in r), (where, r["step"], key)
            if key in r:
                assert abs(g[key] - r[key]) <= RTOL * abs(r[key]), (where, r["step"], key, g[key], r[key])
        assert g["expert_load"] == r["expert_load"], (where, r["step"])


@pytest.mark.slow
def test_moe_reference_learns_with_clipping_and_balances(parity_runs):
    ref = parity_runs[REFERENCE]["metrics"]
    assert len(ref) == STEPS and ref[-1]["loss"] < ref[0]["loss"] - 0.05, [m["loss"] for m in ref]
    assert sum(m["grad_norm"] > 0.5 for m in ref) >= 3  # clipping acts
    # Every block's 8 experts (3 x 64 x 32 weights each); a token passes through 2 of them.
    total = 797_376  # launch/plan.py --recipe recipes/moe-tiny.yaml (vocabulary 4096)
    active = total - 4 * (8 - 2) * 3 * 64 * 32
    assert f"summary: {total:,} parameters ({active:,} active per token)" in parity_runs[REFERENCE]["stdout"]
    for m in ref:  # 2 assignments per token over 8 experts: a balanced router scores k = 2
        assert 1.9 < m["aux_loss"] < 2.5 and m["z_loss"] > 0, m
        assert set(m["expert_load"]) == {"0", "1", "2", "3"}
        assert all(sum(load) == 16 * 32 * 2 for load in m["expert_load"].values())  # every assignment, once


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=_id)
def test_moe_layout_matches_single_process(parity_runs, layout):
    ref, got = parity_runs[REFERENCE]["metrics"], parity_runs[layout]["metrics"]
    assert len(got) == len(ref) == STEPS
    assert_same_steps(ref, got, layout)


@pytest.mark.slow
def test_moe_zero_bubble_is_bitwise_1f1b(parity_runs):
    zb, one_f_one_b = parity_runs[(1, 2, 2, "moe", "ep2", "zb-h1")], parity_runs[(1, 2, 2, "moe", "ep2")]
    assert "schedule zb-h1" in zb["stdout"]
    assert [(m["loss"], m["grad_norm"], m["aux_loss"], m.get("val_loss")) for m in zb["metrics"]] == \
        [(m["loss"], m["grad_norm"], m["aux_loss"], m.get("val_loss")) for m in one_f_one_b["metrics"]]


@pytest.mark.slow
def test_role_map_shows_the_expert_parallel_groups(parity_runs):
    """EP groups are runs of ep ranks along each data axis (TP ranks adjacent, so a data axis
    strides by tp): at tp 2, dp 4, ep 2 the axes [0, 2, 4, 6] and [1, 3, 5, 7] split in two."""
    out = parity_runs[(2, 1, 4, "moe", "sp", "ep2")]["stdout"]
    assert "DP groups  (split the data, all-reduce grads): [0, 2, 4, 6] [1, 3, 5, 7]" in out
    assert "EP groups  (split the experts, all-to-all tokens): [0, 2] [4, 6] [1, 3] [5, 7]" in out


@pytest.mark.slow
@pytest.mark.parametrize("tag", sorted(BALANCE_TAGS))
def test_moe_balancing_option_matches_single_process_at_cp2_ep2(parity_runs, tag):
    ref = parity_runs[(1, 1, 1, "moe", tag)]["metrics"]
    got = parity_runs[(1, 1, 1, "moe", "cp2", "ep2", tag)]["metrics"]
    assert len(got) == len(ref) == STEPS
    assert_same_steps(ref, got, tag)
    # The option acts: the first step's choices are the recipe's own, and from step 3 on (its state
    # moved after steps 1 and 2) the losses differ from the per-micro-batch load-balancing loss's.
    plain = parity_runs[REFERENCE]["metrics"]
    assert ref[0]["expert_load"] == plain[0]["expert_load"]
    assert all(r["loss"] != p["loss"] for r, p in zip(ref[2:], plain[2:])), (tag, ref, plain)


@pytest.mark.slow
def test_moe_expert_biases_resume_at_another_layout(parity_runs, tmp_path):
    """The bias run saved after step SAVE_AT at (1,1,1), resumed at cp 2, ep 2: steps after it repeat
    the uninterrupted run's, which they would not with the biases reset to 0."""
    saved = parity_runs[(1, 1, 1, "moe", "bias")]
    metrics = tmp_path / "resumed.jsonl"
    settings = [arg for setting in BALANCE_TAGS["bias"] for arg in ("--set", setting)]
    proc = launch_forked(2, ["--recipe", str(MOE_TINY), "--steps", str(STEPS), "--cp", "2", "--ep", "2",
                             "--load", str(saved["dir"] / "ck" / f"step{SAVE_AT:08d}"),
                             "--metrics-out", str(metrics)] + settings)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "re-sharded" in proc.stdout
    resumed = {m["step"]: m for m in read_metrics(metrics)}
    uninterrupted = saved["metrics"][SAVE_AT:]
    assert_same_steps(uninterrupted, [resumed[r["step"]] for r in uninterrupted], "resumed at cp 2, ep 2")


@pytest.mark.slow
def test_moe_bf16_layout_matches_single_process(parity_runs):
    """bf16 with the gradient-accumulation fusion (the default): the experts' weight gradients added
    into the fp32 main gradients by the probed path (model/transformer/grouped_gemm.py)."""
    ref = parity_runs[(1, 1, 1, "moe", "bf16")]["metrics"]
    got = parity_runs[(1, 2, 2, "moe", "ep2", "bf16")]["metrics"]
    assert len(got) == len(ref) == STEPS and ref[-1]["loss"] < ref[0]["loss"] - 0.05
    for r, g in zip(ref, got):
        for key, rtol in BF16_RTOL.items():
            if key in r:
                assert abs(g[key] - r[key]) <= rtol * abs(r[key]), (r["step"], key, g[key], r[key])
