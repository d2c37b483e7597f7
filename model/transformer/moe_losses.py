"""The router's auxiliary losses and statistics (model/transformer/moe.py), over each micro-batch's whole token set.

- Load balancing (Switch Transformer, Fedus et al. 2022, eq. 4, in transformers' normalisation):
  E * sum_e f_e * P_e, with f_e the number of assignments to expert e over the number of tokens (the
  f_e sum to k) and P_e the mean router probability of e; averaged over the MoE blocks, times
  model.moe.aux_loss_coef. transformers pools the blocks' counts before the product; here each
  block is balanced on its own, as Megatron-LM does. With balance_scope=global_batch f_e is the
  last step's over the global batch (the router's step_load: model/transformer/moe_balance.py); with
  balance other than aux_loss the loss is only recorded, not trained on.
- z-loss (ST-MoE, Zoph et al. 2022, eq. 5): the mean over tokens of logsumexp(logits)^2, averaged
  over the MoE blocks, times model.moe.z_loss_coef.

A micro-batch's tokens may be spread over ranks: the TP ranks' sequence chunks under sequence
parallelism, the CP ranks' shards. f_e, the token count and the logged values are summed over those
ranks first (no gradient: they are counts, or values only reported), and each rank's differentiable
share, E * sum_e f_e * (its sum of P_e) / N, sums over them to the micro-batch's loss.

The losses never cross a pipeline stage: `add_to_backward` attaches them to the block's output,
whose backward then adds their gradient, scaled as DeepSpeed scales the main loss (Megatron-LM's
MoEAuxLossAutoScaler): 1 / gradient-accumulation steps, times the fp16 loss scale, times cp
(DeepSpeed averages over dp x cp ranks, and a CP rank's share is 1/cp of its replica's loss).
"""
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from model.parallel.compile_boundary import opaque_to_compile
from model.parallel.mappings import Group


class MoEStatistics:
    """One pipeline stage's router records and the scale of the router losses' backward. Shared by
    the stage's MoE blocks; the training loop sets `backward_scale` before each step and takes the
    records after it (launch/instruments/moe_metrics.py)."""

    def __init__(self, config) -> None:
        moe = config.moe
        self.num_experts = moe.num_experts
        # The load-balancing loss joins the objective with balance=aux_loss only (model/moe_config.py).
        self.aux_loss_coef = moe.aux_loss_coef if moe.balance == "aux_loss" else 0.0
        self.z_loss_coef = moe.z_loss_coef
        moe_blocks = [i for i in range(config.n_layer) if moe.is_moe_block(i)]
        self.block_weight = 1.0 / max(1, len(moe_blocks))  # the losses are means over the MoE blocks
        self.backward_scale = 1.0
        """d(objective)/d(router loss) of this micro-batch: set by the run (1 in a plain backward)."""
        # Per block (by layer index): [sum of load-balancing losses, sum of z-losses, micro-batches,
        # assignments per expert (E)], summed over the recorded micro-batches; float64: exact counts.
        self.records = torch.zeros(config.n_layer, 3 + moe.num_experts, dtype=torch.float64)
        self.step_masks: Optional[List[torch.Tensor]] = None
        """Per micro-batch of the step, (B, T/cp) bool: which of this rank's tokens count (label not
        -100); None: every token (a caller that drives the engine itself)."""
        self.step_tokens: Optional[torch.Tensor] = None
        """0-d fp32: the step's counted tokens per micro-batch and replica, N / (m x dp)."""
        self._calls: Dict[int, int] = {}

    def start_step(self, masks: List[torch.Tensor], step_tokens: torch.Tensor) -> None:
        """Before a step (launch/feed/step_tokens.py): its micro-batches' masks and counted tokens."""
        self.step_masks, self.step_tokens, self._calls = masks, step_tokens, {}

    @opaque_to_compile  # Python state that changes per call: dynamo would guard on it and recompile
    def counted(self, layer_index: int) -> Optional[torch.Tensor]:
        """The mask of the micro-batch block `layer_index` routes now, or None. A block's router
        losses run once per micro-batch, in micro-batch order, in 1F1B and ZB-H1 alike (under full
        recompute in the recomputed forward, the first one being under no_grad)."""
        if self.step_masks is None:
            return None
        call = self._calls.get(layer_index, 0)
        self._calls[layer_index] = call + 1
        return self.step_masks[call]

    def record(self, layer_index: int, aux: torch.Tensor, z: torch.Tensor, counts: torch.Tensor) -> None:
        """Add one micro-batch's values (0-d tensors and (E,) counts: on the device, no sync)."""
        if self.records.device != counts.device:
            self.records = self.records.to(counts.device)
        one = torch.ones(1, dtype=counts.dtype, device=counts.device)
        self.records[layer_index] += torch.cat([aux.view(1), z.view(1), one, counts]).to(torch.float64)

    def take(self) -> torch.Tensor:
        """The records since the last take, (n_layer, 3 + E), and a fresh start."""
        taken, self.records = self.records, torch.zeros_like(self.records)
        return taken


