"""A hang watchdog (issue 35): no step completes within a bound, so every rank writes its threads'
Python stacks to a file, one line names the ranks that are not where the others are, and the job
ends, long before the collective timeout (train.dist_timeout_s) and with the evidence kept.

The heartbeats (launch/runtime/failure.py) find a rank that is gone or frozen. A hang keeps its
heartbeat: a rank sleeping or spinning inside its step, a deadlocked main thread that released
the GIL, a rank stuck in a collective while the others moved on to another, a hung kernel. All of
them show as a step that does not end.

The bound: train.hang_timeout_s, or when 0, HANG_FACTOR x the median interval between step ends
(the first one left out: it holds compilation and the data's start), at least HANG_FLOOR_S. The
first step of each start gets train.first_step_timeout_s. Saves pause the clock (a checkpoint of a
large model may take minutes); evaluation counts as part of its step's interval.

What happens at the bound, driven by each rank's failure-watcher thread (it already polls the
store every second, and runs while the main thread waits):
1. the rank writes faulthandler's dump of all its threads to STACKS_DIR/rank-RRRRR.txt, and where
   its main thread is (the collective it waits in and the line of ours that called it, or the
   line of ours it is at) under a store key;
2. rank 0 (or, if rank 0 publishes nothing within 2 x GATHER_S, the first other rank to claim
   it) gathers the positions for up to GATHER_S, names the ranks that are not where the others
   are (ranks outside any collective first: the others wait for them) and publishes one line
   through the failure protocol, after which every rank exits 1 with it.
Test hook: GPT3D_FAULT_INJECT="RANK:STEP:hang" makes that rank sleep forever before that step."""
from __future__ import annotations

import contextlib
import faulthandler
import os
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional

from launch.checkpoints.locate import HANG_STACKS
from launch.errors import our_file

HANG_FACTOR, HANG_FLOOR_S = 10.0, 120.0
GATHER_S = 10.0  # how long the composer waits for every rank's position
_POSITION, _REPORTED, _COMPOSER = "gpt3d/hang/position/", "gpt3d/hang/reported", "gpt3d/hang/composer"
_NAMED_AT_MOST = 8  # ranks named in the line; the stacks files hold the rest


