"""Efficient defaults, checked on one CPU process without DeepSpeed's engine.

Fused causal attention, bf16 with fp32 gradient accumulation, ZeRO-1, and no copy of the
largest tensor (the (B, T, V) logits) in the loss's backward.
"""
import pytest
import torch
from torch.nn import functional

from launch.runtime.recipe import Recipe
from launch.runtime.ds_config import deepspeed_config
from launch.runtime.layout import derive_layout
from model.gpt import GPT, GPTConfig
from model.loss import vocab_parallel_cross_entropy


def profiled_ops(fn) -> list:
    """(name, input shapes) of every op `fn` runs."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return [(e.name, e.input_shapes) for e in prof.events()]


def test_defaults_are_zero1_and_bf16_accumulates_in_fp32():
    recipe = Recipe()
    assert recipe.train.zero_stage == 1
    recipe.train.precision = "bf16"
    config = deepspeed_config(recipe, derive_layout(recipe, 1, 1, 1, on_cpu=True))
    assert config["bf16"] == {"enabled": True}
    assert config["data_types"] == {"grad_accum_dtype": "fp32"}
    assert config["zero_optimization"]["stage"] == 1
    assert config["wall_clock_breakdown"] is False  # DeepSpeed's timers synchronise the device


def test_attention_runs_a_fused_causal_kernel_and_the_loss_copies_no_logits():
    """SDPA with is_causal=True picks the fused flash kernel on CPU, not the math fallback that
    materialises the (T, T) scores; forward + backward of the model and the vocab-parallel loss
    copy no (B, T, V_pad) tensor (the loss's backward works in place on the saved softmax; the
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
    logits = torch.randn(3, 5, 11, requires_grad=True)
    target = torch.randint(0, 11, (3, 5))
    loss = vocab_parallel_cross_entropy(logits, target, None).mean()
    loss.backward(retain_graph=True)
    reference = logits.detach().clone().requires_grad_()
    functional.cross_entropy(reference.flatten(0, 1), target.flatten()).backward()
    torch.testing.assert_close(logits.grad, reference.grad, rtol=1e-6, atol=1e-7)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()  # the saved softmax was consumed in place
