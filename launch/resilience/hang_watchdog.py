"""A hang watchdog: when the run stops making progress, every rank writes its threads' Python stacks
(and torch's flight recorder of its collectives) to files, one line names the ranks that are not
where the others are, and the job ends, long before the collective timeout (train.dist_timeout_s).

The heartbeats (launch/resilience/failure.py) find a rank that is gone or frozen. A hang keeps its
heartbeat: a rank sleeping or spinning inside its step, a deadlocked main thread that released
the GIL, a rank stuck in a collective while the others moved on to another, a hung kernel.

Progress is not only a step ending. Each long phase of a run has its own rule (docs/resilience.md,
"A hung step"), because a real run has 10-minute saves, 30-minute evaluations and storage stalls:
- a step: train.hang_timeout_s, or when 0, HANG_FACTOR x the median of the last WINDOW step
  intervals (data waits left out), at least HANG_FLOOR_S; the first step of each start gets
  train.first_step_timeout_s (it compiles and starts the data);
- a save: train.save_timeout_s (0: none of its own; its collectives still end at dist_timeout_s);
- a data wait (a draw of the step's micro-batches): data.stall_timeout_s, and its line names what
  the data is reading; its time is not the step's;
- validation, evaluation tasks, a checkpoint load: progress batch by batch (or file by file), each
  within the step bound (the first within the first-step bound: it may compile or open data).
A rank in a save or a data wait that runs past half the step bound tells the others through the
store (EXCUSED): their steps wait for it, so they report only when it does.

At a bound, driven by each rank's failure-watcher thread (it polls the store every second and
runs while the main thread waits):
1. the rank writes faulthandler's dump of all its threads to STACKS_DIR/rank-RRRRR.txt, its flight
   recorder to STACKS_DIR/flight-recorder/rank_R, and its cause and where its main thread is (the
   collective it waits in and the line of ours that called it, or the line of ours it is at) under
   a store key; a rank that finds another has reported reports too;
2. rank 0 (or, if rank 0 publishes nothing within 2 x GATHER_S, the first other rank to claim it)
   gathers the positions for up to GATHER_S, names the ranks not where the others are, with the
   named rank's own cause (launch/resilience/hang_line.py), and publishes the line through the failure
   protocol, after which every rank exits 1 with it.
Every time is read from one clock (launch/resilience/clock.py), so a test runs a simulated day.
Test hook: GPT3D_FAULT_INJECT="RANK:STEP:hang" makes that rank sleep forever before that step."""
from __future__ import annotations

import contextlib
import faulthandler
import os
import statistics
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional

from launch.resilience.clock import MONOTONIC, Clock
from launch.resilience.hang_line import hang_line, main_thread_position

HANG_FACTOR, HANG_FLOOR_S = 10.0, 120.0
WINDOW = 256
"""Step intervals the median is taken over, the most recent: the bound follows the run's current
speed, and a poll's work does not grow with the run's length."""
GATHER_S = 10.0  # how long the composer waits for every rank's position
EXCUSE_AFTER = 0.5  # of the step bound: a save or data wait this long tells the other ranks
_POSITION, _REPORTED, _COMPOSER, _EXCUSED = ("gpt3d/hang/position/", "gpt3d/hang/reported", "gpt3d/hang/composer",
                                             "gpt3d/hang/excused")
FLIGHT_RECORDER = "flight-recorder"  # torch's analyzer reads it: python -m torch.distributed.flight_recorder.fr_trace
PROGRESS_PHASES = {"validation": "validation", "tasks": "evaluation (eval.tasks)", "load": "the checkpoint load"}
"""Phases timed batch by batch (`progress()`), with what the line calls them."""


@dataclass
class _Phase:
    kind: str  # "save", "data" or one of PROGRESS_PHASES
    began: float
    progressed: float  # the last `progress()`, for the progress phases
    ticks: int = 0


@dataclass
class _Overrun:
    """The current phase past its bound."""
    cause: str  # "no step ended for 130 s (bound 120 s, train.hang_timeout_s / ...)"
    waits_for_peers: bool  # a step or a progress phase: may be waiting for another rank's save or data


