"""Interleaved 1F1B (Narayanan et al. 2021, sec. 2.2.2): each pipeline rank holds v chunks of the
layer table, chunk c of rank r being stage r + c x pp of pp x v, and runs Megatron-LM's order of
forward and backward passes over them (megatron/core/pipeline_parallel/schedules.py:
forward_backward_pipelining_with_interleaving). A micro-batch visits rank 0, 1, ..., pp-1 for
chunk 0, wraps from the last rank back to rank 0 for chunk 1, and so on: it crosses v x pp - 1
stage boundaries instead of pp - 1, and each pass is 1/v of a stage's work. The bubble shrinks by
v: (p-1)/(v m) of the ideal step, (p-1)/(v m + p - 1) of the whole step.

Pure functions, no torch: the per-rank order (`interleaved_order`, and `forward_order` for
evaluation), a simulation that plays it with every dependency a pipeline has
(`simulate_interleaved`), and the counts the planner needs (warm-up depth, activations in flight,
point-to-point messages). launch/engine/interleaved.py runs the order inside DeepSpeed's
PipelineEngine (docs/pipeline-schedules.md, Interleaved stages).

Megatron's order, per rank r of p, with v chunks and m micro-batches (m a multiple of p, which
Megatron's interleaved schedule requires: micro-batches go through the chunks in groups of p):
  - virtual micro-batch k (0 <= k < v m) of the forwards is chunk (k mod p v) div p, micro-batch
    (k div p v) p + k mod p; the backwards run the chunks in reverse, chunk v - 1 - that;
  - warm-up: min(2 (p - r - 1) + (v - 1) p, v m) forwards; then one forward and one backward
    alternating; then the remaining backwards.
With v = 1 it is 1F1B (DeepSpeed's TrainSchedule, PipeDream-Flush), warm-up p - r - 1.
"""
from __future__ import annotations

import functools
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

from launch.config.layout import check_interleaving


class Pass(NamedTuple):
    """One pass of a rank: its chunk, the micro-batch, "F" (forward) or "B" (whole backward)."""
    chunk: int
    microbatch: int
    kind: str


def stage_of(rank: int, chunk: int, pp: int) -> int:
    """The pipeline stage (of pp x v) that chunk `chunk` of rank `rank` holds."""
    return rank + chunk * pp


def warmup_passes(rank: int, pp: int, virtual_stages: int, microbatches: int) -> int:
    """Forwards rank `rank` runs before its first backward: Megatron's 2 (p - r - 1) + (v - 1) p
    for v > 1 (the forwards of the later chunks must reach the last rank and come back), p - r - 1
    under 1F1B; at most every forward of the step, v m."""
    if virtual_stages == 1:
        return min(pp - rank - 1, microbatches)
    return min(2 * (pp - rank - 1) + (virtual_stages - 1) * pp, virtual_stages * microbatches)


def _virtual(k: int, pp: int, virtual_stages: int, forward: bool) -> Tuple[int, int]:
    """(chunk, micro-batch) of the k-th forward (or backward) of a rank (Megatron's
    get_model_chunk_id and get_microbatch_id_in_model_chunk)."""
    group, within = divmod(k, pp * virtual_stages)
    chunk = within // pp
    return (chunk if forward else virtual_stages - 1 - chunk), group * pp + k % pp


def interleaved_order(pp: int, virtual_stages: int, microbatches: int) -> List[List[Pass]]:
    """Every rank's passes of one step, in the order it runs them (module docstring)."""
    check_interleaving(pp, virtual_stages, microbatches)
    total = virtual_stages * microbatches
    order = []
    for rank in range(pp):
        if virtual_stages == 1:  # 1F1B: the k-th forward is micro-batch k, and so is the k-th backward
            forwards = [Pass(0, k, "F") for k in range(total)]
            backwards = [Pass(0, k, "B") for k in range(total)]
        else:
            forwards = [Pass(*_virtual(k, pp, virtual_stages, True), "F") for k in range(total)]
            backwards = [Pass(*_virtual(k, pp, virtual_stages, False), "B") for k in range(total)]
        warmup = warmup_passes(rank, pp, virtual_stages, microbatches)
        passes = forwards[:warmup]
        for k in range(total - warmup):  # steady state: a forward, then a backward
            passes += [forwards[warmup + k], backwards[k]]
        passes += backwards[total - warmup:]
        order.append(passes)
    return order


def forward_order(pp: int, virtual_stages: int, microbatches: int) -> List[List[Pass]]:
    """Every rank's forwards of an evaluation step: micro-batch by micro-batch, chunk by chunk (any
    m: each forward waits only for forwards that every rank runs earlier in this order)."""
    return [[Pass(c, mb, "F") for mb in range(microbatches) for c in range(virtual_stages)] for _ in range(pp)]


Event = Tuple[int, str, int, int, float, float]  # (rank, "F" | "B", chunk, micro-batch, start, end)
Times = Union[float, Sequence[float]]


