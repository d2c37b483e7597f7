"""ZB-H1 (`train.schedule: zb-h1`, launch/analysis/zero_bubble_schedule.py): its instruction streams against
DeepSpeed's 1F1B TrainSchedule, its predicted bubble against the formulas of the two papers, and
real engines trained with both schedules side by side: the same losses, gradient norms and
gradients to the bit, at (1,2,1) in bf16, (2,2,2) with sequence parallelism, ZeRO-1 over dp 2 and
selective recompute, and (1,4,1) for Llama under full recompute."""
import json
from pathlib import Path

import pytest
import torch
from deepspeed.runtime.pipe import schedule

from helpers import chart_pixels
from helpers.distributed import run_distributed, uses_deepspeed
from launch.analysis import formulas, memory_formulas
from launch.analysis.pipeline_chart import COLOURS
from launch.analysis.schedule_sim import idle_fraction, instruction_streams, simulate_schedule
from launch.analysis.zero_bubble_schedule import BackwardInputPass, WeightPass, ZeroBubbleH1Schedule
from model.config import GPTConfig
from model.gpt.model import GPT
from model.parallel.cross_entropy import vocab_parallel_cross_entropy
from model.parallel.weight_grad import WEIGHT_GRADS

TINY = Path(__file__).resolve().parents[2] / "recipes" / "tiny.yaml"
DEMO = TINY.parent / "demo.yaml"
P2P = (schedule.SendActivation, schedule.RecvActivation, schedule.SendGrad, schedule.RecvGrad)


# ---------------------------------------------------------------- the instruction streams

@pytest.mark.parametrize("pp,m", [(2, 1), (2, 4), (3, 5), (4, 4), (4, 8), (8, 16)])
def test_streams_are_1f1b_with_the_backward_split(pp, m):
    """Against DeepSpeed's own TrainSchedule, stage by stage: the same sends and receives in the same
    order (so ZB-H1 pairs across stages, and cannot deadlock, exactly where 1F1B does not); the same
    forwards; each backward became a B pass; one W per micro-batch, after its B; and a stage keeps
    at most stage + 1 micro-batches' weight gradients pending after any of its steps, exactly
    stage + 1 at its fullest once m >= pp (with fewer micro-batches the idle steps drain them)."""
    for stage, (zb, ref) in enumerate(zip(instruction_streams("zb-h1", pp, m), instruction_streams("1f1b", pp, m))):
        def kinds(stream, types):
            return [(type(c).__name__, c.kwargs.get("buffer_id")) for c in stream if isinstance(c, types)]
        assert kinds(zb, P2P) == kinds(ref, P2P)
        assert kinds(zb, schedule.ForwardPass) == kinds(ref, schedule.ForwardPass)
        assert ([c.buffer_id for c in zb if isinstance(c, BackwardInputPass)]
                == [c.buffer_id for c in ref if isinstance(c, schedule.BackwardPass)])
        assert not any(isinstance(c, schedule.BackwardPass) for c in zb)
        pending, most = 0, 0  # most: the largest number pending at the end of a schedule step
        for step in ZeroBubbleH1Schedule(micro_batches=m, stages=pp, stage_id=stage):
            for cmd in step:
                if isinstance(cmd, BackwardInputPass):
                    pending += 1
                elif isinstance(cmd, WeightPass):
                    assert pending > 0, "a W pass before its B pass"
                    pending -= 1
                elif isinstance(cmd, schedule.ReduceTiedGrads):
                    assert pending == 0, "weight gradients left for after the step's reductions"
            most = max(most, pending)
        if m >= pp:
            assert most == stage + 1, (stage, most)
        else:
            assert most <= min(stage + 1, m), (stage, most)


@pytest.mark.parametrize("pp,m", [(2, 4), (2, 8), (4, 4), (4, 8), (8, 16)])
def test_predicted_bubbles_are_the_papers(pp, m):
    """Equal stages, T_F = T_B = T_W = 1: 1F1B idles (p-1)/(m+p-1) [Narayanan et al. 2021]; ZB-H1's
    step is 3m + (p-1)(T_F + T_B - T_W) long [Qi et al. 2023, sec. 3.1], a third of 1F1B's bubble."""
    ones = [1.0] * pp
    one_f_one_b = simulate_schedule("1f1b", pp, m, ones, ones, ones)
    zb = simulate_schedule("zb-h1", pp, m, ones, ones, ones)
    assert idle_fraction(one_f_one_b) == pytest.approx(formulas.bubble_fraction(pp, m))
    assert max(e[4] for e in zb) == pytest.approx(3 * m + (pp - 1))
    assert idle_fraction(zb) == pytest.approx((pp - 1) / (3 * m + pp - 1))
    for stage in range(pp):  # every pass once per micro-batch, W after its own B
        done = {(e[1], e[2]): e for e in zb if e[0] == stage}
        assert sorted(done) == sorted((kind, i) for kind in "FBW" for i in range(m))
        assert all(done[("W", i)][3] >= done[("B", i)][4] for i in range(m))


