"""The per-step metrics of a mixture-of-experts run (docs/planner-and-metrics.md): the
load-balancing and z-losses, and how many assignments each expert of each MoE block received.

Each MoE block records every training micro-batch's values once, already summed over the ranks
that hold parts of that micro-batch (model/transformer/moe_losses.py). Here the step's records are summed over
the ranks holding other micro-batches (DeepSpeed's data axis, dp x cp: each CP rank of a replica
recorded the same micro-batch, so the sum is divided by cp) and over the pipeline stages (each
holds its own blocks)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # annotations only
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from model.config import GPTConfig


def gather_step_records(engine: PipelineEngine, config: GPTConfig, cp_size: int) -> Optional[torch.Tensor]:
    """The step's router records of every block, (n_layer, 3 + E) on the host (moe_losses.py:
    MoEStatistics), each micro-batch counted once; None for a dense model. Collective over the
    world: every rank calls it after each step."""
    from model.transformer.moe_losses import stage_statistics
    if not config.moe.enabled:
        return None
    statistics = stage_statistics(engine.module)  # None on a stage without MoE blocks (moe_every > 1)
    width = 3 + config.moe.num_experts
    records = statistics.take() if statistics is not None else torch.zeros(config.n_layer, width, dtype=torch.float64)
    records = records.to(engine.device)
    dist.all_reduce(records, group=engine.grid.get_data_parallel_group())
    dist.all_reduce(records, group=engine.grid.get_pipe_parallel_group())
    return records.cpu() / cp_size


def moe_step_record(records: Optional[torch.Tensor], config: GPTConfig) -> Dict[str, Any]:
    """aux_loss, z_loss, expert_load_max_over_mean (the largest over the MoE blocks) and expert_load
    (per MoE block, the assignments each expert received this step) from `gather_step_records`;
    {} for a dense model."""
    from model.transformer.moe_losses import loss_summary
    if records is None:
        return {}
    moe_blocks = [i for i in range(config.n_layer) if config.moe.is_moe_block(i)]
    return loss_summary(records, moe_blocks)


def charted_moe_metrics(record: Dict[str, Any]) -> Dict[str, float]:
    """What wandb charts of a record's expert load: each MoE block's max / mean assignments per expert
    (the full counts stay in --metrics-out)."""
    return {f"expert_load_max_over_mean/block{block}": max(load) / (sum(load) / len(load))
            for block, load in record.get("expert_load", {}).items()}
