"""The step's counted tokens, before the step runs: what makes the loss a mean over every counted
token of the step at any micro-batch size and layout (model/gpt/pipe.py: TokenMeanLoss; issue 33).

The last pipeline stage reads the labels. Before each `train_batch` (and `eval_batch`) it draws the
step's m micro-batches, counts their labels other than IGNORE_INDEX, sums the count over DeepSpeed's
data axis (dp x cp ranks: the replicas' micro-batches, and each CP rank's shard of them) and hands
the loss N / (m x dp x cp). The micro-batches then feed the engine from memory: m x (B, T) integers.
Other stages read their inputs as before. The count stays on the device: no host sync.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Tuple

import torch
import torch.distributed as dist

from model.parallel.cross_entropy import IGNORE_INDEX

if TYPE_CHECKING:  # annotations only
    from deepspeed.runtime.pipe.engine import PipelineEngine

MicroBatch = Tuple[torch.Tensor, torch.Tensor]


def count_step_tokens(engine: PipelineEngine, feed: Iterator[MicroBatch],
                      micro_batches: int) -> Iterator[MicroBatch]:
    """The feed of one step (or one evaluated global batch) for `engine.train_batch`/`eval_batch`.
    On the last stage its m micro-batches are drawn now and the loss's `tokens_per_share` is set;
    a collective over the last stage's data-parallel group (every rank of it calls this each step)."""
    if not engine.is_last_stage():
        return feed
    batches = [next(feed) for _ in range(micro_batches)]
    counted = sum((labels != IGNORE_INDEX).sum(dtype=torch.float64) for _, labels in batches)
    group = engine.grid.get_data_parallel_group()  # dp x cp ranks, all on the last stage
    dist.all_reduce(counted, group=group)
    shares = micro_batches * dist.get_world_size(group)
    # fp64 then fp32: N / shares is exact whenever N is a multiple of it (every token counted), so
    # the loss is then sum / (B x T/cp), as the per-micro-batch mean divides. At least one token:
    # a step without counted tokens has loss 0, not NaN.
    engine.module.loss_fn.tokens_per_share = (counted.clamp(min=1.0) / shares).float()
    return iter(batches)
