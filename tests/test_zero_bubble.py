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

import chart_pixels
from distributed import run_distributed, uses_deepspeed
from launch.analysis import formulas, memory_formulas
from launch.analysis.pipeline_chart import COLOURS, idle_fraction
from launch.analysis.schedule_sim import instruction_streams, simulate_schedule
from launch.analysis.zero_bubble_schedule import BackwardInputPass, WeightPass, ZeroBubbleH1Schedule
from model.gpt import GPT, GPTConfig
from model.loss import vocab_parallel_cross_entropy
from model.weight_grad import WEIGHT_GRADS

TINY = Path(__file__).resolve().parent.parent / "recipes" / "tiny.yaml"
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
        gathered = (("q_proj", "k_proj", "v_proj") if sequence_parallel else ("k_proj", "v_proj")) if tp > n_kv_head else ()
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


def test_compiled_blocks_defer_their_weight_gradients():
    """With `train.compile` and no full recompute a block's first forward runs outside any B pass,
    where AOT autograd traces its backward: the deferral must still be decided when B runs. Two
    micro-batches through compiled blocks, each forward outside the deferral and its backward
    inside (the B pass): after B every block matrix is without gradient and the store holds what
    eager's holds; after W every matrix has its gradient. Losses and gradients equal eager's
    within the compile tolerance (tests/test_compile.py)."""
    import copy

    from torch._dynamo.utils import counters

    from model.compiled import compile_blocks

    config = GPTConfig(n_layer=2, n_head=4, n_embd=32, seq_len=16, vocab_size=101, vocab_pad_multiple=4, seed=3)
    eager = GPT(config, None)
    compiled = copy.deepcopy(eager)
    assert compile_blocks(compiled) == config.n_layer
    ids = torch.randint(0, config.vocab_size, (2, 3, config.seq_len + 1), generator=torch.Generator().manual_seed(0))

    def b_then_w(model, batch):
        loss = vocab_parallel_cross_entropy(model(batch[:, :-1]), batch[:, 1:], None).mean()
        with WEIGHT_GRADS.deferring():
            loss.backward()
        WEIGHT_GRADS.seal_microbatch()
        matrices = [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.dim() == 2]
        assert len(matrices) == 4 * config.n_layer and all(p.grad is None for p in matrices)
        held = WEIGHT_GRADS.held_bytes()
        WEIGHT_GRADS.compute_oldest()
        assert all(p.grad is not None for p in matrices)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return loss.item(), held, grads

    graphs = counters["stats"]["unique_graphs"]
    WEIGHT_GRADS.enabled = True
    try:
        for batch in ids:
            (loss, held, grads), (eager_loss, eager_held, eager_grads) = b_then_w(compiled, batch), b_then_w(eager, batch)
            assert held == eager_held > 0 and loss == pytest.approx(eager_loss, rel=1e-6)
            for name, grad in eager_grads.items():
                torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    finally:
        WEIGHT_GRADS.enabled = False
    assert counters["stats"]["unique_graphs"] > graphs  # the blocks did run compiled


def _held_bytes_at_tp2():
    from model.parallel_state import init_parallel_state
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
    from launch.runtime.engine import build_engine
    from model.parallel_state import init_parallel_state

    recipe = load_recipe(TINY, [f"train.schedule={schedule_name}"] + overrides)
    layout = check_and_derive_layout(recipe, dist.get_world_size(), tp, pp, True)
    state = init_parallel_state(tp, pp)
    config = recipe.gpt_config(4096)
    engine, _ = build_engine(recipe, layout, state, config)
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
        norms.append(float(engine.get_global_grad_norm()))
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


def _zero_bubble_engine(compiled: bool = False):
    """(engine, layout, a step function: batch index -> loss) of tiny at (1,2,1) under zb-h1."""
    import torch.distributed as dist

    from launch.config.layout import check_and_derive_layout
    from launch.config.recipe import load_recipe
    from launch.runtime.engine import build_engine
    from model.parallel_state import init_parallel_state

    recipe = load_recipe(TINY, ["train.schedule=zb-h1"])
    layout = check_and_derive_layout(recipe, dist.get_world_size(), 1, 2, True)
    engine, _ = build_engine(recipe, layout, init_parallel_state(1, 2), recipe.gpt_config(4096), compiled)
    tokens = torch.randint(0, 4096, (2, layout.grad_accum_steps, layout.micro_batch_size, recipe.seq_len + 1),
                           generator=torch.Generator().manual_seed(0))

    def step(batch):
        return engine.train_batch(iter([(t[:, :-1], t[:, 1:]) for t in tokens[batch]])).item()
    return engine, layout, step


