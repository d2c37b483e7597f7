"""What a step's line of metrics holds (launch/instruments/metrics.py writes it;
docs/planner-and-metrics.md describes it): the step's loss and rates from this rank, its time, memory and data wait from every
rank's all-gathered numbers (launch/instruments/stragglers.py)."""
from __future__ import annotations

from typing import Optional, Sequence

from launch.instruments.stragglers import StepNumbers, slowest_data_reader, summarise_seconds


def step_record(step: int, samples: int, loss: float, grad_norm: float, lr: float, loss_scale: float,
                seconds: float, tokens_per_step: int, numbers: StepNumbers, stages: Sequence[int],
                layout_auto: Optional[dict], compute_by_rank: bool) -> dict:
    """The record of `step`, `samples` the samples consumed after it. tokens_per_s and step_time_s
    are this rank's; memory is the largest over ranks; data_wait_s the slowest reader's (named by
    data_wait_rank); compute_s each rank's compute seconds summarised over all ranks and each stage
    (`stages`: every rank's pipeline stage). `layout_auto`: what --layout auto chose, on the
    first step; `compute_by_rank` (--metrics-per-rank) adds every rank's compute seconds."""
    reader = slowest_data_reader(numbers.data_wait_s)
    record = {"step": step, "samples": samples, "loss": loss, "grad_norm": grad_norm, "lr": lr,
              "loss_scale": loss_scale, "tokens": step * tokens_per_step,
              "tokens_per_s": tokens_per_step / seconds, "step_time_s": seconds,
              "peak_memory_bytes": numbers.peak_allocated, "peak_reserved_bytes": numbers.peak_reserved,
              "data_wait_s": reader["seconds"], "data_wait_rank": reader["rank"],
              "compute_s": summarise_seconds(numbers.compute_s, stages)}
    if layout_auto is not None:
        record["layout_auto"] = layout_auto
    if compute_by_rank:
        record["compute_s_by_rank"] = numbers.compute_s.tolist()
    return record
