"""Efficient defaults, checked by what they do, without DeepSpeed's launcher.

ZeRO-1 by default (each data-parallel rank keeps Adam's moments for its share of the parameters
only), bf16 with fp32 gradient accumulation, fused causal attention, and no copy of the largest
tensor (the (B, T, V) logits) in the loss's backward.
"""
import pytest
import torch
from torch.nn import functional

from helpers.distributed import run_distributed, uses_deepspeed
from helpers.launcher import TINY
from launch.config.recipe import Recipe
from model.config import GPTConfig
from model.gpt.model import GPT
from model.parallel.cross_entropy import vocab_parallel_cross_entropy


def profiled_ops(fn) -> list:
    """(name, input shapes) of every op `fn` runs."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return [(e.name, e.input_shapes) for e in prof.events()]


@uses_deepspeed
def _default_zero_stage_step(precision: str):
    """One step of tiny.yaml (4 micro-batches per rank) at dp=2 with the default ZeRO stage: this
    rank's Adam moments against the model's size, and the gradients summed over the micro-batches
    as the data-parallel reduction finds them (bf16: DeepSpeed's fp32 buffer beside each bf16 .grad)."""
    import torch.distributed as dist
    from deepspeed.runtime.pipe import schedule

    from launch.config.layout import check_and_derive_layout
    from launch.config.recipe import load_recipe
    from launch.engine.engine import build_engine
    from model.parallel.state import init_parallel_state

    recipe = load_recipe(TINY, [f"train.zero_stage={Recipe().train.zero_stage}", f"train.precision={precision}"])
    layout = check_and_derive_layout(recipe, 2, 1, 1, True)
    config = recipe.gpt_config(4096)
    engine, _ = build_engine(recipe, layout, init_parallel_state(1, 1), config)
    grads = []
    handlers = dict(engine._INSTRUCTION_MAP)
    reduce_grads = handlers[schedule.ReduceGrads]

    def snapshot_then_reduce(eng, **kwargs):
        for param in eng.module.parameters():
            grad = getattr(param, "_hp_grad", None)
            grads.append((param.grad if grad is None else grad).detach().clone())
        reduce_grads(eng, **kwargs)
    handlers[schedule.ReduceGrads] = snapshot_then_reduce
    engine._INSTRUCTION_MAP = handlers
    tokens = torch.randint(0, 4096, (layout.grad_accum_steps, layout.micro_batch_size, config.seq_len + 1),
                           generator=torch.Generator().manual_seed(dist.get_rank()))
    engine.train_batch(iter([(t[:, :-1], t[:, 1:]) for t in tokens]))
    params = sum(p.numel() for p in engine.module.parameters())
    moments = sum(state["exp_avg"].numel() for state in engine.basic_optimizer.state.values())
    assert moments == pytest.approx(params / 2, rel=1e-3), (moments, params)  # ZeRO-1: this rank's half
    assert grads and all(grad.dtype == torch.float32 for grad in grads)
    if precision == "bf16":  # a sum of 4 bf16 micro-batch gradients kept in fp32 is rarely a bf16 number
        flat = torch.cat([grad.flatten() for grad in grads])
        in_bf16 = (flat == flat.bfloat16().float()).float().mean().item()
        assert in_bf16 < 0.5, in_bf16


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_default_zero_partitions_adam_and_bf16_accumulates_in_fp32(precision):
    run_distributed(_default_zero_stage_step, 2, precision)


def test_attention_runs_a_fused_causal_kernel_and_the_loss_copies_no_logits():
    """SDPA with is_causal=True picks the fused flash kernel on CPU, not the math fallback that
    materialises the (T, T) scores; forward + backward of the model and the vocab-parallel loss
    copy no (B, T, V_pad) tensor (the loss's fp32 backward writes straight into its output; the
    padded vocabulary's columns are set to -inf in place, as with every GPU recipe's
    vocab_pad_multiple 128)."""
    torch.manual_seed(0)
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=16, vocab_size=100, vocab_pad_multiple=128)
    model = GPT(config)
    ids = torch.randint(0, 100, (2, 16))

    def step():
        loss = vocab_parallel_cross_entropy(model(ids), ids, None).mean()
        loss.backward()
    ops = profiled_ops(step)
    names = {name for name, _ in ops}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names, sorted(names)
    assert "aten::_scaled_dot_product_flash_attention_for_cpu_backward" in names
    copied = [shapes[0] for name, shapes in ops if name in ("aten::clone", "aten::copy_") and shapes]
    assert copied, "the profiler recorded no copy at all: shapes missing?"  # masked_fill clones (B, T)
    assert config.padded_vocab_size(1) == 128
    assert [2, 16, 128] not in copied, copied


def test_loss_gradient_is_exact_and_a_second_backward_is_refused():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11)
    target = torch.randint(0, 11, (3, 5))
    reference = logits.clone().requires_grad_()
    functional.cross_entropy(reference.flatten(0, 1), target.flatten()).backward()
    consumed = logits.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(consumed * 1, target, None, consume_logits=True).mean()
    loss.backward(retain_graph=True)
    torch.testing.assert_close(consumed.grad, reference.grad, rtol=1e-6, atol=1e-7)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()  # the gradient overwrote the saved logits
    kept = logits.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(kept, target, None).mean()
    loss.backward(retain_graph=True)
    loss.backward()  # without consume_logits the logits are intact: twice the gradient
    torch.testing.assert_close(kept.grad, 2 * reference.grad, rtol=1e-6, atol=1e-7)
    with pytest.raises(RuntimeError, match="modified in place"):
        loss = vocab_parallel_cross_entropy(kept, target, None).mean()
        with torch.no_grad():
            kept.mul_(2)
        loss.backward()
