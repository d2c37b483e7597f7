"""The norms of a block and of the final layer: GPT-2's LayerNorm and Llama's RMSNorm, replicated
over TP. Under sequence parallelism each TP rank normalises its own (B, T/t, h) chunk, so the
weights are marked sequence-parallel (model/parallel/layers.py) and their gradients summed over TP once
per step.
"""
import torch
import torch.nn as nn
from torch.nn import functional

from model.parallel.layers import mark_sequence_parallel
from model.parallel.mappings import Group


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm whose weight and bias are marked sequence-parallel when
    `sequence_parallel_group` is given: each TP rank normalises only its (B, T/t, h) chunk, so
    its gradient of the replicated weight covers T/t positions until the once-per-step sum over
    TP (model/parallel/layers.py). The parameters stay replicated (counted once in the gradient norm)."""

    def __init__(self, normalized_shape: int, sequence_parallel_group: Group = None, eps: float = 1e-5):
        super().__init__(normalized_shape, eps=eps)
        mark_sequence_parallel(self.weight, sequence_parallel_group)
        mark_sequence_parallel(self.bias, sequence_parallel_group)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight (Zhang and Sennrich 2019), transformers' LlamaRMSNorm:
    the statistics in fp32, the weight applied after casting back. The weight's gradient is summed
    over `sequence_parallel_group` as LayerNorm's is.

    The normalisation is `F.rms_norm` without a weight (one fused kernel on GPUs) and
    the weight a separate multiply: F.rms_norm with the weight multiplies it in fp32 before
    rounding to bf16, transformers after, so only this split gives transformers' numbers
    (tests/model/test_llama.py compares both in fp32 and bf16)."""

    def __init__(self, normalized_shape: int, sequence_parallel_group: Group = None, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(normalized_shape))
        self.eps = eps
        mark_sequence_parallel(self.weight, sequence_parallel_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * functional.rms_norm(x, (x.size(-1),), None, self.eps)
