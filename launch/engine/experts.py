"""Expert parallelism in DeepSpeed's engine (docs/design.md contract 18).

DeepSpeed knows mixture-of-experts parameters by two marks (moe/experts.py): `allreduce = False` and
`group_name = "ep_size_<ep>"` (model/transformer/moe.py sets both), and treats them only when its engine finds a
`deepspeed.moe.layer.MoE` module (model/gpt/pipe.py adds a parameterless one). Then:
- the gradient reduction sums an expert parameter over its expert-data-parallel group (the ranks that
  hold the same experts) and divides by the whole data axis, dp x cp, as for every parameter
  (engine.py `_reduce_expert_gradients`, and the ZeRO-1 optimizer's own reduction);
- ZeRO-1 partitions the expert parameters' optimizer state over that group, in param groups of
  their own (`split_params_into_different_moe_groups_for_optimizer`);
- the gradient norm sums the expert parameters' squares over the expert-parallel group too, so each
  expert counts once.
DeepSpeed would build those groups itself with its own rank order; `register_expert_groups` gives it
ours instead, cut from the run's one topology (model/parallel/state.py, contract 1).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List

import torch.distributed as dist

if TYPE_CHECKING:  # annotations only
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from launch.config.layout import Layout
    from model.config import GPTConfig
    from model.parallel.state import ParallelState


def register_expert_groups(state: ParallelState) -> None:
    """Put this run's expert-parallel and expert-data-parallel groups where DeepSpeed looks them up
    (`deepspeed.utils.groups`), under the name the expert parameters carry. Collective: every rank
    calls it, before `deepspeed.initialize`. At ep = 1 each rank is its own EP group."""
    from deepspeed.utils import groups

    from model.transformer.moe import expert_group_name
    from model.parallel.state import expert_data_parallel_groups

    rank, name = dist.get_rank(), expert_group_name(state.ep_size)
    if state.ep_size > 1:
        ep_group = state.ep_group
    else:  # new_group is collective over the world: every rank makes every singleton, in order
        ep_group = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]
    groups._EXPERT_PARALLEL_GROUP[name] = ep_group
    groups._EXPERT_PARALLEL_GROUP_RANKS[name] = _own_ranks(state.ep_groups, rank)
    groups._EXPERT_DATA_PARALLEL_GROUP[name] = state.expert_dp_group
    groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = _own_ranks(
        expert_data_parallel_groups(state.topology, state.ep_size), rank)


def _own_ranks(rank_lists: List[List[int]], rank: int) -> List[int]:
    return next(ranks for ranks in rank_lists if rank in ranks)


def expert_param_groups(param_groups: List[dict]) -> List[dict]:
    """The optimizer's parameter groups with the expert parameters moved into groups of their own,
    one per expert group name and original group (DeepSpeed's split, which ZeRO-1 needs)."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    return split_params_into_different_moe_groups_for_optimizer(param_groups)


def set_router_loss_scale(engine: PipelineEngine, layout: Layout) -> None:
    """Before a step: the gradient the router losses enter backward with (model/transformer/moe_losses.py),
    DeepSpeed's scale of the main loss: 1 / gradient-accumulation steps, times the fp16 loss scale,
    times cp (DeepSpeed averages over dp x cp ranks, a CP rank holding 1/cp of a replica's tokens)."""
    from launch.instruments.metrics import loss_scale
    from model.transformer.moe_losses import stage_statistics
    statistics = stage_statistics(engine.module)
    if statistics is not None:
        statistics.backward_scale = layout.cp * loss_scale(engine) / layout.grad_accum_steps


def after_moe_step(engine: PipelineEngine, config: GPTConfig, layout: Layout) -> Dict[str, Any]:
    """After each optimizer step: the step's router metrics (launch/instruments/moe_metrics.py), and
    the routers' balancing state moved from the step's expert load (model/transformer/moe_balance.py).
    {} for a dense model. Collective over the world: every rank calls it."""
    from launch.instruments.moe_metrics import gather_step_records, moe_step_record
    from model.transformer.moe_balance import balance_after_step
    records = gather_step_records(engine, config, layout.cp)
    if records is not None:
        balance_after_step(engine.module, records[:, 3:], config.moe)
    return moe_step_record(records, config)