def count_assignments(experts: torch.Tensor, num_experts: int, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(...) expert indices -> (E,) int64 assignments per expert, without a host sync: a scatter-add
    (exact: integers), where CUDA's bincount would read the indices' min and max on the host. With
    `weights` (same shape, 0 or 1: which assignments count) the counts are in the weights' dtype."""
    flat = experts.reshape(-1)
    ones = torch.ones_like(flat) if weights is None else weights.reshape(-1)
    return torch.zeros(num_experts, dtype=ones.dtype, device=flat.device).scatter_add_(0, flat, ones)


def _sum_over(x: torch.Tensor, groups: List[Group]) -> torch.Tensor:
    for group in groups:
        if group is not None:
            dist.all_reduce(x, group=group)
    return x


def router_losses(logits: torch.Tensor, probs: torch.Tensor, experts: torch.Tensor, statistics: MoEStatistics,
                  layer_index: int, sequence_group: Group, cp_group: Group,
                  step_load: Optional[torch.Tensor] = None, counted: Optional[torch.Tensor] = None
                  ) -> Optional[torch.Tensor]:
    """This rank's differentiable share of the block's weighted router losses (None when both
    coefficients are 0), and the micro-batch's values recorded in `statistics`.

    logits, probs: (N, E) of this rank's tokens; experts: (N, k). `sequence_group`: the TP group
    when the tokens are sequence-parallel chunks, else None; `cp_group`: the CP group. `step_load`
    (E,): f_e of the last step's global batch (balance_scope=global_batch), used instead of the
    micro-batch's own. `counted` (N,) bool: the tokens whose label is not -100 (None: all); the
    others are left out of f, P and the z-loss, as transformers leaves out padding.

    The z-loss, and P with step_load, are normalised by the step's counted tokens per micro-batch
    and replica (`statistics.step_tokens`, when the run set it), so that DeepSpeed's mean over the
    micro-batches and replicas makes them means over the step's counted tokens; it equals the
    micro-batch's own count when every micro-batch counts the same."""
    E = logits.size(1)
    weight = None if counted is None else counted.to(probs.dtype)  # (N,)
    lse_squared_per_token = torch.logsumexp(logits.float(), dim=-1).pow(2)
    lse_squared = (lse_squared_per_token if weight is None else lse_squared_per_token * weight).sum()
    prob_sum = (probs if weight is None else probs * weight.unsqueeze(1)).sum(dim=0)  # (E,)
    assignment_weight = None if weight is None else weight.unsqueeze(1).expand_as(experts)
    counts = count_assignments(experts, E, assignment_weight).to(probs.dtype)
    tokens_here = (torch.full((1,), float(logits.size(0)), dtype=probs.dtype, device=probs.device)
                   if weight is None else weight.sum().view(1))
    totals = torch.cat([counts, prob_sum.detach(), lse_squared.detach().view(1), tokens_here])
    totals = _sum_over(totals, [sequence_group, cp_group])  # the micro-batch's tokens
    counts, total_prob, total_lse_squared = totals[:E], totals[E:2 * E], totals[2 * E]
    tokens = totals[2 * E + 1].clamp_(min=1.0)  # a micro-batch without counted tokens: losses 0, not NaN
    step_tokens = tokens if statistics.step_tokens is None else statistics.step_tokens.clamp(min=1.0)
    share = counts / tokens if step_load is None else step_load.to(probs.dtype)  # f_e
    prob_tokens = tokens if step_load is None else step_tokens  # P_e of the micro-batch, or its share of the step's
    statistics.record(layer_index, aux=E * (share * total_prob).sum() / prob_tokens, z=total_lse_squared / step_tokens,
                      counts=counts)
    if statistics.aux_loss_coef == 0 and statistics.z_loss_coef == 0:
        return None
    aux = E * (share * prob_sum).sum() / prob_tokens  # this rank's share of the load-balancing loss
    z = lse_squared / step_tokens
    return statistics.block_weight * (statistics.aux_loss_coef * aux + statistics.z_loss_coef * z)


class _AddToBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, loss, statistics):
        ctx.statistics = statistics
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.statistics.backward_scale, dtype=torch.float32, device=grad.device), None


def add_to_backward(y: torch.Tensor, loss: torch.Tensor, statistics: MoEStatistics) -> torch.Tensor:
    """forward: y unchanged; backward: y's gradient passes, and `loss` receives the gradient
    `statistics.backward_scale`, as if it had been added to the objective (Megatron-LM's
    MoEAuxLossAutoScaler)."""
    return _AddToBackward.apply(y, loss, statistics)


def stage_statistics(module: torch.nn.Module) -> Optional[MoEStatistics]:
    """The MoEStatistics the MoE blocks of `module` share (model/transformer/moe.py: MoEMLP.statistics), or None
    without MoE blocks."""
    return next((m.statistics for m in module.modules() if isinstance(getattr(m, "statistics", None), MoEStatistics)),
                None)


def loss_summary(records: torch.Tensor, moe_blocks: List[int]) -> Dict[str, object]:
    """From the step's records of every block (summed over ranks, each micro-batch once): the mean
    load-balancing and z-losses over the MoE blocks, each block's assignments per expert, and the
    largest ratio of an expert's assignments to the mean over the experts."""
    rows = records[moe_blocks]
    per_block_aux = rows[:, 0] / rows[:, 2]
    per_block_z = rows[:, 1] / rows[:, 2]
    load = rows[:, 3:]
    imbalance = load.max(dim=1).values / load.mean(dim=1)
    return {"aux_loss": float(per_block_aux.mean()), "z_loss": float(per_block_z.mean()),
            "expert_load_max_over_mean": float(imbalance.max()),
            "expert_load": {str(block): [int(c) for c in row.tolist()] for block, row in zip(moe_blocks, load)}}
