"""The one clock every timer of a run reads: the hang watchdog's bounds, the stop request's grace,
the heartbeats and the straggler windows. A run uses the monotonic clock; a test passes a clock it
advances itself, so hours of steps, saves, evaluations and stalls run in a second
(tests/helpers/simulated_clock.py)."""
from __future__ import annotations

import time


class Clock:
    """Seconds from an arbitrary origin that never go backwards (`time.monotonic`)."""

    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


MONOTONIC = Clock()
