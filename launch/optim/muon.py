"""Muon for the hidden matrices, AdamW for the rest: `train.optimizer: muon` (docs/design.md,
"Muon at every layout").

The update of each logical matrix W (m x n) is torch.optim.Muon's (torch 2.13, torch/optim/_muon.py),
Moonlight's Algorithm 1 with Nesterov momentum (Liu et al. 2025, "Muon is Scalable for LLM Training")
with the momentum kept as an average:
    B <- mu B + (1 - mu) G;  U = (1 - mu) G + mu B (Nesterov) or B
    W <- W (1 - lr wd) - lr s(m, n) NS(U)
with NS Keller Jordan's Newton-Schulz iteration and s(m, n) the lr rule (launch/optim/newton_schulz.py:
moonlight 0.2 sqrt(max(m, n)), keller sqrt(max(1, m / n)), none 1). B is torch's `momentum_buffer`,
element for element, so a state moved to or from torch.optim.Muon means the same; Moonlight's and
Keller Jordan's running sum M = B / (1 - mu) gives the same NS(U) (NS normalises U first). The momentum is
element-wise, so it lives wherever DeepSpeed keeps the parameter's fp32 state; NS needs the whole
matrix, so before it each rank rebuilds the whole matrices of U:
- DeepSpeed's ZeRO-1 and BF16 optimizers hand this optimizer one flat fp32 partition per param
  group (its slice of the group's parameters laid end to end, cut into dp equal pieces). `bind`
  reads from the wrapper where each parameter lies in the flat buffer and gives each matrix an owner
  rank of the group's data-parallel group (launch/optim/muon_owners.py); `step` sends each
  owner its matrices' pieces of U (an all-to-all), the owner and its TP peers (who own the same
  matrices' other shards) give each matrix one finisher among them, which assembles it whole,
  splits fused weights into their logical parts (launch/optim/muon_matrices.py), orthogonalises
  each and returns every peer its shard (launch/optim/muon_tp_owners.py); a last all-to-all sends
  every rank the update of the elements it holds. Each logical matrix is orthogonalised once in its
  TP x DP group, so the update is the one-device update to fp32 rounding;
- fp32 ZeRO-0 hands the parameters themselves: only the TP step, every dp rank orthogonalising
  its TP group's share of every matrix (no partition to own).
The AdamW group gets torch's AdamW update (decoupled weight decay; state `exp_avg`, `exp_avg_sq`,
`step`, as DeepSpeed's checkpoints and launch/checkpoints/reshard.py know them), its weight decay on
its >= 2-D parameters only (embeddings, output head, routers; not norms or biases: GPT-2 / nanoGPT),
chosen per parameter, or per element of a flat partition (`bind`), so that one AdamW group serves every
stage (launch/engine/engine.py: _muon_param_groups). A Muon group's state is `momentum_buffer` and `step`.
The AdamW group may have its own lr, betas and weight decay (train.muon_adamw_*: `muon_factory`); the
lr schedule multiplies each group's own peak (launch/optim/lr_schedule.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from launch.analysis.muon_cost import assign_owners
from launch.optim.muon_matrices import MatrixLayout, matrix_layout
from launch.optim.muon_owners import OwnerExchange, from_owners, newton_schulz_cost, plan_exchange, to_owners
from launch.optim.muon_tp_owners import finished_updates
from launch.optim.newton_schulz import NS_STEPS, ns_dtype, orthogonalise, update_scale

if TYPE_CHECKING:  # annotations only
    from launch.config.recipe import TrainSection

MOMENTUM_KEY = "momentum_buffer"  # torch.optim.Muon's name for the same buffer


@dataclass
class FlatPartition:
    """Where a Muon group's parameters lie in DeepSpeed's flat buffer, and which piece is ours."""
    params: List[torch.nn.Parameter]  # in flat order
    offsets: List[int]  # element offset of each in the (padded) flat buffer
    dp_group: Optional[dist.ProcessGroup]
    dp_size: int
    dp_rank: int


class Muon(torch.optim.Optimizer):
    """Groups with `muon=True` hold Muon matrices (each gets `muon_layout`); the others are AdamW's.
    `lr_rule`: moonlight, keller or none; `ns_dtype`: fp32, bf16 or None (bf16 on a GPU)."""

    def __init__(self, param_groups: List[dict], lr: float, weight_decay: float, betas: Tuple[float, float],
                 eps: float, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = NS_STEPS,
                 tp_group: Optional[dist.ProcessGroup] = None, lr_rule: str = "moonlight",
                 ns_dtype: Optional[str] = None):
        defaults = dict(lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=eps, momentum=momentum,
                        nesterov=nesterov, ns_steps=ns_steps, lr_rule=lr_rule, ns_dtype=ns_dtype, muon=False)
        super().__init__(param_groups, defaults)
        self.tp_group = tp_group
        self.tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
        self.tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
        for group in self.param_groups:
            if group["muon"]:
                for p in group["params"]:
                    p.muon_layout = matrix_layout(p, self.tp_size)  # an attribute: groups are pickled
        self.flat: Dict[int, FlatPartition] = {}  # id of a flat partition -> its layout (set by `bind`)
        self.exchanges: Dict[int, OwnerExchange] = {}  # id of a Muon flat partition -> its owners' plan
        self.decayed: Dict[int, torch.Tensor] = {}  # id of an AdamW flat partition -> which elements decay

    def bind(self, flat_param: torch.Tensor, partition: FlatPartition) -> None:
        """Tell a group that DeepSpeed replaced its parameters by `flat_param`, this rank's piece of
        their flat buffer (launch/optim/muon_partitions.py)."""
        self.flat[id(flat_param)] = partition
        size = flat_param.numel()
        if all(hasattr(p, "muon_layout") for p in partition.params):  # Muon's group: owners, no per-element decay
            owner = assign_owners([newton_schulz_cost(p) for p in partition.params], partition.dp_size)
            plan = plan_exchange([p.numel() for p in partition.params], partition.offsets, owner, size,
                                 partition.dp_size, partition.dp_rank)
            plan.send_index, plan.recv_index = (index.to(flat_param.device) for index in (plan.send_index, plan.recv_index))
            self.exchanges[id(flat_param)] = plan  # its indices on the device once, not copied every step
            return
        decayed = torch.zeros(size * partition.dp_size, dtype=torch.bool, device=flat_param.device)
        for param, offset in zip(partition.params, partition.offsets):
            decayed[offset:offset + param.numel()] = param.dim() >= 2
        self.decayed[id(flat_param)] = decayed[partition.dp_rank * size:(partition.dp_rank + 1) * size].clone()

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "Muon takes no closure"
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["muon"]:
                self._muon_step(params, group)
            else:
                for p in params:
                    self._adamw_step(p, group)

    def _muon_step(self, params: List[torch.Tensor], group: dict) -> None:
        """One step of a Muon group: DeepSpeed's flat partition (ZeRO-1, BF16) or the matrices themselves."""
        directions = [self._direction(p, group) for p in params]
        if params and id(params[0]) in self.flat:
            updates = [self._flat_update(u, self.flat[id(p)], self.exchanges[id(p)], group) for p, u in zip(params, directions)]
        else:
            updates = self._matrix_updates(directions, [p.muon_layout for p in params], group)
        for p, update in zip(params, updates):
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(update, alpha=-group["lr"])

    def _direction(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        """U: the momentum average updated with this step's gradient, or Nesterov's (1 - mu) G + mu B
        (torch.optim.Muon's lerps, so that `momentum_buffer` holds torch's numbers)."""
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state[MOMENTUM_KEY] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        mu, g, buf = group["momentum"], p.grad, state[MOMENTUM_KEY]
        buf.lerp_(g, 1 - mu)
        return g.lerp(buf, mu) if group["nesterov"] else buf

    def _matrix_updates(self, shards: List[torch.Tensor], layouts: List[MatrixLayout], group: dict) -> List[torch.Tensor]:
        """This rank's shard of s(m, n) NS(part) for each logical part of each matrix (collective over
        TP: each matrix orthogonalised on one TP peer, launch/optim/muon_tp_owners.py)."""
        rule, dtype = group["lr_rule"], group["ns_dtype"]

        def update(part: torch.Tensor) -> torch.Tensor:  # part: (rows, cols) or (E/ep, rows, cols)
            return orthogonalise(part, group["ns_steps"], dtype=ns_dtype(dtype, part.device)) * update_scale(
                *part.shape[-2:], rule)
        return finished_updates(shards, layouts, update, self.tp_group, self.tp_rank)

    def _flat_update(self, u: torch.Tensor, partition: FlatPartition, plan: OwnerExchange,
                     group: dict) -> torch.Tensor:
        """This rank's piece (size,) of the flat update: its owned matrices orthogonalised by it or a
        TP peer (all-to-alls over the group's DP group, then over TP)."""
        owned = to_owners(u, plan, partition.dp_group)  # (owned_numel,)
        params = [partition.params[index] for index in plan.owned]
        shards = [owned[start:start + p.numel()].view(p.shape) for p, start in zip(params, plan.owned_offsets)]
        owned_update = torch.empty_like(owned)
        for p, start, update in zip(params, plan.owned_offsets,
                                    self._matrix_updates(shards, [p.muon_layout for p in params], group)):
            owned_update[start:start + p.numel()] = update.reshape(-1)
        return from_owners(owned_update, plan, u.numel(), partition.dp_group)

    def _adamw_step(self, p: torch.Tensor, group: dict) -> None:
        """torch's AdamW (decoupled weight decay, bias-corrected moments)."""
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        step = state["step"].item()
        (beta1, beta2), lr, g = group["betas"], group["lr"], p.grad
        decay = 1 - lr * group["weight_decay"]
        decayed = self.decayed.get(id(p))
        if decayed is not None:  # a flat partition: its >= 2-D parameters' elements
            p.mul_(torch.where(decayed, decay, 1.0))
        elif p.dim() >= 2:
            p.mul_(decay)
        state["exp_avg"].lerp_(g, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (state["exp_avg_sq"].sqrt() / (1 - beta2 ** step) ** 0.5).add_(group["eps"])
        p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1 ** step))


