"""The mixture-of-experts MLP (Shazeer et al. 2017; Fedus et al. 2022; Mixtral, Qwen3-MoE, OLMoE) on
our tensor- and expert-parallel layers: a router picks k of E expert SwiGLU MLPs per token, every
token reaches all k (dropless), and the experts' outputs are summed with the router's weights.

Parallelism (docs/design.md contract 18):
- TP splits every expert's MLP as it splits the dense MLP (gate/up by rows, down by columns): each
  TP rank runs its shard of the experts on all of its replica's tokens, and one all-reduce (or,
  under sequence parallelism, one reduce-scatter) after the combine sums the shards, as after a
  row-parallel linear. The router is replicated; its input is the block's own (B, T, h) tokens or,
  under SP, this rank's (B, T/t, h) chunk, whose choices are all-gathered.
- EP splits the E experts over the ep ranks of an EP group (ep_rank r: experts [r E/ep, (r+1) E/ep)):
  the assignments are sorted by expert, their counts exchanged, the token rows sent to their
  experts' ranks by an all-to-all and the outputs brought back by a second (model/parallel/mappings.py).
- The auxiliary losses (load balancing, z-loss) are computed over each micro-batch's whole token
  set, whatever the shards, and enter the backward where they arise (`add_to_backward`), so their
  gradients reach this stage's router without crossing the pipeline (model/transformer/moe_losses.py).

Exactness: routing ties go to the lower expert index (a stable sort), every gather and scatter is
a permutation or an expand (deterministic backward), and the k outputs of a token are summed in
slot order, so every layout computes the same sums up to the rounding of its matmuls.
"""
import dataclasses
import math
from typing import Callable, ContextManager, Optional, Tuple

import torch
import torch.nn as nn
from torch.nn import functional

from model.config import GPTConfig
from model.parallel.all_to_all import all_to_all_from_experts, all_to_all_to_experts, exchange_counts
from model.parallel.layers import group_rank, group_size, mark_sequence_parallel, mark_tensor_parallel, split_rows
from model.parallel.mappings import (Group, all_gather_sequence, copy_to_tp_region,
                                     gather_from_sequence_parallel_region, reduce_from_tp_region,
                                     reduce_scatter_to_sequence_parallel_region)
from model.parallel.weight_grad import DeferrableLinear
from model.transformer.grouped_gemm import ExpertRows, expert_rows, grouped_linear
from model.transformer.llama import LlamaMLP
from model.transformer.moe_losses import MoEStatistics, add_to_backward, count_assignments, router_losses


def expert_group_name(ep_size: int) -> str:
    """DeepSpeed's name of the expert-parallel group of size ep (utils/groups.py: ep_size_<ep>),
    carried by every expert parameter as `group_name`."""
    return f"ep_size_{ep_size}"


def mark_expert(param: nn.Parameter, ep_size: int) -> None:
    """DeepSpeed's mark of an expert parameter (moe/experts.py): not all-reduced over the data axis
    but over its expert-data-parallel group, and put in a ZeRO-1 group of its own."""
    param.allreduce = False
    param.group_name = expert_group_name(ep_size)


def is_expert_param(param: torch.Tensor) -> bool:
    return getattr(param, "allreduce", True) is False


def expert_generator(config: GPTConfig, layer_index: int, expert: int) -> torch.Generator:
    """A generator private to one expert of one block: each rank draws only its own experts, and
    an expert's weights are the same whichever rank (ep) and TP shard (tp) holds them."""
    stream = -1000 - layer_index * 100_000 - expert  # apart from the blocks' and embeddings' streams
    return torch.Generator().manual_seed(config.seed * 1_000_003 + stream + 10)


