"""launch/analysis/partition.py: the balanced cut is optimal (against brute force over every
split) and never worse than counting blocks, explicit lists are honoured, old checkpoints read as
counted by blocks; the 1F1B simulation with per-stage times against hand-derived spans; the
planner's per-stage report. The cut against DeepSpeed's real PipelineModule: tests/analysis/test_plan.py."""
import itertools
from pathlib import Path

import pytest

from launch.analysis import partition
from launch.analysis.device_profile import DeviceProfile
from launch.analysis.formulas import PEAK_FLOPS_BF16
from launch.analysis.schedule_sim import idle_fraction, simulate_schedule
from launch.plan import main
from model.config import ModelConfig

GPT2 = dict(n_head=4, n_embd=64, seq_len=32)
LLAMA = dict(arch="llama", n_head=4, n_kv_head=2, n_embd=64, seq_len=32)

DEMO = str(Path(__file__).resolve().parents[2] / "recipes" / "demo.yaml")


def _model(n_layer: int, vocab: int, **dims) -> ModelConfig:
    return ModelConfig(n_layer=n_layer, vocab_size=vocab, **dims).resolved()


def _largest_stage(model: ModelConfig, parts) -> int:
    return max(f + b for f, b in partition.stage_flops(model, parts, micro_batch=2))


def _every_split(n_layer: int, pp: int):
    """Every way to give pp stages >= 1 block each: the independent reference."""
    for cuts in itertools.combinations(range(1, n_layer), pp - 1):
        bounds = (0,) + cuts + (n_layer,)
        yield [bounds[k + 1] - bounds[k] for k in range(pp)]


@pytest.mark.parametrize("dims", [GPT2, LLAMA], ids=["gpt2", "llama"])
@pytest.mark.parametrize("n_layer,pp", [(4, 2), (5, 3), (6, 4), (7, 3), (8, 2)])
@pytest.mark.parametrize("vocab", [256, 4096, 50000])  # the head worth under one block, about 5, about 60
def test_balanced_is_the_optimum_and_never_worse_than_blocks(dims, n_layer, pp, vocab):
    model = _model(n_layer, vocab, **dims)
    balanced = partition.stage_partition(model, pp, "balanced")
    best = min(_largest_stage(model, partition.stage_partition(model, pp, counts))
               for counts in _every_split(n_layer, pp))
    assert _largest_stage(model, balanced) == best
    assert best <= _largest_stage(model, partition.stage_partition(model, pp, "blocks"))
    assert all(n >= 1 for n in partition.blocks_per_stage(model, balanced))


def test_demo_recipe_at_pp2_moves_a_block_off_the_head_stage():
    """recipes/demo.yaml (h 128, s 128, V 4096): blocks [2, 2] leave stage 1 at twice stage 0's
    FLOPs; balanced [3, 1] is within 10%."""
    demo = _model(4, 4096, n_head=4, n_embd=128, seq_len=128)
    parts = partition.stage_partition(demo, 2)
    assert partition.blocks_per_stage(demo, parts) == [3, 1]
    first, last = (f + b for f, b in partition.stage_flops(demo, parts, 4))
    assert abs(last - first) / last < 0.1
    first, last = (f + b for f, b in partition.stage_flops(demo, partition.stage_partition(demo, 2, "blocks"), 4))
    assert last > 2 * first


def test_explicit_lists_are_honoured():
    model = _model(6, 4096, **GPT2)
    # layers: embed, wpe, block 0-5, ln_f, head
    assert partition.stage_partition(model, 3, [1, 2, 3]) == [0, 3, 5, 10]
    assert partition.stage_partition(model, 2, [6, 0]) == [0, 8, 10]  # the last stage: ln_f and the head only
    assert partition.blocks_per_stage(model, partition.stage_partition(model, 3, [4, 1, 1])) == [4, 1, 1]


