"""The planner at train.virtual_stages = v > 1 (interleaved 1F1B, Narayanan et al. 2021, sec. 2.2.2):
its bubble against the published (p-1)/(v m + p-1) for equal stages, its activation memory against
the order's own count of chunks held, the search's and --layout auto's candidates against the run's
refusals (check_virtual_stages), and launch/plan.py --virtual-stages's bad input. In-process, no
engine."""
import dataclasses
import json
from pathlib import Path

import pytest

from launch.analysis import formulas
from launch.analysis.interleaved_schedule import interleaved_order, peak_in_flight
from launch.analysis.plan_setup import GPUS, Hardware, Setup
from launch.analysis.planner import VIRTUAL_STAGES, candidates, estimate_plan, estimate_step_time, search
from launch.config.recipe import load_recipe
from launch.plan import main
from model.config import ModelConfig

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
MOE_TINY, TINY = RECIPES / "moe-tiny.yaml", RECIPES / "tiny.yaml"  # 4 blocks each
H100 = GPUS["H100"]
HW = Hardware(peak_flops=H100.peak_flops, intra_node_bw=H100.intra_node_bw, inter_node_bw=H100.inter_node_bw)
DENSE = ModelConfig(n_layer=8, n_embd=256, n_head=4, seq_len=128, vocab_size=512)


def _equal_stages(p: int, v: int, m: int):
    """estimate_step_time with p identical stages (2 blocks each, no edge layers, one node)."""
    setup = Setup(gpus=p, tp=1, pp=p, micro_batch=1, global_batch=m, virtual_stages=v)
    bandwidth = {dim: H100.intra_node_bw for dim in ("tp", "cp", "ep", "pp", "data", "expert_data")}
    return estimate_step_time(DENSE, setup, HW, [2] * p, [(10 ** 12, 2 * 10 ** 12)] * p, [10 ** 12] * p, 1, m, 0,
                              bandwidth)


@pytest.mark.parametrize("p,v,m", [(4, 2, 4), (4, 2, 8), (2, 4, 2)])
def test_bubble_is_the_interleaved_one_for_equal_stages(p, v, m):
    time, stages = _equal_stages(p, v, m)
    # [N21] sec. 2.2.2: (p-1)/v slots of idle per rank, (p-1)/(v m + p-1) of the step.
    assert stages["bubble_fraction"] == pytest.approx(formulas.interleaved_bubble_fraction(p, m, v), rel=1e-9)
    assert time["bubble"] == pytest.approx((p - 1) / v * stages["slot_s"][0], rel=1e-9)
    if m == p:  # the same layout at v = 1: 1F1B's (p-1)/(m+p-1), larger
        _, flat = _equal_stages(p, 1, m)
        assert flat["bubble_fraction"] == pytest.approx(formulas.bubble_fraction(p, m), rel=1e-9)
        assert stages["bubble_fraction"] < flat["bubble_fraction"]


def test_memory_counts_the_warm_up_activations_and_traffic():
    p, v, m = 4, 2, 8
    setup = Setup(gpus=p, tp=1, pp=p, micro_batch=1, global_batch=m, precision="bf16", virtual_stages=v)
    plan, flat = estimate_plan(DENSE, setup, HW), estimate_plan(DENSE, dataclasses.replace(setup, virtual_stages=1), HW)
    s, b, h, a = DENSE.seq_len, 1, DENSE.n_embd, DENSE.n_head
    # Korthikanti et al. 2022's 34 s b h bytes a block in 16-bit less its two dropout masks (2 s b h:
    # dropout 0), flash attention's fp32 log-sum-exp instead of the scores (4 a s b), and two
    # LayerNorms' fp32 mean and 1/std per token (16 s b).
    per_block = (34 - 2) * s * b * h + 4 * a * s * b + 16 * s * b
    # Rank 0's chunks alive at the peak of the order as run (each 1/v of the stage): p + (p-1)/v = 5.5.
    held = peak_in_flight(interleaved_order(p, v, m)[0]) / v
    assert held == pytest.approx(p + (p - 1) / v) and held > p
    blocks = plan["blocks_per_stage"][0]
    assert plan["memory_per_stage_bytes"][0]["activations"] == pytest.approx(held * blocks * per_block, rel=1e-6)
    assert flat["memory_per_stage_bytes"][0]["activations"] == pytest.approx(p * blocks * per_block, rel=1e-6)
    # Each micro-batch crosses p v - 1 boundaries; rank 0 sends v activations a micro-batch.
    assert plan["pp_messages_per_step"] == m * (p * v - 1) and flat["pp_messages_per_step"] == m * (p - 1)
    assert plan["comm_bytes_per_step"]["pp"] == v * flat["comm_bytes_per_step"]["pp"]
    assert plan["bubble_fraction"] < flat["bubble_fraction"]


