"""ZB-H1 cannot silently turn into 1F1B: the check after the first step (a real pp = 2 zb-h1
engine, with DeepSpeed's own schedule put back in), and compiled blocks that defer their weight
gradients (in process, and in a compiled zb-h1 engine). The hooks checked before the start are in
tests/runtime/test_errors.py; the schedule itself and its parity in tests/model/test_zero_bubble.py."""
from pathlib import Path

import pytest
import torch
from deepspeed.runtime.pipe import schedule

from helpers.distributed import run_distributed, uses_deepspeed
from model.config import GPTConfig
from model.gpt.model import GPT
from model.parallel.cross_entropy import vocab_parallel_cross_entropy
from model.parallel.weight_grad import WEIGHT_GRADS

TINY = Path(__file__).resolve().parents[2] / "recipes" / "tiny.yaml"


@pytest.mark.slow  # a cold inductor compile, about 30 s: the fast tier's budget (the engine test below is slow too)
def test_compiled_blocks_defer_their_weight_gradients():
    """With `train.compile` and no full recompute a block's first forward runs outside any B pass,
    where AOT autograd traces its backward: the deferral must still be decided when B runs. Two
    micro-batches through compiled blocks, each forward outside the deferral and its backward
    inside (the B pass): after B every block matrix is without gradient and the store holds what
    eager's holds; after W every matrix has its gradient. Losses and gradients equal eager's
    within the compile tolerance (tests/model/test_compile.py)."""
    import copy

    from torch._dynamo.utils import counters

    from model.gpt.compiled import compile_blocks

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


def _zero_bubble_engine(compiled: bool = False):
    """(engine, layout, a step function: batch index -> loss) of tiny at (1,2,1) under zb-h1."""
    import torch.distributed as dist

    from launch.config.layout import check_and_derive_layout
    from launch.config.recipe import load_recipe
    from launch.engine.engine import build_engine
    from model.parallel.state import init_parallel_state

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
    from launch.engine.zero_bubble import WEIGHT_PASSES, check_weight_passes_ran

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
    from launch.engine.zero_bubble import WEIGHT_PASSES, check_weight_passes_ran

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
