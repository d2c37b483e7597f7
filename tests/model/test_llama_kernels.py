"""The Llama block in fewer kernels, against transformers' LlamaDecoderLayer and
LlamaRMSNorm as the independent reference:
- one block with the same weights: the same output and input gradient, and, counted by
  torch.profiler, one GEMM per weight matrix: 4 forward and 8 backward where transformers' block
  (separate q, k, v, gate, up) runs 7 and 14;
- RMSNorm (F.rms_norm, then the weight) gives LlamaRMSNorm's numbers bit for bit in fp32 and bf16,
  forward, and its gradients within rounding.
"""
import collections
import dataclasses

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from model.config import GPTConfig
from model.hf.llama import fused_parts, llama_config_kwargs, name_pairs
from model.transformer.block import Block
from model.transformer.norms import RMSNorm

CONFIG = GPTConfig(arch="llama", n_layer=1, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden_size=48, seq_len=16,
                   vocab_size=97, seed=3)
GEMMS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def _transformers_block(config: GPTConfig, ours: Block):
    """transformers' LlamaDecoderLayer (SDPA attention) holding our block's weights, and its RoPE."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    hf_config = LlamaConfig(**llama_config_kwargs(config))
    hf_config._attn_implementation = "sdpa"
    theirs = LlamaDecoderLayer(hf_config, layer_idx=0)
    ours_dense = {f"blocks.0.{name}": param.detach() for name, param in ours.named_parameters()}
    prefix = "model.layers.0."
    weights = {theirs_name[len(prefix):]: ours_dense[ours_name] for ours_name, theirs_name in name_pairs(config)
               if ours_name in ours_dense}
    for ours_name, parts in fused_parts(config):  # our fused rows, cut into transformers' tensors
        pieces = ours_dense[ours_name].split([rows for _, rows in parts])
        weights.update({name[len(prefix):]: piece for (name, _), piece in zip(parts, pieces)})
    theirs.load_state_dict(weights, strict=True)
    return theirs, LlamaRotaryEmbedding(hf_config)


def _gemms_and_grad(forward, x: torch.Tensor):
    """(output, dL/dx, GEMMs in forward, GEMMs in backward) of `forward(x)` with L = sum(output)."""
    x = x.clone().requires_grad_()
    with profile(activities=[ProfilerActivity.CPU]) as forward_trace:
        y = forward(x)
    with profile(activities=[ProfilerActivity.CPU]) as backward_trace:
        y.sum().backward()
    counts = [collections.Counter(e.name for e in trace.events()) for trace in (forward_trace, backward_trace)]
    return y.detach(), x.grad, *(sum(c[g] for g in GEMMS) for c in counts)


@pytest.mark.parametrize("changes", [{}, dict(n_kv_head=1, bias=True)], ids=["gqa", "mqa-bias"])
def test_fused_block_runs_one_gemm_per_weight_matrix(changes):
    config = dataclasses.replace(CONFIG, **changes)
    ours = Block(config, 0, None)
    theirs, rope = _transformers_block(config, ours)
    x = torch.randn(2, config.seq_len, config.n_embd, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(config.seq_len)[None]

    def their_forward(hidden):
        out = theirs(hidden, attention_mask=None, position_ids=positions, position_embeddings=rope(hidden, positions))
        return out[0] if isinstance(out, tuple) else out
    y_ours, grad_ours, forward_ours, backward_ours = _gemms_and_grad(ours, x)
    y_theirs, grad_theirs, forward_theirs, backward_theirs = _gemms_and_grad(their_forward, x)
    torch.testing.assert_close(y_ours, y_theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_ours, grad_theirs, rtol=1e-5, atol=1e-5)
    matrices = [sum(p.dim() == 2 for p in block.parameters()) for block in (ours, theirs)]
    assert matrices == [4, 7]  # qkv, o, gate_up, down; and q, k, v, o, gate, up, down
    # Forward one GEMM per matrix; backward two (dL/dx and dL/dW): q/k/v fused save 2 + 2, gate/up 1 + 1.
    assert (forward_ours, backward_ours) == (matrices[0], 2 * matrices[0]), (forward_ours, backward_ours)
    assert (forward_theirs, backward_theirs) == (matrices[1], 2 * matrices[1]), (forward_theirs, backward_theirs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rmsnorm_gives_transformers_numbers(dtype):
    """The weight in the activations' dtype, as our model holds it under bf16 (the engine casts
    the module); the normalisation in fp32 inside F.rms_norm, the weight applied after rounding."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    h = 256
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(4, 16, h, generator=g)).to(dtype)
    weight = 1 + 0.1 * torch.randn(h, generator=g)
    ours, theirs = RMSNorm(h, eps=1e-5).to(dtype), LlamaRMSNorm(h, eps=1e-5).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
    probe = torch.randn(4, 16, h, generator=g).to(dtype)
    results = []
    for norm in (ours, theirs):
        xi = x.clone().requires_grad_()
        y = norm(xi)
        (y.float() * probe.float()).sum().backward()
        results.append((y.detach(), xi.grad, norm.weight.grad))
    (y_ours, dx_ours, dw_ours), (y_theirs, dx_theirs, dw_theirs) = results
    assert y_ours.dtype == y_theirs.dtype == dtype
    assert torch.equal(y_ours, y_theirs), (y_ours.float() - y_theirs.float()).abs().max()
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dx_ours.float(), dx_theirs.float(), **tolerance)
    torch.testing.assert_close(dw_ours.float(), dw_theirs.float(), **tolerance)