def _weight_matrices(engine) -> list:
    """The weight matrices the stage multiplies, each a deferred weight gradient per micro-batch
    (the first stage's embedding tables are looked up; the last stage's tied copy is the head's)."""
    looked_up = ("tied_modules.embed.wte.weight", "0.wte.weight", "1.wpe") if engine.is_first_stage() else ()
    return [n for n, p in engine.module.named_parameters() if p.dim() == 2 and n not in looked_up]


@uses_deepspeed
def _first_step_check():
    from launch.runtime.zero_bubble import WEIGHT_PASSES, check_weight_passes_ran

    engine, layout, step = _zero_bubble_engine()
    zero_bubble_schedule = engine._train_schedule
    # What a DeepSpeed that builds its schedule inline does: the engine's own TrainSchedule (1F1B).
    engine._train_schedule = lambda: schedule.TrainSchedule(micro_batches=engine.micro_batches,
                                                            stages=engine.num_stages, stage_id=engine.stage_id)
    step(0)
    with pytest.raises(RuntimeError, match=f"stage {engine.stage_id}'s first step ran 0 W passes computing no "
                                           f"weight gradient: its backward was 1F1B's"):
        check_weight_passes_ran(engine)
    engine._train_schedule = zero_bubble_schedule
    step(1)
    check_weight_passes_ran(engine)
    assert WEIGHT_PASSES.passes == layout.grad_accum_steps
    assert WEIGHT_PASSES.gradients == layout.grad_accum_steps * len(_weight_matrices(engine))


def test_first_step_check_fails_when_no_weight_pass_ran():
    """A real pp = 2 zb-h1 engine: the check after the first step fails (one line) when the
    engine ran DeepSpeed's own TrainSchedule instead (the override ignored), and passes once the
    ZB-H1 schedule's W passes computed the stage's weight gradients."""
    run_distributed(_first_step_check, 2)


@uses_deepspeed
def _compiled_engine_defers():
    from launch.runtime.zero_bubble import WEIGHT_PASSES, check_weight_passes_ran

    eager, _, eager_step = _zero_bubble_engine()
    eager_losses = [eager_step(0), eager_step(1)]
    engine, layout, step = _zero_bubble_engine(compiled=True)
    losses = [step(0)]
    check_weight_passes_ran(engine)
    assert WEIGHT_PASSES.gradients == layout.grad_accum_steps * len(_weight_matrices(engine))
    losses.append(step(1))
    assert losses == pytest.approx(eager_losses, rel=1e-5), (losses, eager_losses)


@pytest.mark.slow  # two ranks compiling on two cores
def test_compiled_blocks_defer_in_a_zero_bubble_engine():
    """train.compile without full recompute at (1,2,1) under zb-h1: the W passes of the first step
    compute every weight matrix's gradient of each stage (none done in B by the compiled blocks),
    and the losses equal the eager engine's within the compile tolerance."""
    run_distributed(_compiled_engine_defers, 2)


@pytest.mark.parametrize("tp,pp,dp,overrides", [
    (1, 2, 1, ["train.precision=bf16"]),
    pytest.param(2, 2, 2, ["model.sequence_parallel=true", "train.recompute=selective", "model.dropout=0.1"],
                 marks=pytest.mark.slow),
    pytest.param(1, 4, 1, ["model.arch=llama", "model.n_kv_head=2", "train.recompute=full"], marks=pytest.mark.slow),
], ids=["1-2-1-bf16", "2-2-2-sp-selective-dropout", "1-4-1-llama-full-recompute"])
def test_zero_bubble_trains_the_same_model_as_1f1b(tp, pp, dp, overrides):
    run_distributed(_zero_bubble_matches_1f1b, tp * pp * dp, tp, pp, overrides, 2)
