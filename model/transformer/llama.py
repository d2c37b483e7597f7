"""The Llama family's attention and MLP (Touvron et al. 2023) on our tensor-parallel layers.

q, k and v are one column-parallel GEMM (`qkv_proj`, rows [Q; K; V]) and gate and up another
(`gate_up_proj`, rows [G; U]): each part of the fused weight is split over tp on its own, so
rank r's rows are [Q_r; K_r; V_r] and [G_r; U_r] and one GEMM gives it its heads and its MLP
columns (export splits them into transformers' q/k/v and gate/up, model/hf/llama.py).
K and V are a plain row split over tp: at tp > n_kv_head the ranks that share a key/value head
each store a true shard of its rows, all-gathered in forward and reduce-scattered in backward,
so the gradient norm, the optimizer and checkpoints treat it as any column-parallel weight
(docs/architectures.md, "Grouped-query attention under TP"; docs/design.md contract 5)."""
import math
from typing import Callable, ContextManager, Optional, Tuple

import torch
import torch.nn as nn
from torch.nn import functional

from model.config import GPTConfig
from model.parallel.layers import (ColumnParallelLinear, RowParallelLinear, column_parallel_projections, group_rank,
                                   group_size, mark_sequence_parallel)
from model.parallel.mappings import Group, all_reduce_sum, gather_rows_from_tp_region
from model.transformer.attention import AttentionCore, check_context_heads
from model.transformer.attention_inputs import AttentionInputs
from model.transformer.norms import RMSNorm


def kv_replicas(n_kv_head: int, tp_size: int) -> int:
    """How many TP ranks use each key/value head: 1 when n_kv_head divides by tp, else tp / n_kv_head."""
    return 1 if n_kv_head % tp_size == 0 else tp_size // n_kv_head


def qkv_sections(config) -> Tuple[int, int, int]:
    """Rows of the Q, K and V parts of the fused qkv_proj weight (a config's n_head, n_kv_head, head_dim)."""
    return config.n_head * config.head_dim, config.n_kv_head * config.head_dim, config.n_kv_head * config.head_dim