class HangWatchdog:
    """The main thread calls `start()` before the first step, `step_ended()` after each, and wraps
    saves in `paused()`; the failure watcher's thread calls `poll(store)` every second."""

    def __init__(self, rank: int, world_size: int, stacks_dir: Path, hang_timeout_s: float,
                 first_step_timeout_s: float):
        self.rank, self.world_size, self.stacks_dir = rank, world_size, Path(stacks_dir)
        self.fixed_bound_s, self.first_step_timeout_s = hang_timeout_s, first_step_timeout_s
        self.intervals: List[float] = []  # seconds between step ends, saves left out
        self._since: Optional[float] = None  # when the clock (re)started; None: not timing
        self._paused_s = 0.0
        self._lock = threading.Lock()
        self.reported_at: Optional[float] = None  # when this rank wrote its stacks
        self.elapsed_s = self.bound_used_s = 0.0  # at that time: the step's seconds, and its bound

    def start(self) -> None:
        with self._lock:
            self._since, self._paused_s = time.monotonic(), 0.0

    def step_ended(self) -> None:
        with self._lock:
            now = time.monotonic()
            if self._since is not None:
                self.intervals.append(now - self._since - self._paused_s)
            self._since, self._paused_s = now, 0.0

    def finished(self) -> None:
        """The last step ended: what follows (the final save, wandb's upload) is not timed."""
        with self._lock:
            self._since = None

    @contextlib.contextmanager
    def paused(self):
        began = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._paused_s += time.monotonic() - began

    def bound_s(self) -> float:
        """The longest the current step may take."""
        if len(self.intervals) < 1:
            return self.first_step_timeout_s
        if self.fixed_bound_s > 0:
            return self.fixed_bound_s
        later = self.intervals[1:]  # the first holds compilation and the data's start
        if not later:
            return self.first_step_timeout_s
        return max(HANG_FLOOR_S, HANG_FACTOR * statistics.median(later))

    def overdue_s(self, now: float) -> Optional[float]:
        """Seconds the current step has run, if past its bound (a save in progress not counted)."""
        with self._lock:
            if self._since is None or self.reported_at is not None:
                return None
            elapsed = now - self._since - self._paused_s
        return elapsed if elapsed > self.bound_s() else None

    def poll(self, store, publish) -> None:
        """From the watcher thread: past the bound, report this rank's stacks and position; the
        composer then publishes the line with `publish(line)` (the failure protocol: never returns)."""
        now = time.monotonic()
        overdue = self.overdue_s(now)
        if overdue is not None:
            self.reported_at = now
            self._report(store, overdue)
        if self.reported_at is None:
            return
        waited = now - self.reported_at
        if self.rank == 0:
            if waited > GATHER_S or int(store.add(_REPORTED, 0)) >= self.world_size:
                publish(self._line(store))
        elif waited > 2 * GATHER_S:  # rank 0 published nothing: its watcher may be what cannot run
            # One rank claims the line (one request each, where every rank reading every position
            # each second would be world^2 requests).
            if store.compare_set(_COMPOSER, "", str(self.rank)).decode() == str(self.rank):
                publish(self._line(store))

    def _line(self, store) -> str:
        return hang_line(self._positions(store), self.world_size, self.elapsed_s, self.bound_used_s, self.stacks_dir)

    def _report(self, store, overdue_s: float) -> None:
        self.elapsed_s, self.bound_used_s = overdue_s, self.bound_s()
        self.stacks_dir.mkdir(parents=True, exist_ok=True)
        with open(self.stacks_dir / f"rank-{self.rank:05d}.txt", "w") as f:
            f.write(f"rank {self.rank}, pid {os.getpid()}: no step ended for {overdue_s:.0f} s "
                    f"(bound {self.bound_used_s:.0f} s); every thread's Python stack, innermost call first:\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        store.set(_POSITION + str(self.rank), main_thread_position())
        store.add(_REPORTED, 1)

    def _positions(self, store) -> Dict[int, str]:
        """rank -> position, for the ranks that reported."""
        keys = [_POSITION + str(r) for r in range(self.world_size)]
        present = [r for r, key in enumerate(keys) if store.check([key])]
        values = store.multi_get([keys[r] for r in present]) if present else []
        return {r: v.decode() for r, v in zip(present, values)}


def stacks_dir(save: Optional[Path], metrics_out: Optional[Path]) -> Path:
    """Beside the run: DIR/hang-stacks with --save DIR, else beside --metrics-out, else ./hang-stacks."""
    if save is not None:
        return Path(save) / HANG_STACKS
    return (Path(metrics_out).parent if metrics_out is not None else Path.cwd()) / HANG_STACKS


def main_thread_position() -> str:
    """Where the main thread is: "in torch.distributed.NAME (from FILE:LINE)" inside a collective or
    a point-to-point call, else "at FILE:LINE in FUNCTION" (our innermost frame, else the innermost)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    stack = []
    while frame is not None:  # innermost first
        stack.append(frame)
        frame = frame.f_back
    ours = [f for f in stack if our_file(f.f_code.co_filename) is not None]
    caller = f" (from {_where(ours[0])})" if ours else ""
    for f in stack:
        if "/torch/distributed/" in f.f_code.co_filename and f.f_code.co_name != "wrapper":
            return f"in torch.distributed.{f.f_code.co_name}{caller}"
    innermost = (ours or stack)[0] if stack else None
    return f"at {_where(innermost)} in {innermost.f_code.co_name}" if innermost is not None else "unknown"


def _where(frame) -> str:
    return f"{our_file(frame.f_code.co_filename) or frame.f_code.co_filename}:{frame.f_lineno}"


def hang_line(positions: Dict[int, str], world_size: int, elapsed_s: float, bound_s: float, stacks_dir: Path) -> str:
    """The published cause, "rank Q: hang: ..." (or "every rank: hang: ..." when no rank stands out):
    the ranks not where the others are, named with their positions."""
    silent = [r for r in range(world_size) if r not in positions]
    by_position = Counter(positions.values())
    in_collective = {p for p in by_position if p.startswith("in torch.distributed.")}
    if in_collective and len(in_collective) < len(by_position):
        # Some ranks wait in a collective, others are outside any: the latter hold the others up.
        common = max(in_collective, key=lambda p: by_position[p])
        odd = sorted(r for r, p in positions.items() if p not in in_collective)
    else:
        common = max(by_position, key=lambda p: by_position[p]) if by_position else None
        odd = sorted(r for r, p in positions.items() if p != common)
    odd_named = [f"rank {r} {positions[r]}" for r in odd[:_NAMED_AT_MOST]]
    if len(odd) > _NAMED_AT_MOST:
        odd_named.append(f"{len(odd) - _NAMED_AT_MOST} more ranks elsewhere")
    if silent:
        odd_named.append(f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent[:_NAMED_AT_MOST]))} "
                         f"gave no position (a main thread holding the interpreter lock, or a lost watcher)")
    others = sum(1 for p in positions.values() if p == common)
    head = f"rank {(odd or silent)[0]}" if odd or silent else "every rank"
    where = (f"{'; '.join(odd_named)}, while {others} other rank{'s wait' if others != 1 else ' waits'} {common}"
             if odd_named else f"all {world_size} ranks wait {common}: a hung collective, kernel or network")
    return (f"{head}: hang: no step ended for {elapsed_s:.0f} s (bound {bound_s:.0f} s, train.hang_timeout_s / "
            f"train.first_step_timeout_s); {where}; every rank's stacks are in {stacks_dir}/rank-*.txt")
