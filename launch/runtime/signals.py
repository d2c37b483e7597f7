"""SIGTERM / SIGINT: finish the current step, save, exit 0; a step that has not ended in time (a
peer frozen or gone) exits without a save; a later, separate signal exits at once.

Ranks receive signals at different times, or not at all (DeepSpeed's launcher forwards a
SIGTERM to its children one after the other; SLURM signals every task). So each step the
ranks agree on their flags: each rank's rides in the step's one all-gather of per-rank numbers
(launch/instruments/stragglers.py: gather_step_numbers, issue 39: no collective of its own), and
if any rank was signalled, all stop after the same step and save together.

What "in time" and "separate" mean (issue 35: a stop request must not lose a save):
- Signals within SAME_REQUEST_S of the first are the same request: SLURM signals the launcher and
  every task at once, and the launcher forwards its own; neither is a second request.
- The rank waits for the step to end for max(train.stop_grace_s, 2 x the longest step so far,
  evaluation included, the first step left out: it holds compilation and the data's start): a
  healthy step longer than the grace still ends and saves. The clock
  restarts when a step ends, and stops while a save runs (`saving`), so a signal during a
  periodic save lets that save finish.

A Python signal handler runs only when the main thread runs Python code, never while it waits
in a collective. So the signals are taken by a thread instead: Python's C-level handler writes
each signal's number to a wakeup pipe (signal.set_wakeup_fd), which that thread reads.
"""
from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from typing import Optional, Tuple

from launch.runtime.failure import say_error

SIGNALS = (signal.SIGTERM, signal.SIGINT)
SAME_REQUEST_S = 2.0
"""Signals this soon after the first are part of the same stop request."""
STEP_MARGIN = 2.0
"""The wait for a step to end is at least this many times the longest step seen."""


def _parent_of(pid: int) -> Optional[int]:
    """The parent pid of process `pid` (Linux /proc), None if it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])  # the command may hold spaces and parentheses
    except (OSError, ValueError, IndexError):
        return None


def deepspeed_runner() -> Optional[Tuple[int, int]]:
    """(launcher pid, runner pid) when this rank was started by DeepSpeed's per-node launcher
    (deepspeed.launcher.launch, started by the `deepspeed` command); else None."""
    launcher = os.getppid()
    try:
        with open(f"/proc/{launcher}/cmdline", "rb") as f:
            started_by_deepspeed = b"deepspeed.launcher.launch" in f.read()
    except OSError:
        return None
    runner = _parent_of(launcher)
    return (launcher, runner) if started_by_deepspeed and runner is not None else None


def _watch_runner(rank: int, launcher: int, runner: int) -> None:
    """A SIGTERM to the `deepspeed` command on one machine ends only that command: it forwards
    nothing, and its launcher and the ranks run on (issue 35). So each rank checks once a second
    that the launcher's parent is still the runner, and stops as on SIGTERM when it is not."""
    while _parent_of(launcher) == runner:
        time.sleep(1.0)
    print(f"rank {rank}: the deepspeed command (pid {runner}) is gone; stopping as on SIGTERM", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)


def _nothing(signum, frame) -> None:
    """The Python-level handler: the listening thread acts; this only keeps the default action away."""


class StopRequest:
    """Create in the main thread (set_wakeup_fd must be called there), once per process. Each
    step the run gathers every rank's `signalled`, calls `agreed(any of them)` after the step (and
    evaluation), and saves inside `saving()`."""

    def __init__(self, rank: int, grace_s: float):
        self.rank, self.grace_s = rank, grace_s
        self.signalled = False
        self._step_ended = threading.Event()  # set once every rank agreed to stop after a step
        self._lock = threading.Lock()
        self._saving = False
        self._last_step_end = time.monotonic()
        self._longest_step_s = 0.0
        self._steps_ended = 0
        self._deadline = None  # while signalled: when the rank leaves without a save
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # the C handler must never block
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        for sig in SIGNALS:
            signal.signal(sig, _nothing)
        threading.Thread(target=self._listen, args=(read_fd,), name="gpt3d-stop-request", daemon=True).start()
        runner = deepspeed_runner()
        if runner is not None:
            threading.Thread(target=_watch_runner, args=(rank, *runner), name="gpt3d-runner-watch", daemon=True).start()

    @property
    def wait_s(self) -> float:
        """How long a signalled rank waits for the current step to end."""
        return max(self.grace_s, STEP_MARGIN * self._longest_step_s)

    def _listen(self, fd: int) -> None:
        first, first_at = None, None
        while True:
            with self._lock:
                wait = None if self._deadline is None else max(0.0, self._deadline - time.monotonic())
            if not select.select([fd], [], [], wait)[0]:  # the wait is over, unless a save or a step end moved it
                with self._lock:
                    if self._step_ended.is_set() or self._saving:  # the save is under way: it is not bounded here
                        self._deadline = None if self._step_ended.is_set() else time.monotonic() + self.wait_s
                        continue
                    if time.monotonic() < self._deadline:
                        continue
                say_error(f"the step did not end within {self.wait_s:g} s of the {first.name} (train.stop_grace_s="
                          f"{self.grace_s:g}, or twice the longest step); leaving without saving (the last complete "
                          f"checkpoint stays the resume point)", self.rank)
                os._exit(128 + first)
            signum = os.read(fd, 1)[0]
            if signum not in SIGNALS:  # another signal with a Python handler also writes here
                continue
            if self.signalled:
                if time.monotonic() - first_at < SAME_REQUEST_S:  # the same request, forwarded or repeated
                    continue
                os._exit(128 + signum)  # a second request: no checkpoint, no clean-up
            first, first_at = signal.Signals(signum), time.monotonic()
            with self._lock:
                self.signalled = True
                self._deadline = max(first_at, self._last_step_end) + self.wait_s
            print(f"rank {self.rank}: {first.name} received; saving after this step (without a save if it has "
                  f"not ended within {self.wait_s:g} s; send it again after {SAME_REQUEST_S:g} s to exit at once)",
                  flush=True)

    def agreed(self, any_rank_signalled: bool) -> bool:
        """After each step, with whether any rank was `signalled` when the step's numbers were
        gathered (the same on every rank): whether every rank stops now. Restarts the clock: the
        step ended. A signal after the gather is agreed on at the next step's."""
        stopping = bool(any_rank_signalled)
        with self._lock:
            now = time.monotonic()
            if self._steps_ended:  # the first step's time holds compilation and the data's start: not a step's
                self._longest_step_s = max(self._longest_step_s, now - self._last_step_end)
            self._steps_ended += 1
            self._last_step_end = now
            if self._deadline is not None:
                self._deadline = now + self.wait_s
        if stopping:
            self._step_ended.set()
        return stopping

    @contextlib.contextmanager
    def saving(self):
        """A save runs: no deadline meanwhile; the next step's time starts after it."""
        with self._lock:
            self._saving = True
        try:
            yield
        finally:
            with self._lock:
                self._saving = False
                self._last_step_end = time.monotonic()
                if self._deadline is not None:
                    self._deadline = self._last_step_end + self.wait_s