def gate_up_sections(config, width: Optional[int] = None) -> Tuple[int, int]:
    """Rows of the gate and up parts of the fused gate_up_proj weight (of an MLP `width` wide, else
    the model's ffn_hidden_size: experts and shared experts have their own width)."""
    width = config.ffn_hidden_size if width is None else width
    return width, width


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over a whole q or k projection whose heads are split over TP (OLMoE's q_norm and
    k_norm): the mean of squares is over all heads (an all-reduce of the TP ranks' sums, forward and
    backward), the weight is split over TP like the projection's rows. (B, T, width/t) -> same."""

    def __init__(self, width: int, tp_group: Group, eps: float):
        super().__init__()
        self.width, self.tp_group, self.eps = width, tp_group, eps
        self.weight = nn.Parameter(torch.ones(width // group_size(tp_group)))
        self.weight.tensor_model_parallel = True  # each TP rank holds its heads' part (contract 5)
        self.weight.partition_dim, self.weight.partition_stride = 0, 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        squares = all_reduce_sum(x32.pow(2).sum(-1, keepdim=True), self.tp_group)  # (B, T, 1): every head's
        return self.weight * (x32 * torch.rsqrt(squares / self.width + self.eps)).to(x.dtype)


class GroupedQueryAttention(nn.Module):
    """Causal self-attention with n_kv_head key/value heads shared by groups of query heads. With
    `cp_group` the core exchanges sequence shards for head shards around attention, copying
    key/value heads where tp x cp exceeds them (model/transformer/attention.py)."""

    def __init__(self, config: GPTConfig, tp_group: Group, generator: torch.Generator,
                 dropout_rng: Callable[[], ContextManager],
                 residual_dropout_rng: Callable[[], ContextManager], *, cp_group: Group = None):
        super().__init__()
        h, d = config.n_embd, config.head_dim
        tp_size = group_size(tp_group)
        check_context_heads(config.n_head, tp_size, group_size(cp_group))
        self.tp_group = tp_group
        self.sequence_parallel = config.sequence_parallel and tp_group is not None
        self.head_dim = d
        self.n_head_local = config.n_head // tp_size
        self.replicas = kv_replicas(config.n_kv_head, tp_size)
        self.n_kv_local = 1 if self.replicas > 1 else config.n_kv_head // tp_size
        # The key/value head this rank uses when it holds only part of it (replicas > 1).
        self.kv_head = group_rank(tp_group) // self.replicas
        self.core = AttentionCore(config, dropout_rng, enable_gqa=True, cp_group=cp_group)
        self.residual_dropout_rng = residual_dropout_rng
        std, bias = config.init_std, config.bias
        # Drawn from the block's generator in the order of separate q, k, v linears (full weights,
        # then each rank's rows of each), so the weights equal those of unfused projections.
        sections = qkv_sections(config)
        self.qkv_proj = ColumnParallelLinear(h, sum(sections), tp_group, generator, std, bias=bias, sections=sections)
        self.local_sections = [n // tp_size for n in sections]  # this rank's Q, K, V rows
        self.o_proj = RowParallelLinear(config.n_head * d, h, tp_group, generator,
                                        std / math.sqrt(2 * config.n_layer), bias=bias,
                                        sequence_parallel=config.sequence_parallel)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.qk_norm = config.qk_norm
        if config.qk_norm == "head":  # Qwen3: one (d,) weight each for q and k, shared by the heads
            self.q_norm, self.k_norm = RMSNorm(d, eps=config.norm_eps), RMSNorm(d, eps=config.norm_eps)
            # Replicated, but each TP rank normalises only its heads: the gradients summed over TP once
            # per step, as sequence-parallel weights' are (model/parallel/layers.py). A key/value head that
            # `replicas` ranks share gets from each only its query heads' part of dL/dk: the sum is whole.
            mark_sequence_parallel(self.q_norm.weight, tp_group)
            mark_sequence_parallel(self.k_norm.weight, tp_group)
        elif config.qk_norm == "projection":  # OLMoE: over the whole projections (n_kv_head % tp == 0: layout check)
            self.q_norm = ProjectionRMSNorm(config.n_head * d, tp_group, config.norm_eps)
            self.k_norm = ProjectionRMSNorm(config.n_kv_head * d, tp_group, config.norm_eps)

    def _normalise(self, q: torch.Tensor, k: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """q (B, T, a/t*d), k (B, T, kv*d) with the q/k norm of `qk_norm` applied (before RoPE)."""
        if self.qk_norm == "projection":
            return self.q_norm(q), self.k_norm(k)
        B, T, _ = q.shape
        q = self.q_norm(q.view(B, T, -1, self.head_dim)).view(B, T, -1)
        k = self.k_norm(k.view(B, T, -1, self.head_dim)).view(B, T, -1)
        return q, k

    def _with_shared_kv_head(self, param: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """This rank's [Q_r; K_j; V_j] rows of the fused weight or bias (replicas > 1): its own Q
        rows and the whole key/value head j it shares, from one all-gather of every rank's
        [K_r; V_r] rows (backward: reduce-scatter, each rank's rows get the gradient of the
        ranks that used them)."""
        if param is None:
            return None
        q_rows, d, r = self.local_sections[0], self.head_dim, self.replicas
        kv_all = gather_rows_from_tp_region(param[q_rows:], self.tp_group)  # (t * 2d/r, ...): [K_0; V_0; K_1; ...]
        kv_all = kv_all.view(-1, 2, d // r, *param.shape[1:])  # (t, 2, d/r, ...): rank, K or V, rows
        kv = kv_all[self.kv_head * r:(self.kv_head + 1) * r].transpose(0, 1).reshape(2 * d, *param.shape[1:])
        return torch.cat([param[:q_rows], kv])  # (a/t*d + 2d, ...)

    def forward(self, x: torch.Tensor, inputs: Optional[AttentionInputs] = None) -> torch.Tensor:
        """(B, T, h), or (B, T/t, h) with SP (T: this CP rank's tokens); `inputs`: the stage's RoPE
        tables and mask for this micro-batch."""
        weight, bias = self.qkv_proj.weight, self.qkv_proj.bias
        sections = self.local_sections
        if self.replicas > 1:
            weight, bias = self._with_shared_kv_head(weight), self._with_shared_kv_head(bias)
            sections = [sections[0], self.head_dim, self.head_dim]
        (qkv,) = column_parallel_projections(x, [(weight, bias)], self.tp_group, self.sequence_parallel)
        q, k, v = qkv.split(sections, dim=-1)  # (B, T, a/t*d), (B, T, kv*d) twice: views of one GEMM's output
        if self.qk_norm is not None:
            q, k = self._normalise(q, k)
        # V is saved for backward as is (q and k as RoPE's new tensors): a view would keep the
        # whole (B, T, (a/t + 2kv)d) output alive, a copy keeps what separate projections kept.
        v = v.contiguous()
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
        if self.gated:  # gate and up drawn in turn, as two linears would be; rank r holds [G_r; U_r]
            self.gate_up_proj = ColumnParallelLinear(h, 2 * f, tp_group, generator, std, bias=bias,
                                                     sections=gate_up_sections(config))
        else:
            self.up_proj = ColumnParallelLinear(h, f, tp_group, generator, std, bias=bias)
        self.down_proj = RowParallelLinear(f, h, tp_group, generator, std / math.sqrt(2 * config.n_layer),
                                           bias=bias, sequence_parallel=config.sequence_parallel)
        self.dropout = nn.Dropout(config.dropout)
        self.residual_dropout_rng = residual_dropout_rng

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            (gate_up,) = column_parallel_projections(x, [(self.gate_up_proj.weight, self.gate_up_proj.bias)],
                                                     self.tp_group, self.sequence_parallel)
            gate, up = gate_up.chunk(2, dim=-1)  # (B, T, f/t) each: views of one GEMM's output
            y = self.down_proj(functional.silu(gate) * up)
        else:
            (up,) = column_parallel_projections(x, [(self.up_proj.weight, self.up_proj.bias)],
                                                self.tp_group, self.sequence_parallel)
            y = self.down_proj(functional.gelu(up, approximate="tanh"))
        with self.residual_dropout_rng():
            return self.dropout(y)
