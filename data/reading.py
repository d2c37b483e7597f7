"""What this process is reading right now, for the line a stalled rank prints: the places in
data/ that fetch a streamed unit's bytes (data/units.py), a footer, a listing or a file's size
(data/files.py) say so around the read (`reading`), from whichever thread reads (the read-ahead
worker, a footer pool thread, the trainer's own thread reading inline), and `reading_now` lists
what is under way and for how long. A rank waiting on its data past its bound can then name the
file, the row group or byte range, instead of "waiting for data".

One lock and one dict entry per read: a unit read, not a row, so the cost (about a microsecond)
is nothing beside the read itself.
"""
import itertools
import threading
import time
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Tuple

_lock = threading.Lock()
_under_way: Dict[int, Tuple[str, float]] = {}  # (description, started), in the order the reads began
_keys = itertools.count()


@contextmanager
def reading(description: str, clock: Callable[[], float] = time.monotonic) -> Iterator[None]:
    """Record that this thread reads `description` until the block ends (however it ends): the
    source's label, the file (path or URL, no credentials) and the unit, e.g.
    "https://host/data/*.parquet: https://host/data/part-3.parquet row group 7". A read nested in
    another (a row group's, which first reads its file's footer) is listed too, after it."""
    with _lock:
        key = next(_keys)
        _under_way[key] = (description, clock())
    try:
        yield
    finally:
        with _lock:
            del _under_way[key]


def reading_now(clock: Callable[[], float] = time.monotonic) -> List[str]:
    """The reads under way in this process, oldest first, each "<description> for <seconds> s"
    (seconds on `clock`, the one the reads were recorded with)."""
    now = clock()
    with _lock:
        under_way = list(_under_way.values())
    return [f"{description} for {now - started:.0f} s" for description, started in under_way]
