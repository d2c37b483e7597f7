"""The measured pipeline: per-stage forward, backward (and ZB-H1's W) times of a few training steps,
drawn as launch/analysis/pipeline_chart.py's schedule chart, with the measured bubble next to
the one predicted by playing the same schedule with the measured mean pass times
(launch/analysis/schedule_sim.py) and to 1F1B's formula for equal stages.

`install_timeline_recorder(engine, ...)` wraps the DeepSpeed PipelineEngine's ForwardPass and
BackwardPass handlers, or ZB-H1's B and W passes (its `_INSTRUCTION_MAP`, which `_exec_schedule` looks up on the engine)
with a timer, on this engine only. `.draw(path, ...)` gathers the times and draws; every rank
must call it (it is a collective).

Clocks: each rank times with its own time.perf_counter, relative to its own step start. A barrier
right before each recorded step lets the ranks start it together, so the stages' times line up
to within the barrier's exit skew (microseconds on one host, more across nodes): an
approximation, no clock synchronisation.
"""
from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, List, Optional, Sequence

from launch.analysis import formulas
from launch.analysis.pipeline_chart import draw_schedule
from launch.analysis.schedule_sim import Event, idle_fraction, simulate_schedule

import matplotlib.pyplot as plt  # after pipeline_chart chose the file backend

if TYPE_CHECKING:  # annotations only: no import cost at run time
    from deepspeed.runtime.pipe.engine import PipelineEngine


def measured_bubble(steps: Sequence[Sequence[Event]]) -> float:
    """1 - (busy time summed over stages) / (stages * span), averaged over steps; the span runs
    from the first forward to the last backward, so the optimizer step after it is not bubble."""
    return sum(idle_fraction(events) for events in steps) / len(steps)


def mean_pass_times(steps: Sequence[Sequence[Event]], stages: int) -> List[List[float]]:
    """[forward, backward (B), weight (W)] seconds per stage, each the mean over the recorded
    passes (W 0 under 1F1B, whose B is the whole backward): the prediction's inputs."""
    times = []
    for kind in "FBW":
        per_stage = [[e[4] - e[3] for events in steps for e in events if e[0] == k and e[1] == kind]
                     for k in range(stages)]
        times.append([sum(d) / len(d) if d else 0.0 for d in per_stage])
    return times


def stage_busy_seconds(steps: Sequence[Sequence[Event]]) -> List[float]:
    """Each stage's forward + backward time in one step, averaged over steps: equal when the
    stages are balanced (launch/analysis/partition.py)."""
    pp = 1 + max(e[0] for events in steps for e in events)
    return [sum(e[4] - e[3] for events in steps for e in events if e[0] == k) / len(steps) for k in range(pp)]


