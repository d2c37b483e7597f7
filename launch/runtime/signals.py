"""SIGTERM / SIGINT: finish the current step, save, exit 0; a second signal exits at once.

Ranks receive signals at different times, or not at all (DeepSpeed's launcher forwards a
SIGTERM to its children one after the other; SLURM signals every task). So each step the
ranks agree with one MAX all-reduce of their flags: if any rank was signalled, all stop
after the same step and save together.
"""
from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # annotations only: no import cost at run time
    from types import FrameType

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    def __init__(self, device: str):
        self.device = device
        self.signalled = False
        for sig in SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.signalled:  # the second signal: no checkpoint, no clean-up
            os._exit(128 + signum)
        self.signalled = True
        print(f"rank {dist.get_rank()}: {signal.Signals(signum).name} received; saving after this step "
              f"(send it again to exit at once)", flush=True)

    def agreed(self) -> bool:
        """True on every rank once any rank was signalled (a collective: all ranks call it)."""
        flag = torch.tensor([1.0 if self.signalled else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
