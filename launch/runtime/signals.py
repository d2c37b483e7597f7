"""SIGTERM / SIGINT: finish the current step, save, exit 0; a second signal exits at once; a step
that has not ended within train.stop_grace_s (a peer frozen or gone) exits without a save.

Ranks receive signals at different times, or not at all (DeepSpeed's launcher forwards a
SIGTERM to its children one after the other; SLURM signals every task). So each step the
ranks agree with one MAX all-reduce of their flags: if any rank was signalled, all stop
after the same step and save together.

A Python signal handler runs only when the main thread runs Python code, never while it waits
in a collective. So the signals are taken by a thread instead: Python's C-level handler writes
each signal's number to a wakeup pipe (signal.set_wakeup_fd), which that thread reads.
"""
from __future__ import annotations

import os
import select
import signal
import threading
import time

import torch
import torch.distributed as dist

from launch.runtime.failure import say_error

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _nothing(signum, frame) -> None:
    """The Python-level handler: the listening thread acts; this only keeps the default action away."""


class StopRequest:
    """Create in the main thread (set_wakeup_fd must be called there), once per process."""

    def __init__(self, device: str, rank: int, grace_s: float):
        self.device, self.rank, self.grace_s = device, rank, grace_s
        self.signalled = False
        self._step_ended = threading.Event()  # set once every rank agreed to stop after a step
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # the C handler must never block
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        for sig in SIGNALS:
            signal.signal(sig, _nothing)
        threading.Thread(target=self._listen, args=(read_fd,), name="gpt3d-stop-request", daemon=True).start()

    def _listen(self, fd: int) -> None:
        deadline, first = None, None
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], wait)[0]:  # the grace is over
                if self._step_ended.is_set():  # the save is under way: it is not bounded here
                    deadline = None
                    continue
                say_error(f"the step did not end within train.stop_grace_s={self.grace_s:g} s of the {first.name}; "
                          f"leaving without saving (the last complete checkpoint stays the resume point)", self.rank)
                os._exit(128 + first)
            signum = os.read(fd, 1)[0]
            if signum not in SIGNALS:  # another signal with a Python handler also writes here
                continue
            if self.signalled:  # the second signal: no checkpoint, no clean-up
                os._exit(128 + signum)
            self.signalled, first = True, signal.Signals(signum)
            deadline = time.monotonic() + self.grace_s
            print(f"rank {self.rank}: {first.name} received; saving after this step (without a save if it has "
                  f"not ended within {self.grace_s:g} s; send it again to exit at once)", flush=True)

    def agreed(self) -> bool:
        """True on every rank once any rank was signalled (a collective: all ranks call it)."""
        flag = torch.tensor([1.0 if self.signalled else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        stopping = bool(flag.item())
        if stopping:
            self._step_ended.set()
        return stopping
