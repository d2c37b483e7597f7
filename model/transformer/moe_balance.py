"""The balancing state of the MoE routers, moved after each optimizer step from the step's expert load
(model.moe.balance and balance_scope: model/moe_config.py; docs/architectures.md, "Load balancing").

The load is the step's assignments per expert of each MoE block, summed over every micro-batch,
replica and shard of the global batch (launch/instruments/moe_metrics.py gathers it): the same
integers on every rank at every layout, so every rank moves its copy of the state the same way and
the state is the same at every layout.

- balance=bias (DeepSeek-V3, Liu et al. 2024, sec. 2.1.2): b_e += gamma * sign(mean_e(c) - c_e):
  an expert that received fewer assignments than the mean becomes likelier to be chosen.
- balance_scope=global_batch (Qiu et al. 2025): f_e = k c_e / sum(c), the share of the step's k
  assignments per token that went to e, which the next step's load-balancing loss uses.
"""
from typing import List

import torch

from model.moe_config import MoEConfig


def balance_after_step(module: torch.nn.Module, load: torch.Tensor, moe: MoEConfig) -> None:
    """Update the routers' state of the MoE blocks in `module` (one pipeline stage) from `load`,
    (n_layer, E) assignments per expert of the step, indexed by layer (rows of other stages' blocks
    are ignored). Does nothing unless balance=bias or balance_scope=global_batch."""
    if moe.balance != "bias" and moe.balance_scope != "global_batch":
        return
    for block in _moe_blocks(module):
        counts = load[block.layer_index].to(device=block.router.weight.device, dtype=torch.float64)
        if moe.balance == "bias":
            step = torch.sign(counts.mean() - counts) * moe.bias_update_rate
            block.router.expert_bias += step.to(block.router.expert_bias.dtype)
        if moe.balance_scope == "global_batch":
            block.router.step_load.copy_(moe.experts_per_token * counts / counts.sum())


def _moe_blocks(module: torch.nn.Module) -> List[torch.nn.Module]:
    """The MoE MLPs (model/transformer/moe.py: MoEMLP) of `module`: those with a router and a layer index."""
    return [m for m in module.modules() if hasattr(m, "router") and hasattr(m, "layer_index")]
