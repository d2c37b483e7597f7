"""Each rank's compute seconds per step, for naming stragglers: the time inside its pipeline
passes (forward, backward, ZB-H1's B and W), not the time it waits on its peers in sends,
receives and gradient reductions, which are instructions of their own. A slow GPU, a throttled
host or a noisy neighbour shows up on its own rank; its pipeline neighbours only wait longer
between passes. (TP peers of a slow rank wait inside the pass, in its all-reduces, and look as
slow: docs/resilience.md, "Stragglers".)

On an accelerator the passes are timed by device events, read once after the step's
synchronisation, so timing adds no synchronisation of its own; on CPU by the host clock.
Test hook: GPT3D_SLOW_INJECT="RANK:SECONDS" makes that rank's first pass of every step take
SECONDS longer (a stand-in for a slow device)."""
from __future__ import annotations

import functools
import os
import time
from typing import TYPE_CHECKING, Callable, List, Optional, Tuple

from launch.errors import ConfigError

if TYPE_CHECKING:
    from deepspeed.runtime.pipe.engine import PipelineEngine

SLOW_ENV = "GPT3D_SLOW_INJECT"


def slow_injection() -> Optional[Tuple[int, float]]:
    """(rank, seconds) from GPT3D_SLOW_INJECT, None when unset; a ConfigError when malformed."""
    value = os.environ.get(SLOW_ENV)
    if not value:
        return None
    try:
        rank, seconds = value.split(":")
        return int(rank), float(seconds)
    except ValueError:
        raise ConfigError(f"{SLOW_ENV}={value!r} must be RANK:SECONDS (a test hook, e.g. 1:0.5)") from None


class ComputeClock:
    def __init__(self, device_events: bool, slowdown_s: float = 0.0):
        self.device_events, self.slowdown_s = device_events, slowdown_s
        self.host_s = 0.0
        self.events: List[tuple] = []  # (start, end) device events of this step's passes
        self.slowed = False

    def timed(self, handler: Callable) -> Callable:
        """`handler` (an unbound pass handler of the engine's instruction map) with a timer."""
        from deepspeed.accelerator import get_accelerator

        @functools.wraps(handler)
        def run(engine: PipelineEngine, **kwargs) -> None:
            if self.device_events:
                start, end = get_accelerator().Event(enable_timing=True), get_accelerator().Event(enable_timing=True)
                start.record()
            else:
                begin = time.perf_counter()
            if self.slowdown_s and not self.slowed:
                self.slowed = True
                time.sleep(self.slowdown_s)
            handler(engine, **kwargs)
            if self.device_events:
                end.record()
                self.events.append((start, end))
            else:
                self.host_s += time.perf_counter() - begin
        return run

    def start_step(self) -> None:
        """Forget passes timed since the last step (evaluation runs the same forward handler)."""
        self.host_s, self.events, self.slowed = 0.0, [], False

    def take(self) -> float:
        """This step's compute seconds; call after the step's device sync."""
        seconds = self.host_s + sum(start.elapsed_time(end) for start, end in self.events) / 1000  # ms
        self.start_step()
        return seconds


def install_compute_clock(engine: PipelineEngine, rank: int) -> ComputeClock:
    """Time the pass handlers of `engine` (this engine's instruction map only, as the timeline
    does: launch/instruments/timeline.py)."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.pipe import schedule

    from launch.analysis.zero_bubble_schedule import BackwardInputPass, WeightPass
    slow = slow_injection()
    clock = ComputeClock(get_accelerator().device_name() != "cpu",
                         slow[1] if slow is not None and slow[0] == rank else 0.0)
    handlers = dict(engine._INSTRUCTION_MAP)
    for instruction in (schedule.ForwardPass, schedule.BackwardPass, BackwardInputPass, WeightPass):
        if instruction in handlers:
            handlers[instruction] = clock.timed(handlers[instruction])
    engine._INSTRUCTION_MAP = handlers
    return clock