def test_recompute_and_seq_len_enter_the_costs():
    model = _model(8, 50000, **GPT2)
    plain = partition.layer_flops(model, 1)
    recomputed = partition.layer_flops(model, 1, recompute=True)
    block = plain.index(max(plain[:-1]))
    assert recomputed[block][0] == plain[block][0] and recomputed[block][1] == 3 * plain[block][0]
    assert recomputed[-1] == plain[-1]  # the head is never recomputed
    assert partition.layer_flops(model, 1, seq_len=16)[block][0] < plain[block][0]


def test_per_stage_simulation_against_hand_derived_spans():
    """p=2, m=8: with the last stage the slower it never idles after its first input,
    span = F0 + m (F1 + B1) + B0; with the first stage the slower it never idles at all, span = m (F0 + B0)."""
    m = 8
    assert max(e[4] for e in simulate_schedule("1f1b", 2, m, [1.0, 3.0], [2.0, 6.0])) == pytest.approx(1 + m * 9 + 2)
    assert max(e[4] for e in simulate_schedule("1f1b", 2, m, [3.0, 1.0], [6.0, 2.0])) == pytest.approx(m * 9)
    # A list of equal times is the plain call.
    assert simulate_schedule("1f1b", 4, m, [1.0] * 4, [2.0] * 4) == simulate_schedule("1f1b", 4, m, 1.0, 2.0)
    # Stage 0 busy 8 * 3 of 75: idle share (75 - 24 + 75 - 72) / 150.
    assert idle_fraction(simulate_schedule("1f1b", 2, m, [1.0, 3.0], [2.0, 6.0])) == pytest.approx((51 + 3) / 150)


@pytest.fixture
def compute_only(tmp_path) -> list:
    """A device profile of the H100's flat 50% of peak and no memory-bandwidth floor: the demo's
    hidden 128 is bound by its weights' traffic on an H100, and these tests are about the stages'
    FLOPs (the floor: tests/analysis/test_calibrated_planner.py)."""
    profile = DeviceProfile(device="H100 compute only", source="datasheet", flat_rate=0.5 * PEAK_FLOPS_BF16["H100"])
    profile.save(tmp_path / "compute-only.json")
    return ["--profile", str(tmp_path / "compute-only.json")]


def _plan(capsys, compute_only, *extra):
    assert main(["--recipe", DEMO, "--gpus", "2", "--pp", "2", "--json", *compute_only, *extra]) == 0
    import json
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_planner_balanced_beats_blocks_on_the_demo(capsys, compute_only):
    balanced, blocks = _plan(capsys, compute_only), _plan(capsys, compute_only, "--partition", "blocks")
    assert balanced["blocks_per_stage"] == [3, 1] and blocks["blocks_per_stage"] == [2, 2]
    assert balanced["step_time_s"] < blocks["step_time_s"]
    assert balanced["bubble_fraction"] < blocks["bubble_fraction"]
    assert balanced["bubble_fraction_equal_stages"] == pytest.approx(1 / 9)
    assert abs(balanced["bubble_fraction"] - 1 / 9) < 0.05  # near the equal stages' bubble, as predicted
    assert _plan(capsys, compute_only, "--partition", "1,3")["blocks_per_stage"] == [1, 3]


def test_planner_text_shows_each_stage(capsys, compute_only):
    assert main(["--recipe", DEMO, "--gpus", "2", "--pp", "2", *compute_only]) == 0
    out = capsys.readouterr().out
    for text in ["stages (balanced partition)", "stage 0: 3 blocks", "stage 1: 1 block + head", "(52% of the compute)",
                 "simulated with the stages below: 0.13"]:
        assert text in out, text


@pytest.mark.parametrize("value,words", [("2,1", ["train.partition=[2, 1]", "summing to 4"]),
                                         ("even", ["--partition 'even'", "balanced, blocks"])])
def test_planner_refuses_a_bad_partition(value, words, capsys):
    assert main(["--recipe", DEMO, "--gpus", "2", "--pp", "2", "--partition", value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(w in err for w in words), err