def muon_factory(train_cfg: TrainSection, tp_group: Optional[dist.ProcessGroup]) -> Callable[[List[dict]], Muon]:
    """What deepspeed.initialize calls with the parameter groups (launch/engine/engine.py: param_groups(..., muon=True)).
    The AdamW groups take train.muon_adamw_lr / _beta1 / _beta2 / _weight_decay where set (None: the
    recipe's lr, beta1, beta2, weight_decay), the Muon group lr and weight_decay."""
    def own(value, default):
        return default if value is None else value

    def build(groups: List[dict]) -> Muon:
        adamw = dict(lr=own(train_cfg.muon_adamw_lr, train_cfg.lr),
                     betas=(own(train_cfg.muon_adamw_beta1, train_cfg.beta1), own(train_cfg.muon_adamw_beta2, train_cfg.beta2)),
                     weight_decay=own(train_cfg.muon_adamw_weight_decay, train_cfg.weight_decay))
        groups = [group if group.get("muon") else {**group, **adamw} for group in groups]
        return Muon(groups, lr=train_cfg.lr, weight_decay=train_cfg.weight_decay, betas=(train_cfg.beta1, train_cfg.beta2),
                    eps=train_cfg.eps, momentum=train_cfg.muon_momentum, nesterov=train_cfg.muon_nesterov,
                    ns_steps=train_cfg.muon_ns_steps, tp_group=tp_group, lr_rule=train_cfg.muon_lr_rule,
                    ns_dtype=train_cfg.muon_ns_dtype)
    return build
