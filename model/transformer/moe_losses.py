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


def count_assignments(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(...) expert indices -> (E,) int64 assignments per expert, without a host sync: a scatter-add
    (exact: integers), where CUDA's bincount would read the indices' min and max on the host."""
    flat = experts.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def _sum_over(x: torch.Tensor, groups: List[Group]) -> torch.Tensor:
    for group in groups:
        if group is not None:
            dist.all_reduce(x, group=group)
    return x


def router_losses(logits: torch.Tensor, probs: torch.Tensor, experts: torch.Tensor, statistics: MoEStatistics,
                  layer_index: int, sequence_group: Group, cp_group: Group,
                  step_load: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """This rank's differentiable share of the block's weighted router losses (None when both
    coefficients are 0), and the micro-batch's values recorded in `statistics`.

    logits, probs: (N, E) of this rank's tokens; experts: (N, k). `sequence_group`: the TP group
    when the tokens are sequence-parallel chunks, else None; `cp_group`: the CP group. `step_load`
    (E,): f_e of the last step's global batch (balance_scope=global_batch), used instead of the
    micro-batch's own; every micro-batch has the same tokens, so DeepSpeed's mean over the
    micro-batches and replicas makes P_e the step's mean probability."""
    E = logits.size(1)
    lse_squared = torch.logsumexp(logits.float(), dim=-1).pow(2).sum()  # this rank's tokens
    prob_sum = probs.sum(dim=0)  # (E,)
    counts = count_assignments(experts, E).to(probs.dtype)
    totals = torch.cat([counts, prob_sum.detach(), lse_squared.detach().view(1),
                        torch.full((1,), float(logits.size(0)), dtype=probs.dtype, device=probs.device)])
    totals = _sum_over(totals, [sequence_group, cp_group])  # the micro-batch's tokens
    counts, total_prob, total_lse_squared, tokens = totals[:E], totals[E:2 * E], totals[2 * E], totals[2 * E + 1]
    share = counts / tokens if step_load is None else step_load.to(probs.dtype)  # f_e
    statistics.record(layer_index, aux=E * (share * total_prob).sum() / tokens, z=total_lse_squared / tokens,
                      counts=counts)
    if statistics.aux_loss_coef == 0 and statistics.z_loss_coef == 0:
        return None
    aux = E * (share * prob_sum).sum() / tokens  # this rank's share of the load-balancing loss
    z = lse_squared / tokens
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
