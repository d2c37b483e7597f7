"""The calibration's timing loops (launch/autotune/calibrate.py, calibrate_blocks.py,
calibrate_engine.py), the same on CPU and GPU: `synchronize` waits for the device's queued work
(torch.cuda.synchronize on a GPU, nothing on CPU, where every call has finished when it returns).

- `median_seconds`: a call's median time over repeats after one warm-up, with untimed work before
  each (a barrier, so every rank of a group starts together; a device sync, so no queued work is
  counted).
- `back_to_back_rate`: a kernel's throughput with the device's queue kept full, as in a training
  step: many calls, then one synchronize. A synchronize after every call would add the host's
  launch latency and the idle device between calls to each one (about 5-10 us a CUDA kernel: more
  than a small expert GEMM itself), so small GEMMs would look slow."""
import math
import time
from typing import Callable


def no_sync() -> None:
    """A CPU's synchronize: its calls have finished when they return."""


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


def back_to_back_rate(call: Callable[[], object], work: float, synchronize: Callable[[], object] = no_sync,
                      min_seconds: float = 0.05, clock: Callable[[], float] = time.perf_counter) -> float:
    """`work` (FLOPs, bytes) per call over seconds, of `call` run back to back: one warm-up call,
    then batches of calls, each batch timed from the end of the last synchronize to the end of one
    synchronize after its calls, the next batch longer, until one lasts `min_seconds`: its rate."""
    call()
    synchronize()
    calls = 1
    while True:
        start = clock()
        for _ in range(calls):
            call()
        synchronize()
        elapsed = clock() - start
        if elapsed >= min_seconds:
            return work * calls / elapsed
        # Enough calls for min_seconds at this batch's pace (20% over), at least twice as many.
        calls = max(2 * calls, min(100 * calls, math.ceil(1.2 * calls * min_seconds / max(elapsed, 1e-9))))
