"""Read ahead: an iterator drawn by a background thread into a bounded queue.

Streaming reads and tokenizes in bursts: every stream refills its shuffle block (shuffle_buffer
windows) at once, and the streams of a rank refill at the same step, every shuffle_buffer x
streams / global_batch_size steps. Run inline, the burst sits inside the engine's call for that
step's first micro-batch. Here a worker thread runs the iterator up to `depth` items ahead (by
default the steps between two refills, data/prepare_source.py: default_read_ahead_steps), so a burst
overlaps the steps that the blocks before it feed, and the engine's call returns at once when
the data keeps up (pyarrow and fsspec release the GIL while reading, the Rust tokenizer while
tokenizing). The items carry whatever position they need: the consumer, not the worker, decides
what is done (data/streaming.py: StepBatches). An exception in the worker is raised by the
consumer's next call, where the training loop turns it into the rank's one-line failure; it
never hangs.
"""
import atexit
import queue
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Callable, Iterator, List, Optional, TypeVar

T, R = TypeVar("T"), TypeVar("R")

CLOSE_WAIT_S = 10.0
"""How long `close` waits for the worker to end. Closed, it stops at its next unit read or
tokenizer batch (`stop_point`); one that is still reading then (slow storage) is left to the
wait at exit (`_close_at_exit`)."""

_worker = threading.local()  # in a worker thread: its ReadAhead's `stopping`, for stop_point
_started: "weakref.WeakSet" = weakref.WeakSet()  # ReadAheads and Openings, closed at exit


class Closed(Exception):
    """Raised by `stop_point` in the worker of a closed ReadAhead (the item it was producing is
    dropped, and the worker ends), and by a draw from a closed ReadAhead."""


def stop_point() -> None:
    """In the worker of a closed ReadAhead, raise Closed; elsewhere (a stream read inline by the
    trainer, validation reads) do nothing. The stream code calls it before each unit read and
    each tokenizer batch (data/streaming.py): a worker closed while it refills a shuffle block
    (hundreds of units on a large rank) ends within one of them instead of after the block."""
    stopping = getattr(_worker, "stopping", None)
    if stopping is not None and stopping.is_set():
        raise Closed


class Opening:
    """`work` of each item, started now on at most `threads` threads that take the items in order
    (pyarrow, fsspec and the Rust tokenizer release the GIL, so a rank's streams open side by side
    instead of one after another); `futures[i].result()` waits for item i only. Inside a
    ReadAhead's worker, the threads stop at their `stop_point`s when it is closed, as the worker
    itself does. `close` skips the items not started and waits (bounded) for the threads."""

    def __init__(self, work: Callable[[T], R], items: List[T], threads: int):
        stopping = getattr(_worker, "stopping", None)
        self.futures: List[Future] = [Future() for _ in items]
        todo, lock = iter(list(zip(self.futures, items))), threading.Lock()

        def run() -> None:
            _worker.stopping = stopping
            while True:
                with lock:
                    job = next(todo, None)
                if job is None:
                    return
                future, item = job
                if not future.set_running_or_notify_cancel():
                    continue  # cancelled by `close`
                try:
                    future.set_result(work(item))
                except BaseException as e:  # raised by the future's `result()`
                    future.set_exception(e)

        self.threads = [threading.Thread(target=run, name=f"open-streams_{i}", daemon=True)
                        for i in range(max(1, min(threads, len(items))))]
        for thread in self.threads:
            thread.start()
        _started.add(self)

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Cancel what has not started and wait up to `wait_s` for the threads to end (a thread
        inside pyarrow at the interpreter's end aborts the process: ReadAhead.close). Safe to call
        again."""
        self.stop()
        self.join(time.monotonic() + wait_s)

    def stop(self) -> None:
        """Cancel what has not started, without waiting."""
        for future in self.futures:
            future.cancel()

    def join(self, deadline: float) -> None:
        """Wait until `deadline` (time.monotonic) at most for the threads to end."""
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))


def fan_out(work: Callable[[T], R], items: List[T], threads: int) -> List[R]:
    """`work` of each item, in order, on at most `threads` threads (`Opening`); the first
    exception is raised here, and what has not started then does not start. (The streams open
    with `Opening`; bench/data/first_batch.py's --old runs older streaming code with this.)"""
    if len(items) <= 1 or threads <= 1:
        return [work(item) for item in items]
    opening = Opening(work, items, threads)
    try:
        return [f.result() for f in opening.futures]
    except BaseException:
        for f in opening.futures:
            f.cancel()  # what has not started does not start; the rest end at their next stop_point
        raise


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


class ReadAhead:
    """`items`, drawn by a daemon thread started at the first `next` (ranks that never draw,
    such as middle pipeline stages or TP peers that receive their batches, start none)."""

    def __init__(self, items: Iterator, depth: int, name: str = "read-ahead"):
        self.items, self.name = items, name
        self.queue: "queue.Queue" = queue.Queue(maxsize=max(1, depth))
        self.thread: Optional[threading.Thread] = None
        self.stopping = threading.Event()

    def _put(self, item) -> bool:
        """Queue `item` once there is room; False when closed first."""
        while not self.stopping.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _work(self) -> None:
        _worker.stopping = self.stopping
        try:
            for item in self.items:
                if not self._put(item):
                    return
        except Closed:
            return
        except BaseException as e:  # handed to the consumer, raised there
            self._put(_Failed(e))

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Stop the worker and wait (up to `wait_s`) for it to end. A daemon thread still
        running when the interpreter finalizes is ended by it at its next acquire of the GIL,
        with pthread_exit; inside pyarrow's C++ that unwinding aborts the process ("terminate
        called without an active exception", SIGABRT): half the exits of processes whose worker
        was reading ahead did (tests/data/test_read_ahead_exit.py; CPython gh-87135,
        pytorch/pytorch#38228). Joined here, it has ended by then. Safe to call again, from any
        thread."""
        self.stop()
        self.join(time.monotonic() + wait_s)

    def stop(self) -> None:
        """Tell the worker to end (at its next `stop_point` or queue put), without waiting."""
        self.stopping.set()

    def join(self, deadline: float) -> None:
        """Wait until `deadline` (time.monotonic) at most for the worker to end."""
        if self.thread is not None:
            self.thread.join(max(0.0, deadline - time.monotonic()))

    def __iter__(self):
        return self

    def __next__(self):
        if self.thread is None:
            self.thread = threading.Thread(target=self._work, name=self.name, daemon=True)
            self.thread.start()
            _started.add(self)
        while True:  # a draw waiting when another thread closes fails, rather than wait forever
            if self.stopping.is_set():
                raise Closed(f"{self.name} was closed")
            try:
                item = self.queue.get(timeout=0.1)
                break
            except queue.Empty:
                continue
        if isinstance(item, _Failed):
            self.queue.put(item)  # every later call fails the same way
            raise item.error
        return item


@atexit.register
def _close_at_exit() -> None:
    """Close every worker still running when the interpreter begins to exit. Exit handlers run
    before it finalizes, while threads still run: a worker its owner never closed (an exception
    that left the training loop, a bench or test that drew and returned), or one that outlived
    `close`'s wait in a slow read, ends here instead of inside C++ at finalization. All are told
    to stop before any is waited for, so the exit waits for the slowest, not for their sum (a
    worker waiting to put its next item sees the stop within its 0.1 s put timeout: a process
    that left 33 of them open waited 2.2 s for them one by one)."""
    workers = list(_started)
    for worker in workers:
        worker.stop()
    deadline = time.monotonic() + CLOSE_WAIT_S
    for worker in workers:
        worker.join(deadline)