def _vs(plans):
    return {plan["virtual_stages"] for plan in plans}


def test_search_never_proposes_a_refused_v():
    dense = dataclasses.replace(load_recipe(TINY, []).model, vocab_size=512)
    setup = Setup(gpus=4, tp=1, pp=1, micro_batch=2, global_batch=16, precision="fp32", zero=1)
    compiled = dataclasses.replace(setup, compile=True)
    offered = {c.virtual_stages for c in candidates(dense, compiled, virtual_stages=VIRTUAL_STAGES)}
    assert offered > {1}  # the layers divide: v = 2 and 4 are tried, and refused (compiled blocks)
    assert _vs(search(dense, compiled, HW)) == {1}
    assert _vs(search(dense, setup, HW)) > {1}  # the run takes them
    moe = dataclasses.replace(load_recipe(MOE_TINY, []).model, vocab_size=512)
    assert _vs(search(moe, setup, HW)) > {1}  # experts too


def test_layout_auto_never_picks_a_refused_v(monkeypatch):
    from launch.autotune import auto_layout
    monkeypatch.setattr(auto_layout, "_hardware", lambda *args: HW)
    ranked, _, _ = auto_layout.rank_layouts(load_recipe(TINY, ["train.compile=true"]), 4, {}, 512, 4, on_cpu=False)
    assert ranked and _vs(ranked) == {1}
    ranked, _, _ = auto_layout.rank_layouts(load_recipe(MOE_TINY, []), 4, {}, 512, 4, on_cpu=False)
    assert _vs(ranked) > {1}


SMALL = ["--hidden", "256", "--heads", "4", "--seq-len", "128", "--vocab", "512", "--gpus", "4", "--pp", "4",
         "--micro-batch", "1", "--virtual-stages", "3"]


@pytest.mark.parametrize("argv,words", [
    (["--layers", "10", "--global-batch", "8"], ["virtual_stages=3", "n_layer=10", "pp x v = 12"]),
    (["--layers", "26", "--global-batch", "8", "--partition", "blocks"], ["n_layer=26", "pp x v = 12"]),
    (["--layers", "24", "--global-batch", "6"], ["6 micro-batches", "multiple of 4"]),
])
def test_bad_virtual_stages_is_one_line_and_exit_2(argv, words, capsys):
    assert main(SMALL + argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("error: ") and captured.err.count("\n") == 1, captured.err
    for word in words:
        assert word in captured.err, (word, captured.err)


def test_report_prints_the_interleaved_formula(capsys):
    assert main(SMALL[:-1] + ["2", "--layers", "8", "--global-batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "interleaved 1F1B bubble, v = 2 chunks per rank: (p-1)/(v m+p-1) = 3/19" in out
    assert main(SMALL[:-1] + ["2", "--layers", "8", "--global-batch", "8", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plan["virtual_stages"] == 2 and plan["bubble_fraction_equal_stages"] == pytest.approx(3 / 19)


def test_run_summary_prints_the_interleaved_formula():
    from launch.config.layout import Layout
    from launch.instruments.metrics import run_arithmetic
    layout = Layout(world_size=4, tp=1, pp=4, dp=1, micro_batch_size=1, global_batch_size=8, grad_accum_steps=8)
    from model.config import GPTConfig
    config = GPTConfig(n_layer=4, n_head=4, n_embd=32, seq_len=16, vocab_size=101)
    summary = run_arithmetic(config, layout, 16, 10, None, 2).summary()
    assert "interleaved 1F1B bubble predicted (p-1)/(v m+p-1) = 3/19 = 15.8% (v = 2 chunks per rank)" in summary
    assert "1F1B bubble predicted (p-1)/(m+p-1) = 3/11 = 27.3%" in run_arithmetic(config, layout, 16, 10).summary()


def test_recipe_switches_the_run_refuses_at_v_above_1():
    """A recipe's train.compile reaches the run's check_virtual_stages (at v = 1 nothing); its
    data.document_mask does too, which interleaved stages run."""
    from launch.analysis.plan_setup import check_setup
    from launch.errors import ConfigError
    setup = Setup(gpus=2, tp=1, pp=2, micro_batch=1, global_batch=4, compile=True)
    check_setup(DENSE, setup)
    with pytest.raises(ConfigError, match="virtual_stages=2 with train.compile"):
        check_setup(DENSE, dataclasses.replace(setup, virtual_stages=2))
    check_setup(DENSE, dataclasses.replace(setup, compile=False, document_mask=True, virtual_stages=2))