def route(logits: torch.Tensor, k: int, router: str, norm_topk_prob: bool, bias: Optional[torch.Tensor] = None
          ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, E) logits -> (weights (N, k) fp32, experts (N, k) int64, probabilities (N, E) fp32).

    The k experts are those of the largest logits, ties to the lower index (a stable sort: the
    same choice at every layout). softmax_topk: their softmax probabilities, divided by their sum
    with norm_topk_prob; topk_softmax: a softmax over their k logits (the same, up to rounding).
    With `bias` (E,) (model.moe.balance=bias) the k largest probabilities plus bias are chosen, the
    weights unchanged (DeepSeek-V3's auxiliary-loss-free balancing)."""
    logits = logits.float()
    probs = functional.softmax(logits, dim=-1)
    scores = logits if bias is None else probs + bias
    experts = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    if router == "topk_softmax":
        weights = functional.softmax(logits.gather(1, experts), dim=-1)
    else:
        weights = probs.gather(1, experts)
        if norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts, probs


class ExpertMLPs(nn.Module):
    """This rank's E/ep experts, each down(silu(gate(x)) * up(x)) of width f, TP-split as the dense
    SwiGLU MLP: gate_up_proj (E/ep, 2f/t, h) holds rank r's [G_r; U_r] rows of every expert,
    down_proj (E/ep, h, f/t) its columns (transformers' Qwen3MoeExperts layout, sliced).

    Each expert's full weights are drawn from its own generator (gate, up, then down, as three
    linears would be) and sliced, so they do not depend on tp or ep (docs/design.md contract 2)."""

    def __init__(self, config: GPTConfig, layer_index: int, tp_group: Group, first_expert: int,
                 local_experts: int, ep_size: int):
        super().__init__()
        h, f = config.n_embd, config.expert_ffn_hidden_size
        tp_size, tp_rank = group_size(tp_group), group_rank(tp_group)
        down_std = config.init_std / math.sqrt(2 * config.n_layer)
        gate_up, down = [], []
        for expert in range(first_expert, first_expert + local_experts):
            generator = expert_generator(config, layer_index, expert)
            full_gate_up = torch.empty(2 * f, h).normal_(0.0, config.init_std, generator=generator)  # [G; U]
            full_down = torch.empty(h, f).normal_(0.0, down_std, generator=generator)
            gate_up.append(split_rows(full_gate_up, tp_rank, tp_size, sections=(f, f)))  # (2f/t, h)
            down.append(split_rows(full_down.t(), tp_rank, tp_size).t())  # (h, f/t)
        self.gate_up_proj = nn.Parameter(torch.stack(gate_up))  # (E/ep, 2f/t, h)
        self.down_proj = nn.Parameter(torch.stack(down).contiguous())  # (E/ep, h, f/t)
        # Each TP rank holds a shard: counted on every one (contract 5).
        mark_tensor_parallel(self.gate_up_proj, partition_dim=1, sections=(f, f))
        mark_tensor_parallel(self.down_proj, partition_dim=2)
        for param in (self.gate_up_proj, self.down_proj):
            mark_expert(param, ep_size)

    def forward(self, x: torch.Tensor, rows: ExpertRows) -> torch.Tensor:
        """(M, h) rows grouped by local expert (`rows`: how many each) -> (M, h) partial sums over TP."""
        gate, up = grouped_linear(x, self.gate_up_proj, rows).chunk(2, dim=-1)  # (M, f/t) each
        return grouped_linear(functional.silu(gate) * up, self.down_proj, rows)


BALANCE_STATE = ("expert_bias", "step_load")


class Router(nn.Module):
    """logits = x W_r^T, (..., h) -> (..., E); W_r (E, h) replicated over TP, drawn from the block's generator.

    model.moe.router_dtype fp32 (the default): x and W_r cast to fp32 for the GEMM (the stored weight
    keeps its dtype), so the logits, and after them the softmax, top-k and router losses, are fp32:
    bf16 logits tie at the k-th place for some tokens of every batch (5.8-7.2% at E = 128,
    k = 8), and ties go to the lower expert. `activations`: the GEMM in x's dtype, upcast after it.

    Always through the deferrable linear (model/parallel/weight_grad.py), in 1F1B too: for so few output rows
    functional.linear's own backward orders the weight gradient's GEMM differently (measured: 1e-11
    apart on CPU), and ZB-H1, which defers it, would no longer be 1F1B to the bit.

    The balancing state, fp32 buffers saved with the weights (model/transformer/moe_losses.py:
    balance_after_step updates them after each step, the same on every rank): `expert_bias` (E,)
    with model.moe.balance=bias; `step_load` (E,), f_e of the last step's global batch, with
    balance_scope=global_batch (uniform, k/E, before the first step)."""

    def __init__(self, config: GPTConfig, generator: torch.Generator):
        super().__init__()
        moe = config.moe
        full = torch.empty(moe.num_experts, config.n_embd).normal_(0.0, config.init_std, generator=generator)
        self.weight = nn.Parameter(full)
        self.dtype = torch.float32 if moe.router_dtype == "fp32" else None
        if moe.balance == "bias":
            self.register_buffer("expert_bias", torch.zeros(moe.num_experts))
        if moe.balance_scope == "global_batch":
            self.register_buffer("step_load", torch.full((moe.num_experts,), moe.experts_per_token / moe.num_experts))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return DeferrableLinear.apply(tokens, self.weight, None, self.dtype)

    def _apply(self, fn, recurse=True):
        """Module.to / .bfloat16 move the balancing state but keep it fp32: a bias moved by 0.001 per
        step would stall in bf16, whose spacing at 0.05 is 0.0002-0.0005."""
        kept = {name: buffer for name, buffer in self._buffers.items() if name in BALANCE_STATE}
        super()._apply(fn, recurse)
        for name, buffer in kept.items():
            self._buffers[name] = buffer.to(device=self._buffers[name].device)
        return self


class MoEMLP(nn.Module):
    """The MLP of an MoE block: routed experts (TP x EP), plus shared experts every token passes
    through (a SwiGLU of width shared_experts * f, model/transformer/llama.py's LlamaMLP). (B, T, h), or
    (B, T/t, h) under SP, -> the same shape (T: this CP rank's tokens)."""

    def __init__(self, config: GPTConfig, layer_index: int, tp_group: Group, generator: torch.Generator,
                 residual_dropout_rng: Callable[[], ContextManager], *, ep_group: Group = None,
                 cp_group: Group = None, statistics: Optional[MoEStatistics] = None):
        super().__init__()
        moe = config.moe
        self.layer_index = layer_index
        self.num_experts, self.k = moe.num_experts, moe.experts_per_token
        self.router_kind, self.norm_topk_prob = moe.router, moe.norm_topk_prob
        self.tp_group, self.ep_group, self.cp_group = tp_group, ep_group, cp_group
        self.sequence_parallel = config.sequence_parallel and tp_group is not None
        self.ep_size = group_size(ep_group)
        self.local_experts = self.num_experts // self.ep_size
        self.statistics = statistics if statistics is not None else MoEStatistics(config)
        self.router = Router(config, generator)
        # Under SP each TP rank routes its own sequence chunk: the router's gradient is summed over TP.
        mark_sequence_parallel(self.router.weight, config.sequence_parallel_group(tp_group))
        self.experts = ExpertMLPs(config, layer_index, tp_group, group_rank(ep_group) * self.local_experts,
                                  self.local_experts, self.ep_size)
        self.shared_experts = None
        if moe.shared_experts:
            width = moe.shared_experts * config.expert_ffn_hidden_size
            shared = dataclasses.replace(config, ffn_hidden_size=width, dropout=0.0)  # dropout once, below
            self.shared_experts = LlamaMLP(shared, tp_group, generator, residual_dropout_rng)
        self.dropout = nn.Dropout(config.dropout)
        self.residual_dropout_rng = residual_dropout_rng

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T_local, h = x.shape
        logits = self.router(x).reshape(-1, self.num_experts)  # (B*T_local, E): this rank's tokens (its SP chunk)
        weights, experts, probs = route(logits, self.k, self.router_kind, self.norm_topk_prob,
                                        getattr(self.router, "expert_bias", None))
        losses = None
        if torch.is_grad_enabled():  # training (a recomputed forward included), not evaluation
            losses = router_losses(logits, probs, experts, self.statistics, self.layer_index,
                                   self.tp_group if self.sequence_parallel else None, self.cp_group,
                                   getattr(self.router, "step_load", None), self._counted_tokens(T_local))
        weights = weights.to(x.dtype).view(B, T_local, self.k)
        experts = experts.view(B, T_local, self.k)
        if self.sequence_parallel:  # (B, T/t, .) -> (B, T, .): every TP rank runs its expert shards on all tokens
            tokens = gather_from_sequence_parallel_region(x, self.tp_group)
            weights = gather_from_sequence_parallel_region(weights, self.tp_group)
            experts = all_gather_sequence(experts, self.tp_group)
        else:  # backward: the TP ranks' partial gradients (their expert shards') summed
            tokens, weights = copy_to_tp_region(x, self.tp_group), copy_to_tp_region(weights, self.tp_group)
        T = tokens.size(1)
        y = self._routed(tokens.reshape(-1, h), weights.reshape(-1, self.k), experts.reshape(-1, self.k))
        y = y.view(B, T, h)  # partial sums over TP: this rank's shards of the experts
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.tp_group)  # (B, T/t, h)
        else:
            y = reduce_from_tp_region(y, self.tp_group)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        if losses is not None:  # the router losses' gradients join this block's backward here
            y = add_to_backward(y, losses, self.statistics)
        with self.residual_dropout_rng():
            return self.dropout(y)

    def _counted_tokens(self, T_local: int) -> Optional[torch.Tensor]:
        """(B*T_local,) bool: which of the tokens this rank routes count (label not -100), from the
        step's masks the run gave the statistics, (B, T/cp); under SP this TP rank's chunk of them."""
        counted = self.statistics.counted(self.layer_index)
        if counted is None:
            return None
        if self.sequence_parallel:
            rank = group_rank(self.tp_group)
            counted = counted[:, rank * T_local:(rank + 1) * T_local]
        return counted.reshape(-1)

    def _routed(self, tokens: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """(N, h) tokens, (N, k) weights and experts -> (N, h) = sum_j weights[:, j] * expert_j(token),
        this TP rank's partial sum. Dropless: every one of the N*k assignments is computed."""
        N, h = tokens.shape
        assignment_expert = experts.reshape(-1)  # (N*k,): token-major, slot-minor
        by_expert = torch.argsort(assignment_expert, stable=True)  # assignments grouped by expert, in token order
        counts = count_assignments(assignment_expert, self.num_experts)  # (E,), on the device
        # expand's backward sums a token's k copies in a fixed order; the index is a permutation
        routed = tokens.unsqueeze(1).expand(N, self.k, h).reshape(N * self.k, h)[by_expert]  # (N*k, h)
        out = self._through_experts(routed, counts)  # (N*k, h), by expert
        per_assignment = out[torch.argsort(by_expert)].view(N, self.k, h)  # token-major again
        return (per_assignment * weights.unsqueeze(-1)).sum(dim=1)

    def _through_experts(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """(N*k, h) rows sorted by expert, (E,) rows per expert -> their experts' outputs, same order.
        Across EP: counts first, then the rows to their experts' ranks, the outputs back.

        One host sync per block (a .tolist()): the all-to-all's split sizes and the GEMMs per expert
        need the counts on the host. Everything else stays on the device: the counts themselves (a
        scatter-add, not bincount, which reads min and max on the host), the grouped GEMM's offsets
        (a cumsum) and the regrouping after the all-to-all (its output size known)."""
        if self.ep_group is None:
            return self.experts(routed, expert_rows(counts, counts.tolist()))
        E_local = self.local_experts
        send = counts.view(self.ep_size, E_local)  # row j: for EP rank j's experts
        received = exchange_counts(send, self.ep_group)  # (ep, E_local) row i: from EP rank i, per local expert
        on_host = torch.cat([send.sum(1), received.reshape(-1)]).tolist()  # the one sync
        send_rows, received_host = on_host[:self.ep_size], on_host[self.ep_size:]
        received_rows = [sum(received_host[i * E_local:(i + 1) * E_local]) for i in range(self.ep_size)]
        sizes = [sum(received_host[e::E_local]) for e in range(E_local)]
        rows = all_to_all_to_experts(routed, received_rows, send_rows, self.ep_group)  # source-major, then expert
        # Regroup by local expert (source order within): each expert's rows consecutive.
        row_expert = torch.arange(E_local, device=rows.device).repeat(self.ep_size)
        row_expert = row_expert.repeat_interleave(received.reshape(-1), output_size=sum(received_rows))
        by_expert = torch.argsort(row_expert, stable=True)
        out = self.experts(rows[by_expert], expert_rows(received.sum(0), sizes))
        out = out[torch.argsort(by_expert)]  # source-major again
        return all_to_all_from_experts(out, send_rows, received_rows, self.ep_group)
