"""The calibration's one timing loop (launch/autotune/calibrate.py, calibrate_engine.py): a call's
median time over repeats after one warm-up, with untimed work before each (a barrier, so every rank
of a group starts together; a device sync, so no queued work is counted)."""
import time
from typing import Callable


def median_seconds(call: Callable[[], object], repeats: int, before: Callable[[], object] = lambda: None) -> float:
    """Median seconds of `call` over `repeats` timed calls, after one untimed warm-up call; `before`
    runs untimed ahead of each timed call."""
    call()
    times = []
    for _ in range(repeats):
        before()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2]