class TimelineRecorder:
    """Times the forward and backward passes of `steps` training steps from `first_step` on."""

    def __init__(self, engine: PipelineEngine, first_step: int, steps: int, one_per_stage: bool):
        self.engine = engine
        self.first_step, self.last_step = first_step, first_step + steps - 1
        self.one_per_stage = one_per_stage  # this rank speaks for its stage in the chart
        self.steps: List[List[Event]] = []  # per recorded step: this stage's events
        self.step = 0
        self.recording = False
        self.step_start = 0.0
        self.count: dict = {}  # passes timed this step, per (kind, chunk)
        self.schedule = "1f1b"  # install_timeline_recorder says when the engine runs ZB-H1

    def timed(self, kind: str, handler: Callable) -> Callable:
        """`handler` (an unbound `_exec_forward_pass`, `_exec_backward_pass`, ...) with a timer."""
        from deepspeed.accelerator import get_accelerator

        @functools.wraps(handler)
        def run(engine: PipelineEngine, **kwargs) -> None:  # called as `_exec_schedule` does: (buffer_id=...)
            if not self.recording:
                return handler(engine, **kwargs)
            get_accelerator().synchronize()  # GPU kernels run asynchronously: time them, not their launch
            start = time.perf_counter()
            handler(engine, **kwargs)
            get_accelerator().synchronize()
            end = time.perf_counter()
            # Both schedules run the forwards, the backwards and the W passes each in micro-batch
            # order: the n-th of a kind is micro-batch n (of its chunk, interleaved: labelled chunk:n).
            chunk = kwargs.get("chunk")
            micro = self.count.get((kind, chunk), 0)
            self.count[(kind, chunk)] = micro + 1
            micro = micro if chunk is None else f"{chunk}:{micro}"
            self.steps[-1].append((engine.stage_id, kind, micro, start - self.step_start, end - self.step_start))
        return run

    def train_batch(self, original: Callable) -> Callable:
        """`engine.train_batch` that switches the timers on for the recorded steps only."""
        import torch.distributed as dist
        from deepspeed.accelerator import get_accelerator

        @functools.wraps(original)
        def run(*args, **kwargs):
            self.step += 1
            self.recording = self.first_step <= self.step <= self.last_step
            if self.recording:
                dist.barrier()  # the common step start of the clock approximation (module docstring)
                get_accelerator().synchronize()
                self.steps.append([])
                self.count = {}
                self.step_start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.recording = False
        return run

    def draw(self, path: Path, logging_rank: bool) -> Optional[float]:
        """Gather every stage's events (collective: all ranks call it); the logging rank draws
        the chart to `path`, prints the measured and predicted bubble and returns the measured one."""
        import torch.distributed as dist
        gathered: List[Optional[List[List[Event]]]] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self.steps if self.one_per_stage else None)
        if not logging_rank:
            return None
        if not self.steps:  # e.g. a resumed run with fewer steps left than the warm-up
            print(f"timeline: no step recorded (steps {self.first_step}-{self.last_step} never ran); "
                  f"no chart written", flush=True)
            return None
        per_rank = [steps for steps in gathered if steps is not None]
        steps = [sorted(sum((r[i] for r in per_rank), []), key=lambda e: (e[0], e[3]))
                 for i in range(len(self.steps))]
        p, m = self.engine.num_stages, self.engine.micro_batches
        measured = measured_bubble(steps)
        passes = mean_pass_times(steps, p)
        v = getattr(getattr(self.engine, "module", None), "virtual_stages", 1)
        if v > 1:  # each pass one chunk's: launch/analysis/interleaved_schedule.py plays the order
            from launch.analysis.interleaved_schedule import idle_fraction as interleaved_idle, simulate_interleaved
            predicted = interleaved_idle(simulate_interleaved(p, v, m, passes[0], passes[1]))
        else:
            predicted = idle_fraction(simulate_schedule(self.schedule, p, m, *passes))
        numbers = (f"{self.schedule} bubble measured {measured:.1%} (mean of steps {self.first_step}-"
                   f"{self.first_step + len(steps) - 1}) vs predicted {predicted:.1%} from the measured "
                   f"pass times; (p-1)/(m+p-1) = {formulas.bubble_fraction(p, m):.1%} with p={p}, m={m}"
                   + (f", (p-1)/(vm+p-1) = {formulas.interleaved_bubble_fraction(p, m, v):.1%} with v={v}"
                      if v > 1 else ""))
        busy = stage_busy_seconds(steps)
        busy_text = (", ".join(f"stage {k} {seconds:.3f} s" for k, seconds in enumerate(busy))
                     + f" (slowest / fastest {max(busy) / min(busy):.2f})")
        fig, axes = plt.subplots(len(steps), 1, squeeze=False, figsize=(12, len(steps) * (1.2 + 0.5 * p)))
        for i, (ax, events) in enumerate(zip(axes[:, 0], steps)):
            draw_schedule(ax, events, f"step {self.first_step + i}: bubble {idle_fraction(events):.1%}")
        fig.suptitle(f"measured schedule: {numbers}", fontsize=10)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        pass_text = ", ".join("/".join(f"{kind[k] * 1e3:.1f}" for kind in passes) for k in range(p))
        print(f"timeline: {numbers}; busy per step: {busy_text}; mean pass ms F/B/W per stage: {pass_text}; "
              f"chart in {path}", flush=True)
        return measured


def install_timeline_recorder(engine: PipelineEngine, steps: int, total_steps: int, one_per_stage: bool) -> TimelineRecorder:
    """Time `steps` steps of `engine` (a PipelineEngine) after one warm-up step (none when the
    run has a single step). `one_per_stage`: this rank is the one whose times stand for its
    stage (the first TP and DP coordinate); every rank times, so all see the same barriers."""
    from deepspeed.runtime.pipe import schedule

    from launch.analysis.zero_bubble_schedule import BackwardInputPass, WeightPass
    first_step = 2 if total_steps > 1 else 1
    recorder = TimelineRecorder(engine, first_step, steps, one_per_stage)
    handlers = dict(engine._INSTRUCTION_MAP)  # the engine's own: ZB-H1's passes included when installed
    for instruction, kind in [(schedule.ForwardPass, "F"), (schedule.BackwardPass, "B"),
                              (BackwardInputPass, "B"), (WeightPass, "W")]:
        if instruction in handlers:
            handlers[instruction] = recorder.timed(kind, handlers[instruction])
    recorder.schedule = "zb-h1" if WeightPass in handlers else "1f1b"
    chunks = getattr(getattr(engine, "module", None), "virtual_stages", 1)
    if chunks > 1:  # launch/engine/interleaved.py: F and B per chunk
        recorder.schedule = f"interleaved-v{chunks}"
    engine._INSTRUCTION_MAP = handlers  # an instance attribute: other engines keep the class's map
    engine.train_batch = recorder.train_batch(engine.train_batch)
    return recorder