class HangWatchdog:
    """The main thread calls `start()` before the first timed work, `step_ended()` after each step,
    wraps saves, data draws, validation, evaluation and loads in `phase(kind)` (and calls
    `progress()` after each batch of a progress phase); the failure watcher's thread calls
    `poll(store, publish)` every second."""

    def __init__(self, rank: int, world_size: int, stacks_dir: Path, hang_timeout_s: float,
                 first_step_timeout_s: float, save_timeout_s: float = 0.0, stall_timeout_s: float = 0.0,
                 clock: Clock = MONOTONIC, reading_now: Callable[[], List[str]] = list):
        self.rank, self.world_size, self.stacks_dir = rank, world_size, Path(stacks_dir)
        self.fixed_bound_s, self.first_step_timeout_s = hang_timeout_s, first_step_timeout_s
        self.save_timeout_s, self.stall_timeout_s = save_timeout_s, stall_timeout_s
        self.clock, self.reading_now = clock, reading_now
        self.intervals: deque = deque(maxlen=WINDOW)  # seconds of recent steps, data waits left out
        self._median: Optional[float] = None  # of `intervals`, kept at each step's end: a poll reads it
        self._steps_ended = 0  # since the last start()
        self._since: Optional[float] = None  # when the current step's time began; None: not timing
        self._credited_s = 0.0  # the current step's time in data waits (not the step's)
        self._phase: Optional[_Phase] = None
        self._lock = threading.Lock()
        # The watcher thread's own state:
        self._excusing = False  # this rank counts in the store's EXCUSED
        self._waited_for_peers = False  # overran while another rank excused itself
        self.reported_at: Optional[float] = None  # when this rank wrote its stacks

    # The main thread's side.

    def start(self) -> None:
        with self._lock:
            self._since, self._credited_s, self._steps_ended = self.clock.now(), 0.0, 0

    def step_ended(self) -> None:
        with self._lock:
            now = self.clock.now()
            if self._since is not None and self._steps_ended:  # the first compiles and starts the data
                self.intervals.append(now - self._since - self._credited_s)
                self._median = statistics.median(self.intervals)  # WINDOW values: microseconds
            self._steps_ended += 1
            self._since, self._credited_s = now, 0.0

    def finished(self) -> None:
        """The last step ended: what follows (the final save, wandb's upload) is not timed."""
        with self._lock:
            self._since = None

    @contextlib.contextmanager
    def phase(self, kind: str):
        """A save, a data wait ("data", inside a step) or a progress phase: timed by its own rule.
        After a phase other than a data wait, the next step's time starts."""
        with self._lock:
            now = self.clock.now()
            outer, self._phase = self._phase, _Phase(kind, now, now)
        try:
            yield
        finally:
            with self._lock:
                now = self.clock.now()
                if kind == "data":
                    self._credited_s += now - self._phase.began
                elif self._since is not None:
                    self._since, self._credited_s = now, 0.0
                self._phase = outer

    def progress(self) -> None:
        """A batch (or file) of the current progress phase is done."""
        with self._lock:
            if self._phase is not None:
                self._phase.progressed, self._phase.ticks = self.clock.now(), self._phase.ticks + 1

    def timed_draws(self, items: Iterator) -> Iterator:
        """`items`, each draw a data wait (a stall gets data.stall_timeout_s, not the step's bound)."""
        while True:
            with self.phase("data"):
                try:
                    item = next(items)
                except StopIteration:
                    return
            yield item

    # Bounds.

    def bound_s(self) -> float:
        """The longest the current step may take."""
        if not self._steps_ended:
            return self.first_step_timeout_s
        if self.fixed_bound_s > 0:
            return self.fixed_bound_s
        if self._median is None:  # one step ended: it compiled
            return self.first_step_timeout_s
        return max(HANG_FLOOR_S, HANG_FACTOR * self._median)

    def _elapsed_and_bound(self, now: float):
        """(kind, seconds, bound or None) of what runs now, under the lock; None when not timing."""
        p = self._phase
        if self._since is None:
            return None
        if p is None:
            return "step", now - self._since - self._credited_s, self.bound_s()
        if p.kind == "save":
            return "save", now - p.began, self.save_timeout_s or None
        if p.kind == "data":
            return "data", now - p.began, self.stall_timeout_s or None
        return p.kind, now - p.progressed, self.bound_s() if p.ticks else self.first_step_timeout_s

    def overrun(self, now: float) -> Optional[_Overrun]:
        """What runs now, if past its bound."""
        with self._lock:
            timed = self._elapsed_and_bound(now)
        if timed is None or timed[2] is None or timed[1] <= timed[2]:
            return None
        kind, elapsed, bound = timed
        if kind == "step":
            return _Overrun(f"no step ended for {elapsed:.0f} s (bound {bound:.0f} s, train.hang_timeout_s / "
                            f"train.first_step_timeout_s)", True)
        if kind == "save":
            return _Overrun(f"a save ran for {elapsed:.0f} s (bound {bound:.0f} s, train.save_timeout_s)", False)
        if kind == "data":
            reading = self.reading_now()
            return _Overrun(f"waited {elapsed:.0f} s for data (bound {bound:.0f} s, data.stall_timeout_s); "
                            + (f"reading {'; '.join(reading)}" if reading else "reading nothing (the wait is on "
                               "another rank of the replica, or before any read)"), False)
        return _Overrun(f"{PROGRESS_PHASES[kind]} made no progress for {elapsed:.0f} s (bound {bound:.0f} s, a "
                        f"batch within the step's bound, train.hang_timeout_s / train.first_step_timeout_s)", True)

    def _excuses_peers(self, now: float) -> bool:
        """A save or data wait past EXCUSE_AFTER x the step bound: the other ranks wait for it."""
        with self._lock:
            timed = self._elapsed_and_bound(now)
            return timed is not None and timed[0] in ("save", "data") and timed[1] > EXCUSE_AFTER * self.bound_s()

    # The watcher thread's side.

    def poll(self, store, publish: Callable[[str], None]) -> None:
        """From the watcher thread: past a bound, report this rank's stacks and position; the
        composer then publishes the line with `publish(line)` (the failure protocol: never returns)."""
        now = self.clock.now()
        if self.reported_at is None:
            overrun = self.overrun(now)
            excusing = overrun is None and self._excuses_peers(now)
            if excusing != self._excusing:
                store.add(_EXCUSED, 1 if excusing else -1)
                self._excusing = excusing
            if overrun is None:
                self._waited_for_peers = False
                return
            if overrun.waits_for_peers and not int(store.add(_REPORTED, 0)):
                if int(store.add(_EXCUSED, 0)) > 0:  # another rank's save or data wait holds this step
                    self._waited_for_peers = True
                    return
                if self._waited_for_peers:  # it just ended: from here this step has its bound again
                    self._waited_for_peers = False
                    self._restart(now)
                    return
            if self._excusing:
                store.add(_EXCUSED, -1)
                self._excusing = False
            self.reported_at = now
            self._report(store, overrun.cause)
        waited = now - self.reported_at
        if self.rank == 0:
            if waited > GATHER_S or int(store.add(_REPORTED, 0)) >= self.world_size:
                publish(self._line(store))
        elif waited > 2 * GATHER_S:  # rank 0 published nothing: its watcher may be what cannot run
            # One rank claims the line (one request each, where every rank reading every position
            # each second would be world^2 requests).
            if store.compare_set(_COMPOSER, "", str(self.rank)).decode() == str(self.rank):
                publish(self._line(store))

    def _restart(self, now: float) -> None:
        with self._lock:
            if self._phase is not None:
                self._phase.progressed = now
            elif self._since is not None:
                self._since, self._credited_s = now, 0.0

    def _line(self, store) -> str:
        causes, positions = {}, {}
        for rank, value in self._reports(store).items():
            causes[rank], positions[rank] = value.split("\n", 1)
        return hang_line(positions, self.world_size, causes, self.stacks_dir)

    def _report(self, store, cause: str) -> None:
        self.stacks_dir.mkdir(parents=True, exist_ok=True)
        with open(self.stacks_dir / f"rank-{self.rank:05d}.txt", "w") as f:
            f.write(f"rank {self.rank}, pid {os.getpid()}: {cause}; every thread's Python stack, innermost "
                    f"call first:\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        dump_flight_recorder(self.stacks_dir / FLIGHT_RECORDER, self.rank)
        store.set(_POSITION + str(self.rank), f"{cause}\n{self.position()}")
        store.add(_REPORTED, 1)

    def position(self) -> str:
        """Where this process's main thread is (launch/resilience/hang_line.py)."""
        return main_thread_position()

    def _reports(self, store) -> Dict[int, str]:
        """rank -> "cause\\nposition", for the ranks that reported."""
        keys = [_POSITION + str(r) for r in range(self.world_size)]
        present = [r for r, key in enumerate(keys) if store.check([key])]
        values = store.multi_get([keys[r] for r in present]) if present else []
        return {r: v.decode() for r, v in zip(present, values)}


def dump_flight_recorder(directory: Path, rank: int) -> Optional[Path]:
    """torch's flight recorder of this process's collectives (which each rank entered, and which
    completed: on NCCL a hang surfaces in a later synchronize, so Python frames do not say which
    collective hung) to DIRECTORY/rank_RANK; None when the recorder is off or this torch has none."""
    if not int(os.environ.get("TORCH_FR_BUFFER_SIZE", os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0")) or 0):
        return None
    import torch._C._distributed_c10d as c10d
    dump = getattr(c10d, "_dump_fr_trace", None) or getattr(c10d, "_dump_nccl_trace", None)  # torch < 2.8
    if dump is None:
        return None
    try:
        trace = dump()
    except RuntimeError:  # a build without the recorder for this backend
        return None
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"rank_{rank}"
    path.write_bytes(trace)
    return path