# ---------------------------------------------------------------- the planner

def _plan(capsys, *extra):
    from launch.plan import main
    assert main(["--recipe", str(DEMO), "--gpus", "4", "--pp", "4", "--layers", "8", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_planner_knows_both_schedules(capsys, tmp_path):
    """`launch/plan.py --schedule zb-h1`: a smaller simulated bubble and step than 1F1B's for the same
    stages, the stash in each stage's memory (the last stage holds the most), and a chart whose
    every stage row shows W boxes."""
    one_f_one_b, zb = _plan(capsys), _plan(capsys, "--schedule", "zb-h1", "--plot", str(tmp_path / "zb.png"))
    assert zb["stage_parts"] == one_f_one_b["stage_parts"]
    assert zb["bubble_fraction"] < one_f_one_b["bubble_fraction"] and zb["step_time_s"] < one_f_one_b["step_time_s"]
    assert all(stage["weight_grad_stash"] == 0 for stage in one_f_one_b["memory_per_stage_bytes"])
    stash = [stage["weight_grad_stash"] for stage in zb["memory_per_stage_bytes"]]
    assert min(stash) > 0 and stash[-1] == max(stash)
    rgb = chart_pixels.read_rgb(tmp_path / "zb.png")
    (top, bottom), (left, right) = chart_pixels.schedule_area(rgb)
    schedule_pixels = rgb[top:bottom, left:right]
    boxes = [chart_pixels.colour_mask(schedule_pixels, COLOURS[kind]) for kind in "FBW"]
    rows = chart_pixels.box_rows(boxes[0] | boxes[1] | boxes[2])
    assert len(rows) == 4 and all(chart_pixels.boxes_in_row(boxes[2], row) > 0 for row in rows)


# ---------------------------------------------------------------- what the deferred work holds

def _held_bytes_against_formula(arch: str, sequence_parallel: bool = False, n_kv_head: int = 2, tp_group=None):
    config = GPTConfig(n_layer=2, n_head=4, n_embd=32, seq_len=16, vocab_size=101, vocab_pad_multiple=4, seed=3,
                       arch=arch, sequence_parallel=sequence_parallel,
                       **({"n_kv_head": n_kv_head} if arch == "llama" else {}))
    tp = 1 if tp_group is None else torch.distributed.get_world_size(tp_group)
    micro = 3
    model = GPT(config, tp_group)
    ids = torch.randint(0, config.vocab_size, (micro, config.seq_len + 1), generator=torch.Generator().manual_seed(0))
    WEIGHT_GRADS.enabled = True
    try:
        loss = vocab_parallel_cross_entropy(model(ids[:, :-1]), ids[:, 1:], None).mean()
        with WEIGHT_GRADS.deferring():
            loss.backward()
        WEIGHT_GRADS.seal_microbatch()
        held = WEIGHT_GRADS.held_bytes()
        gathered = ("qkv_proj",) if tp > n_kv_head else ()  # part of the fused weight gathered: not a leaf
        multiplied = {n: p for n, p in model.named_parameters() if p.dim() == 2 and not n.startswith(("embed.", "pos."))}
        assert multiplied and all((p.grad is None) != any(g in n for g in gathered) for n, p in multiplied.items())
        WEIGHT_GRADS.compute_oldest()
    finally:
        WEIGHT_GRADS.enabled = False
    expected = (config.n_layer * memory_formulas.weight_grad_stash_bytes_per_layer(
        config, config.seq_len, micro, tp, sequence_parallel, element_bytes=4)
        + memory_formulas.head_weight_grad_stash_bytes(config, config.seq_len, micro, tp, element_bytes=4))
    assert held == expected, (held, expected)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_held_memory_is_the_formula(arch):
    """After a B pass of the single-process model, the distinct storages the deferred weight
    gradients hold equal the stash formulas: per block, and the output layer's (b, s, V) gradient."""
    _held_bytes_against_formula(arch)


def _held_bytes_at_tp2():
    from model.parallel.state import init_parallel_state
    group = init_parallel_state(2, 1).tp_group
    for arch, sp, kv in [("gpt2", False, 4), ("gpt2", True, 4), ("llama", True, 2), ("llama", False, 1),
                         ("llama", True, 1)]:
        _held_bytes_against_formula(arch, sp, kv, group)


def test_held_memory_is_the_formula_at_tp2():
    """The same per TP rank at tp=2: with and without sequence parallelism, and with a key/value
    head shared by both ranks (its weights gathered: their gradients are not deferred)."""
    run_distributed(_held_bytes_at_tp2, 2)


# ---------------------------------------------------------------- real engines, both schedules

def _train(schedule_name: str, tp: int, pp: int, overrides: list, steps: int):
    """(losses, grad norms, first step's gradients before any reduction, the gradients each W pass
    changed, micro-batches per step, first stage?, weight matrices) of a tiny run's `steps` steps
    on this rank's engine."""
    import torch.distributed as dist

    from launch.config.layout import check_and_derive_layout
    from launch.config.recipe import load_recipe
    from launch.engine.engine import build_engine
    from launch.optim.grad_norm import last_grad_norm
    from model.parallel.state import init_parallel_state

    recipe = load_recipe(TINY, [f"train.schedule={schedule_name}"] + overrides)
    layout = check_and_derive_layout(recipe, dist.get_world_size(), tp, pp, True)
    state = init_parallel_state(tp, pp)
    config = recipe.gpt_config(4096)
    engine, own_norm = build_engine(recipe, layout, state, config)
    tokens = torch.randint(0, 4096, (steps * layout.grad_accum_steps, layout.micro_batch_size, config.seq_len + 1),
                           generator=torch.Generator().manual_seed(dist.get_rank() // tp))
    first_grads, weight_pass_updates = {}, []

    def grads_of(module):  # DeepSpeed's BF16 optimizer accumulates in fp32 beside the bf16 .grad
        grads = {name: getattr(param, "_hp_grad", None) for name, param in module.named_parameters()}
        grads = {name: grad if grad is not None else param.grad for (name, grad), param
                 in zip(grads.items(), module.parameters())}
        return {name: grad.detach().clone() for name, grad in grads.items() if grad is not None}

    handlers = dict(engine._INSTRUCTION_MAP)
    reduce_tied = handlers[schedule.ReduceTiedGrads]

    def snapshot_then_reduce(eng, **kwargs):
        if not first_grads:
            first_grads.update(grads_of(eng.module))
        reduce_tied(eng, **kwargs)
    handlers[schedule.ReduceTiedGrads] = snapshot_then_reduce
    if WeightPass in handlers:
        weight_pass = handlers[WeightPass]

        def counting_weight_pass(eng, **kwargs):
            before = grads_of(eng.module)
            weight_pass(eng, **kwargs)
            after = grads_of(eng.module)
            weight_pass_updates.append(sorted(name for name, grad in after.items()
                                              if name not in before or not torch.equal(before[name], grad)))
        handlers[WeightPass] = counting_weight_pass
    engine._INSTRUCTION_MAP = handlers
    losses, norms = [], []
    for step in range(steps):
        chunk = tokens[step * layout.grad_accum_steps:(step + 1) * layout.grad_accum_steps]
        losses.append(engine.train_batch(iter([(t[:, :-1], t[:, 1:]) for t in chunk])).item())
        norms.append(last_grad_norm(engine, own_norm))  # ZeRO-0 at dp 1: ours
    matrices = [name for name, param in engine.module.named_parameters() if param.dim() == 2]
    return losses, norms, first_grads, weight_pass_updates, layout.grad_accum_steps, engine.is_first_stage(), matrices


@uses_deepspeed
def _zero_bubble_matches_1f1b(tp: int, pp: int, overrides: list, steps: int):
    losses, norms, grads, _, _, _, _ = _train("1f1b", tp, pp, overrides, steps)
    zb_losses, zb_norms, zb_grads, updates, m, first_stage, matrices = _train("zb-h1", tp, pp, overrides, steps)
    assert zb_losses == losses and zb_norms == norms, (zb_losses, losses, zb_norms, norms)
    assert zb_grads.keys() == grads.keys() and grads
    different = [name for name in grads if not torch.equal(zb_grads[name], grads[name])]
    assert not different, different
    # The W passes did the work: m per step, each adding to every weight matrix of the stage's
    # linears (all matrices but the first stage's embedding tables, which are looked up, not multiplied).
    assert len(updates) == m * steps
    looked_up = ("tied_modules.embed.wte.weight", "0.wte.weight", "1.wpe") if first_stage else ()
    matrices = sorted(name for name in matrices if name not in looked_up)
    assert all(update == matrices for update in updates), (updates[0], matrices)



@pytest.mark.parametrize("tp,pp,dp,overrides", [
    (1, 2, 1, ["train.precision=bf16"]),
    pytest.param(2, 2, 2, ["model.sequence_parallel=true", "train.recompute=selective", "model.dropout=0.1"],
                 marks=pytest.mark.slow),
    pytest.param(1, 4, 1, ["model.arch=llama", "model.n_kv_head=2", "train.recompute=full"], marks=pytest.mark.slow),
], ids=["1-2-1-bf16", "2-2-2-sp-selective-dropout", "1-4-1-llama-full-recompute"])
def test_zero_bubble_trains_the_same_model_as_1f1b(tp, pp, dp, overrides):
    run_distributed(_zero_bubble_matches_1f1b, tp * pp * dp, tp, pp, overrides, 2)
