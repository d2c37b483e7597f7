"""The Llama family's attention and MLP (Touvron et al. 2023) on our tensor-parallel layers.

Projections named as in transformers' LlamaForCausalLM (export is a rename, model/hf_llama.py);
q/k/v and gate/up read one copy of the block's input. k_proj and v_proj are a plain row split
over tp: at tp > n_kv_head the ranks that share a key/value head each store a true shard of its
rows, all-gathered in forward and reduce-scattered in backward, so the gradient norm, the
optimizer and checkpoints treat it as any column-parallel weight (docs/architectures.md,
"Grouped-query attention under TP"; docs/design.md contract 5)."""
import math
from typing import Callable, ContextManager, Optional

import torch
import torch.nn as nn
from torch.nn import functional

from model.attention import AttentionCore
from model.config import GPTConfig
from model.attention_inputs import AttentionInputs
from model.layers import ColumnParallelLinear, RowParallelLinear, column_parallel_projections, group_rank, group_size
from model.mappings import Group, gather_rows_from_tp_region


def kv_replicas(n_kv_head: int, tp_size: int) -> int:
    """How many TP ranks use each key/value head: 1 when n_kv_head divides by tp, else tp / n_kv_head."""
    return 1 if n_kv_head % tp_size == 0 else tp_size // n_kv_head


class GroupedQueryAttention(nn.Module):
    """Causal self-attention with n_kv_head key/value heads shared by groups of query heads."""

    def __init__(self, config: GPTConfig, tp_group: Group, generator: torch.Generator,
                 dropout_rng: Callable[[], ContextManager],
                 residual_dropout_rng: Callable[[], ContextManager]):
        super().__init__()
        h, d = config.n_embd, config.head_dim
        tp_size = group_size(tp_group)
        self.tp_group = tp_group
        self.sequence_parallel = config.sequence_parallel and tp_group is not None
        self.head_dim = d
        self.n_head_local = config.n_head // tp_size
        self.replicas = kv_replicas(config.n_kv_head, tp_size)
        self.n_kv_local = 1 if self.replicas > 1 else config.n_kv_head // tp_size
        # The key/value head this rank uses when it holds only part of it (replicas > 1).
        self.kv_head = group_rank(tp_group) // self.replicas
        self.core = AttentionCore(config, dropout_rng, enable_gqa=True)
        self.residual_dropout_rng = residual_dropout_rng
        std, bias = config.init_std, config.bias
        # Drawn in this order from the block's generator: the full weights, then each rank's rows.
        self.q_proj = ColumnParallelLinear(h, config.n_head * d, tp_group, generator, std, bias=bias)
        self.k_proj = ColumnParallelLinear(h, config.n_kv_head * d, tp_group, generator, std, bias=bias)
        self.v_proj = ColumnParallelLinear(h, config.n_kv_head * d, tp_group, generator, std, bias=bias)
        self.o_proj = RowParallelLinear(config.n_head * d, h, tp_group, generator,
                                        std / math.sqrt(2 * config.n_layer), bias=bias,
                                        sequence_parallel=config.sequence_parallel)
        self.resid_dropout = nn.Dropout(config.dropout)

    def _kv_params(self, linear: ColumnParallelLinear):
        """(weight, bias) of this rank's key/value heads: its own rows, or the whole shared head."""
        if self.replicas == 1:
            return linear.weight, linear.bias
        rows = slice(self.kv_head * self.head_dim, (self.kv_head + 1) * self.head_dim)
        weight = gather_rows_from_tp_region(linear.weight, self.tp_group)[rows]
        bias = None if linear.bias is None else gather_rows_from_tp_region(linear.bias, self.tp_group)[rows]
        return weight, bias

    def forward(self, x: torch.Tensor, inputs: Optional[AttentionInputs] = None) -> torch.Tensor:
        """(B, T, h), or (B, T/t, h) with SP; `inputs`: the stage's RoPE tables and mask for this micro-batch."""
        params = [(self.q_proj.weight, self.q_proj.bias), self._kv_params(self.k_proj), self._kv_params(self.v_proj)]
        q, k, v = column_parallel_projections(x, params, self.tp_group, self.sequence_parallel)
        B, T, _ = q.shape
        q = q.view(B, T, self.n_head_local, self.head_dim).transpose(1, 2)  # (B, a/t, T, d)
        k, v = (t.view(B, T, self.n_kv_local, self.head_dim).transpose(1, 2) for t in (k, v))  # (B, kv, T, d)
        y = self.core(q, k, v, self.training, inputs)  # (B, a/t, T, d)
        y = self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head_local * self.head_dim))
        with self.residual_dropout_rng():
            return self.resid_dropout(y)


class LlamaMLP(nn.Module):
    """swiglu: down(silu(gate(x)) * up(x)); gelu: down(gelu_tanh(up(x))). Width ffn_hidden_size."""

    def __init__(self, config: GPTConfig, tp_group: Group, generator: torch.Generator,
                 residual_dropout_rng: Callable[[], ContextManager]):
        super().__init__()
        h, f, std, bias = config.n_embd, config.ffn_hidden_size, config.init_std, config.bias
        self.tp_group = tp_group
        self.sequence_parallel = config.sequence_parallel and tp_group is not None
        self.gated = config.mlp == "swiglu"
        if self.gated:
            self.gate_proj = ColumnParallelLinear(h, f, tp_group, generator, std, bias=bias)
        self.up_proj = ColumnParallelLinear(h, f, tp_group, generator, std, bias=bias)
        self.down_proj = RowParallelLinear(f, h, tp_group, generator, std / math.sqrt(2 * config.n_layer),
                                           bias=bias, sequence_parallel=config.sequence_parallel)
        self.dropout = nn.Dropout(config.dropout)
        self.residual_dropout_rng = residual_dropout_rng

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate, up = column_parallel_projections(
                x, [(self.gate_proj.weight, self.gate_proj.bias), (self.up_proj.weight, self.up_proj.bias)],
                self.tp_group, self.sequence_parallel)
            y = self.down_proj(functional.silu(gate) * up)
        else:
            (up,) = column_parallel_projections(x, [(self.up_proj.weight, self.up_proj.bias)],
                                                self.tp_group, self.sequence_parallel)
            y = self.down_proj(functional.gelu(up, approximate="tanh"))
        with self.residual_dropout_rng():
            return self.dropout(y)