def _per_rank(times: Times, pp: int) -> List[float]:
    return [float(times)] * pp if isinstance(times, (int, float)) else [float(t) for t in times]


@functools.lru_cache(maxsize=None)
def _cached_order(pp: int, virtual_stages: int, microbatches: int) -> Tuple[Tuple[Pass, ...], ...]:
    """interleaved_order, built once per (p, v, m): a planner search plays hundreds of layouts."""
    return tuple(tuple(passes) for passes in interleaved_order(pp, virtual_stages, microbatches))


def simulate_interleaved(pp: int, virtual_stages: int, microbatches: int, t_forward: Times, t_backward: Times,
                         t_p2p: float = 0.0, order: Optional[Sequence[Sequence[Pass]]] = None) -> List[Event]:
    """Play each rank's passes in order, each starting when its rank is free and its inputs exist:
    the forward of stage s needs stage s - 1's forward of the micro-batch (an activation, t_p2p
    later when it crosses ranks: sends do not block the sender); the backward of stage s needs its
    own forward and stage s + 1's backward (a gradient). Pass times are per chunk (a stage's time
    over v), one for all ranks or one per rank. Raises AssertionError if a rank waits for a pass
    that can never run (a deadlock) or runs a pass twice. Events sorted by rank and start."""
    order = _cached_order(pp, virtual_stages, microbatches) if order is None else order
    t_forward, t_backward = _per_rank(t_forward, pp), _per_rank(t_backward, pp)
    stages = pp * virtual_stages
    done: Dict[Tuple[str, int, int], Tuple[int, float]] = {}  # (kind, stage, micro-batch) -> (rank, end)
    position, clock = [0] * pp, [0.0] * pp
    events: List[Event] = []
    while any(position[r] < len(order[r]) for r in range(pp)):
        progressed = False
        for rank in range(pp):
            while position[rank] < len(order[rank]):
                chunk, mb, kind = order[rank][position[rank]]
                stage = stage_of(rank, chunk, pp)
                if kind == "F":
                    needs = [("F", stage - 1, mb)] if stage > 0 else []
                else:
                    needs = [("F", stage, mb)] + ([("B", stage + 1, mb)] if stage < stages - 1 else [])
                if not all(need in done for need in needs):
                    break
                ready = max([clock[rank]] + [done[n][1] + (t_p2p if done[n][0] != rank else 0.0) for n in needs])
                end = ready + (t_forward[rank] if kind == "F" else t_backward[rank])
                assert (kind, stage, mb) not in done, f"rank {rank} runs {kind} of stage {stage}, mb {mb} twice"
                done[(kind, stage, mb)] = (rank, end)
                events.append((rank, kind, chunk, mb, ready, end))
                clock[rank] = end
                position[rank] += 1
                progressed = True
        waiting = [tuple(order[r][position[r]]) if position[r] < len(order[r]) else None for r in range(pp)]
        assert progressed, f"interleaved p={pp} v={virtual_stages} m={microbatches} deadlocks: ranks wait at {waiting}"
    return sorted(events, key=lambda e: (e[0], e[4]))


def idle_fraction(events: Sequence[Event]) -> float:
    """Share of rank-time spent idle between the first start and the last end (the bubble)."""
    ranks = {e[0] for e in events}
    span = max(e[5] for e in events) - min(e[4] for e in events)
    return 1.0 - sum(e[5] - e[4] for e in events) / (len(ranks) * span)


def peak_in_flight(order: Sequence[Pass]) -> int:
    """The most chunk-micro-batches whose forward has run and backward not yet, along one rank's
    order: each holds a chunk's activations (1/v of a stage's)."""
    held = most = 0
    for step in order:
        held += 1 if step.kind == "F" else -1
        most = max(most, held)
    return most


def activations_in_flight(rank: int, pp: int, virtual_stages: int, microbatches: int) -> float:
    """The activations rank `rank` holds at its fullest, in micro-batches of a whole stage (p - r
    under 1F1B): its warm-up plus the steady state's forward, each 1/v of a stage; rank 0 holds
    p + (p - 1)/v when v m > 2 (p - 1) + (v - 1) p (Narayanan et al. 2021, sec. 2.2.2: interleaving raises the
    warm-up's activation memory)."""
    total = virtual_stages * microbatches
    warmup = warmup_passes(rank, pp, virtual_stages, microbatches)
    return min(warmup + 1, total) / virtual_stages


def p2p_messages_per_step(pp: int, virtual_stages: int, microbatches: int) -> int:
    """Activation sends per step over the whole pipeline (as many gradient sends back): each
    micro-batch crosses v p - 1 stage boundaries, against p - 1 without interleaving; so v times
    the point-to-point traffic per rank, less the one boundary that is not crossed."""
    return microbatches * (virtual_stages * pp - 1)
