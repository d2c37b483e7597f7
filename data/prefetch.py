"""Read ahead: an iterator drawn by a background thread into a bounded queue (issue 22).

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
import queue
import threading
from typing import Iterator, Optional


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
        try:
            for item in self.items:
                if not self._put(item):
                    return
        except BaseException as e:  # handed to the consumer, raised there
            self._put(_Failed(e))

    def close(self) -> None:
        """Stop the worker at its next item (it holds up to `depth` items and a stream's block)."""
        self.stopping.set()

    def __iter__(self):
        return self

    def __next__(self):
        if self.thread is None:
            self.thread = threading.Thread(target=self._work, name=self.name, daemon=True)
            self.thread.start()
        item = self.queue.get()
        if isinstance(item, _Failed):
            self.queue.put(item)  # every later call fails the same way
            raise item.error
        return item
