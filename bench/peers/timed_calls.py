"""A function wrapped so that each call's wall time adds to a named total: how the benches that
split a step into parts (bench/peers/step_parts.py, bench/peers/megatron_peer.py) time what they patch."""
import functools
import time
from typing import Callable, MutableMapping


def timed_into(totals: MutableMapping[str, float], name: str, fn: Callable) -> Callable:
    """`fn`, adding each call's seconds to `totals[name]` (a mapping the caller keeps, and empties in place)."""
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start
    return timed
