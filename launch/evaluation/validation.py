"""Mean loss over global batches through `engine.eval_batch`, and its perplexity: what the training
loop's validation (launch/trainer/loop.py) and the scoring of given weights (evaluation.py) report."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Iterator

from data.bits_per_byte import validation_loss_and_bpb
from data.pipeline import on_device
from launch.feed.step_tokens import count_step_tokens
from model.parallel.context_parallel import sequence_shards

if TYPE_CHECKING:  # annotations only: no import cost at run time
    import torch
    from data.pipeline import RunData
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from launch.config.layout import Layout
    from model.parallel.state import ParallelState

# exp(50) ~ 5e21: a diverged loss reads as a huge perplexity instead of overflowing to inf.
PERPLEXITY_LOSS_CAP = 50.0


def perplexity(loss: float) -> float:
    return math.exp(min(loss, PERPLEXITY_LOSS_CAP))


def mean_loss(engine: PipelineEngine, batches: Iterator, n: int, state: ParallelState, grad_accum_steps: int,
              progress: Callable[[], None] = lambda: None) -> float:
    """Mean of n `eval_batch` losses over the next n global batches of `batches`; `progress()`
    after each (the hang watchdog times evaluation batch by batch).

    One eval_batch is one global batch (grad_accum_steps micro-batches per pipeline), its loss the
    mean over the batch's counted tokens (launch/feed/step_tokens.py), averaged over dp ranks by
    DeepSpeed and broadcast to every stage. The CP ranks of a replica draw the same samples; each
    keeps its sequence shard."""
    shards = sequence_shards(batches, state.cp_rank, state.cp_size)
    total = 0.0
    for _ in range(n):
        total += engine.eval_batch(data_iter=count_step_tokens(engine, shards, grad_accum_steps)).item()
        progress()
    return total / n


def validation_record(engine: PipelineEngine, data: RunData, state: ParallelState, layout: Layout,
                      eval_batches: int, device: torch.device, logging_rank: bool,
                      progress: Callable[[], None] = lambda: None) -> dict:
    """val_loss, val_ppl and (on the logging rank) val_bpb, bits per byte (data/bits_per_byte.py),
    over the same validation batches at every call; for a mixture also val_loss_by_source (label ->
    that source's own validation loss), with val_loss and val_bpb their means weighted by the
    mixture's weights."""
    def source_loss(source) -> float:
        n = source.eval_global_batches(eval_batches)
        batches = on_device(source.val_batches(state.dp_rank, layout.dp, n), device)
        return mean_loss(engine, batches, n, state, layout.grad_accum_steps, progress)

    val_loss, by_source, val_bpb = validation_loss_and_bpb(
        data, source_loss, lambda source: source.eval_global_batches(eval_batches), with_bpb=logging_rank)
    record = {"val_loss": val_loss, "val_ppl": perplexity(val_loss)}
    if val_bpb is not None:
        record["val_bpb"] = val_bpb
    if by_source is not None:
        record["val_loss_by_source"] = by_source
    return record
