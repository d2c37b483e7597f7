"""SIGTERM / SIGINT: finish the current step, save, exit 0; a step that has not ended in time (a
peer frozen or gone) exits without a save; a later, separate signal exits at once, except during a
save, which it never cuts short.

Ranks receive signals at different times, or not at all (DeepSpeed's launcher forwards a
SIGTERM to its children one after the other; SLURM signals every task). So each step the
ranks agree on their flags: each rank's rides in the step's one all-gather of per-rank numbers
(launch/instruments/stragglers.py: gather_step_numbers, no collective of its own), and if any rank
was signalled, all stop after the same step and save together.

What "in time" and "separate" mean (a stop request must not lose a save):
- Signals within SAME_REQUEST_S of the first are the same request: SLURM signals the launcher and
  every task at once, and the launcher forwards its own; neither is a second request.
- The rank waits for the step to end for max(train.stop_grace_s, 2 x the longest step so far,
  evaluation included, the first step left out: it holds compilation and the data's start): a
  healthy step longer than the grace still ends and saves. The clock restarts when a step ends,
  and stops while a save runs (`saving`), so a signal during a periodic save lets that save finish.
- A later request leaves at once, but not in the middle of a save: SLURM signals a job's tasks at
  its time limit and kills them KillWait (30 s by default) later, so the limit's SIGTERM often
  lands in the save that an earlier warning (`--signal`) started, and leaving then would lose that
  save and leave the last one as the resume point. So during a save the request is noted in one
  line and the rank leaves as soon as the save is committed (`saved`): exit 0 when it was the
  stop's own save (every rank agreed to stop after this step, so each leaves with a checkpoint of
  it, as a stop does, only without the run's final barrier and wandb's finish), else 128+signum
  (a periodic save before any agreement: this rank leaves alone, and a peer that got no second
  signal then fails on its absence, with a line).

After each save the logging rank says how long a stop needs: the longest step so far plus that
save (`saved_line`), the least warning a scheduler should give before its kill. An asynchronous
save (train.async_save) holds the step loop only until it returns, but its background copies and
write, which the end of the run waits for inside `saving`, still count toward the warning.

The deadline logic reads a Clock (launch/resilience/clock.py) in StopTimes, so that a test drives
days of steps and saves with a simulated clock; the listening thread only waits on its pipe until
StopTimes' deadline, or until a step or save end moves it (`_nudge`).

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
from pathlib import Path
from typing import Callable, Optional, Tuple

from launch.checkpoints.commit_guard import exit_after_commit
from launch.resilience.clock import MONOTONIC, Clock
from launch.resilience.failure import say_error

SIGNALS = (signal.SIGTERM, signal.SIGINT)
SAME_REQUEST_S = 2.0
"""Signals this soon after the first are part of the same stop request."""
STEP_MARGIN = 2.0
"""The wait for a step to end is at least this many times the longest step seen."""
_NUDGE = b"\0"  # not a signal number: wakes the listening thread to read the deadline again


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
    """A SIGTERM to the `deepspeed` command on one machine ends only that command: it installs no
    handler there (deepspeed/launcher/runner.py forwards signals only to a multi-node pdsh), and its
    launcher and the ranks run on. So each rank checks once a second that the launcher's parent is
    still the runner, and stops as on SIGTERM when it is not."""
    while _parent_of(launcher) == runner:
        time.sleep(1.0)
    print(f"rank {rank}: the deepspeed command (pid {runner}) is gone; stopping as on SIGTERM", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)


def _nothing(signum, frame) -> None:
    """The Python-level handler: the listening thread acts; this only keeps the default action away."""


def saved_line(path: Path, save_s: float, longest_step_s: float, write_s: Optional[float] = None,
               asynchronous: bool = False) -> str:
    """The logging rank's line after a save: how long it took, and the warning a stop needs. An
    asynchronous save (train.async_save) returned after `save_s`, but a stop still waits for its
    background copies and write, whose last measured time is `write_s` (None before the first)."""
    if not asynchronous:
        return (f"saved {path} in {save_s:.1f} s; a stop needs up to {longest_step_s + save_s:.1f} s (the longest "
                f"step {longest_step_s:.1f} s + this save): signal at least that long before the kill")
    need = (f"up to {longest_step_s + save_s + write_s:.1f} s (the longest step {longest_step_s:.1f} s + this save "
            f"+ the last background write, {write_s:.1f} s)" if write_s is not None else
            f"the longest step {longest_step_s:.1f} s + this save + its background write (not yet measured)")
    return (f"saved {path} in {save_s:.2f} s, copied and written in the background; a stop needs {need}: "
            f"signal at least that long before the kill")


class StopTimes:
    """When a signalled rank stops waiting for its step, and how long a stop takes. Driven by the
    run's events (`signalled`, `step_ended`, `save_started`, `save_ended`) and read by `clock`; not
    thread-safe (StopRequest calls it under its lock)."""

    def __init__(self, grace_s: float, clock: Clock = MONOTONIC):
        self.grace_s, self.clock = grace_s, clock
        self.signalled_at: Optional[float] = None  # the first signal of the request
        self.agreed = False  # every rank agreed to stop after the step that ended last
        self.saving_since: Optional[float] = None
        self.last_save_s: Optional[float] = None
        self._last_step_end = clock.now()  # or of the save after it: the current step's time starts there
        self._first_step_s: Optional[float] = None
        self._longest_step_s = 0.0  # the first step left out

    @property
    def wait_s(self) -> float:
        """How long a signalled rank waits for the current step to end."""
        return max(self.grace_s, STEP_MARGIN * self._longest_step_s)

    @property
    def longest_step_s(self) -> float:
        """The longest step so far, the first left out unless it is the only one (it holds the
        compilation and the data's start, which a stop after it does not wait for)."""
        return self._longest_step_s or (self._first_step_s or 0.0)

    def signalled(self) -> None:
        self.signalled_at = self.clock.now()

    def same_request(self) -> bool:
        """Whether a signal now belongs to the request that `signalled` began."""
        return self.clock.now() - self.signalled_at < SAME_REQUEST_S

    def step_ended(self, stopping: bool) -> None:
        now = self.clock.now()
        if self._first_step_s is None:
            self._first_step_s = now - self._last_step_end
        else:
            self._longest_step_s = max(self._longest_step_s, now - self._last_step_end)
        self._last_step_end = now
        self.agreed = self.agreed or stopping

    def save_started(self) -> None:
        self.saving_since = self.clock.now()

    def save_ended(self) -> None:
        now = self.clock.now()
        self.last_save_s, self.saving_since = now - self.saving_since, None
        self._last_step_end = now

    def seconds_left(self) -> Optional[float]:
        """How much longer a signalled rank waits for its step; None while nothing is timed: no
        request, a save under way (it is not bounded here), or every rank agreed to stop."""
        if self.signalled_at is None or self.saving_since is not None or self.agreed:
            return None
        deadline = max(self.signalled_at, self._last_step_end) + self.wait_s
        return max(0.0, deadline - self.clock.now())


class StopRequest:
    """Create in the main thread (set_wakeup_fd must be called there), once per process. Each
    step the run gathers every rank's `signalled`, calls `agreed(any of them)` after the step (and
    evaluation), saves inside `saving()` and calls `saved(path, ...)` after it."""

    def __init__(self, rank: int, grace_s: float, clock: Clock = MONOTONIC):
        self.rank = rank
        self.times = StopTimes(grace_s, clock)
        self.signalled = False
        self._lock = threading.Lock()
        self._first: Optional[signal.Signals] = None
        self._after_save: Optional[signal.Signals] = None  # a later request that came during a save
        read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)  # the C handler must never block
        signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        for sig in SIGNALS:
            signal.signal(sig, _nothing)
        threading.Thread(target=self._listen, args=(read_fd,), name="gpt3d-stop-request", daemon=True).start()
        runner = deepspeed_runner()
        if runner is not None:
            threading.Thread(target=_watch_runner, args=(rank, *runner), name="gpt3d-runner-watch", daemon=True).start()

    @property
    def grace_s(self) -> float:
        return self.times.grace_s

    @property
    def wait_s(self) -> float:
        """How long a signalled rank waits for the current step to end."""
        return self.times.wait_s

    def _listen(self, fd: int) -> None:
        while True:
            with self._lock:
                wait = self.times.seconds_left()
            if not select.select([fd], [], [], wait)[0]:
                with self._lock:
                    left, wait_s = self.times.seconds_left(), self.times.wait_s
                if left is None or left > 0:  # a step or a save ended meanwhile: the deadline moved
                    continue
                say_error(f"the step did not end within {wait_s:g} s of the {self._first.name} (train.stop_grace_s="
                          f"{self.grace_s:g}, or twice the longest step); leaving without saving (the last complete "
                          f"checkpoint stays the resume point)", self.rank)
                exit_after_commit(128 + self._first)
            signum = os.read(fd, 1)[0]
            if signum in SIGNALS:  # else a nudge, or another signal with a Python handler
                self._request(signal.Signals(signum))

    def _request(self, sig: signal.Signals) -> None:
        with self._lock:
            if not self.signalled:
                self._first, self.signalled = sig, True
                self.times.signalled()
                line = (f"rank {self.rank}: {sig.name} received; saving after this step (without a save if it has "
                        f"not ended within {self.times.wait_s:g} s; send it again after {SAME_REQUEST_S:g} s to exit "
                        f"at once)")
            elif self.times.same_request():  # the same request, forwarded or repeated
                return
            elif self.times.saving_since is not None:
                if self._after_save is not None:  # already noted
                    return
                self._after_save = sig
                line = (f"rank {self.rank}: {sig.name} again during a save: the save finishes first, then this rank "
                        f"leaves (exit {self._exit_code_after_save()})")
            else:
                exit_after_commit(128 + sig)  # a second request outside a save: no checkpoint, no clean-up
        print(line, flush=True)

    def _exit_code_after_save(self) -> int:
        """0 after the stop's own save (every rank agreed to stop after this step), else 128+signum."""
        return 0 if self.times.agreed else 128 + self._after_save

    def _nudge(self) -> None:
        """Wake the listening thread (it waits until the old deadline): a step or a save ended."""
        try:
            os.write(self._write_fd, _NUDGE)
        except BlockingIOError:  # the pipe is full of wake-ups already
            pass

    def agreed(self, any_rank_signalled: bool) -> bool:
        """After each step, with whether any rank was `signalled` when the step's numbers were
        gathered (the same on every rank): whether every rank stops now. Restarts the clock: the
        step ended. A signal after the gather is agreed on at the next step's."""
        stopping = bool(any_rank_signalled)
        with self._lock:
            self.times.step_ended(stopping)
            signalled = self.signalled
        if signalled:
            self._nudge()
        return stopping

    @contextlib.contextmanager
    def saving(self):
        """A save runs: no deadline meanwhile, and a later request waits for it; the next step's
        time starts after it."""
        with self._lock:
            self.times.save_started()
        try:
            yield
        finally:
            with self._lock:
                self.times.save_ended()
                signalled = self.signalled
            if signalled:
                self._nudge()

    def saved(self, path: Path, logging_rank: bool, write_s: Optional[float] = None, asynchronous: bool = False,
              before_leaving: Callable[[], None] = lambda: None) -> None:
        """After `saving()` ended with the save committed, or (`asynchronous`) its snapshot taken: the
        logging rank's `saved_line`; then, if a later request came during the save, this rank leaves,
        once `before_leaving()` (the background write and commit) returned."""
        with self._lock:
            save_s, step_s = self.times.last_save_s, self.times.longest_step_s
            leave = self._exit_code_after_save() if self._after_save is not None else None
        if logging_rank:
            print(saved_line(path, save_s, step_s, write_s, asynchronous), flush=True)
        if leave is not None:
            before_leaving()
            print(f"rank {self.rank}: leaving after the save, as the {self._after_save.name} during it asked (exit "
                  f"{leave})", flush=True)
            exit_after_commit(leave)
