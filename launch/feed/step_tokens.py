"""The step's counted tokens, before the step runs: what makes the loss a mean over every counted
token of the step at any micro-batch size and layout (model/gpt/pipe.py: TokenMeanLoss),
and what tells the MoE routers which of their tokens count (model/transformer/moe_losses.py).

The last pipeline stage reads the labels. Before each `train_batch` (and `eval_batch`) it draws the
step's m micro-batches, counts their labels other than IGNORE_INDEX, sums the count over DeepSpeed's
data axis (dp x cp ranks: the replicas' micro-batches, and each CP rank's shard of them) and hands
the loss N / (m x dp x cp). The micro-batches then feed the engine from memory: m x (B, T) integers.
The count stays on the device: no host sync.

With experts, every stage's routers need the same: which tokens of each micro-batch count. The
first stage draws its step's micro-batches too and sends their (m, B, T/cp) masks down its
pipeline (one broadcast of m B T/cp bytes per step); each stage then sums them over its data axis.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from model.parallel.cross_entropy import IGNORE_INDEX

if TYPE_CHECKING:  # annotations only
    from deepspeed.runtime.pipe.engine import PipelineEngine

MicroBatch = Tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class RouterTokens:
    """What the step's token masks look like on a rank of a model with experts."""
    tokens_shape: Tuple[int, int]
    """(B, T/cp): one micro-batch's labels on this rank."""
    cp: int


def count_step_tokens(engine: PipelineEngine, feed: Iterator[MicroBatch], micro_batches: int,
                      routers: Optional[RouterTokens] = None) -> Iterator[MicroBatch]:
    """The feed of one step (or one evaluated global batch) for `engine.train_batch`/`eval_batch`.
    On the first and the last stage its m micro-batches are drawn now, and on the last the loss's
    `tokens_per_share` is set; with `routers` (a training step of a model with experts) every
    stage's routers get the step's masks. Collective over the data axis (and the pipeline, with `routers`):
    every rank calls it each step."""
    first, last = engine.is_first_stage(), engine.is_last_stage()
    # The first stage draws now too: the last stage's micro-batches come from the replica's reader
    # on the first stage (launch/feed/replica_reader.py), and the routers need its masks.
    batches = [next(feed) for _ in range(micro_batches)] if first or last else None
    if last:
        counted = sum((labels != IGNORE_INDEX).sum(dtype=torch.float64) for _, labels in batches)
        group = engine.grid.get_data_parallel_group()  # dp x cp ranks, all on the last stage
        dist.all_reduce(counted, group=group)
        shares = micro_batches * dist.get_world_size(group)
        # fp64 then fp32: N / shares is exact whenever N is a multiple of it (every token counted), so
        # the loss is then sum / (B x T/cp), as the per-micro-batch mean divides. At least one token:
        # a step without counted tokens has loss 0, not NaN.
        engine.module.loss_fn.tokens_per_share = (counted.clamp(min=1.0) / shares).float()
    if routers is not None:
        _give_routers_their_masks(engine, batches, micro_batches, routers)
    return iter(batches) if batches is not None else feed


def _give_routers_their_masks(engine: PipelineEngine, batches: Optional[List[MicroBatch]], micro_batches: int,
                              routers: RouterTokens) -> None:
    """Every stage of the pipeline gets the first stage's (m, B, T/cp) masks of counted tokens; this
    stage's routers (if any) get them, with the step's counted tokens per micro-batch and replica."""
    from model.transformer.moe_losses import stage_statistics
    device = torch.device(engine.device)
    if batches is not None and engine.is_first_stage():
        masks = torch.stack([(labels != IGNORE_INDEX) for _, labels in batches]).to(device, torch.uint8)
    else:
        masks = torch.empty((micro_batches,) + tuple(routers.tokens_shape), dtype=torch.uint8, device=device)
    if engine.num_stages > 1:
        dist.broadcast(masks, src=engine.grid.stage_to_global(0), group=engine.grid.get_pipe_parallel_group())
    counted = masks.sum(dtype=torch.float64)
    group = engine.grid.get_data_parallel_group()  # dp x cp ranks of this stage
    dist.all_reduce(counted, group=group)
    replicas = dist.get_world_size(group) // routers.cp
    statistics = stage_statistics(engine.module)
    if statistics is not None:  # None on a stage without MoE blocks (moe_every > 1)
        statistics.start_step(list(masks.bool()), (counted / (micro_batches * replicas)).float())
