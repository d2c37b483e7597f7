"""The read-ahead thread takes the reading off the trainer's draw (data/prefetch.py): with a
trainer slower than the reader, the draws stop waiting; and `waited_s` (the step's data_wait_s)
counts what the trainer did wait, inline or on the thread. A reader that sleeps stands in for
storage, so the times are large against this machine's noise."""
import itertools
import threading
import time
import weakref

import numpy as np
import pytest
import torch

from data.builtin import load_tokenizer
from data import prefetch
from data.prefetch import Closed, ReadAhead
from data.prepare_source import default_read_ahead_steps
from data.spec import DataSpec
from data.streaming import START, StreamingBatches, StreamSource, stream_windows
from data.units import Unit, UnitSource, UnitTable

READ_S = 0.03  # per window: 0.12 s per step of 4 windows
B, MICRO, STEPS = 4, 2, 4


def slow_stream(stream, state):
    for i in range(10 ** 6):
        time.sleep(READ_S)
        yield np.arange(17) + i, (START, i + 1)


def batches(read_ahead_steps):
    return StreamingBatches(slow_stream, 1, B, MICRO, 0, 1, 0, {}, read_ahead_steps)


@pytest.mark.waits  # sleeps against sleeps: timed on the waiting worker
def test_reading_ahead_hides_the_reader_behind_a_slower_trainer():
    inline = batches(0)
    drawn_inline = [next(inline)[0] for _ in range(STEPS * B // MICRO)]
    assert inline.waited_s >= 0.9 * STEPS * B * READ_S  # every window read inside a draw

    ahead = batches(1)
    drawn_ahead, waits = [], []
    for _ in range(STEPS):
        before = ahead.waited_s
        drawn_ahead += [next(ahead)[0] for _ in range(B // MICRO)]
        waits.append(ahead.waited_s - before)
        time.sleep(2 * B * READ_S)  # the trainer's step: twice the reader's
    assert waits[0] >= 0.9 * B * READ_S  # the first step has nothing ahead yet
    assert sum(waits[1:]) < 0.25 * B * READ_S, waits  # then the reader keeps ahead
    assert all(np.array_equal(a, b) for a, b in zip(drawn_inline, drawn_ahead))
    assert ahead.step == STEPS  # the position: what was drawn, not what the thread read ahead


BLOCK = 16  # windows a stream refills at once: every BLOCK / B = 4 steps, a burst of 4 steps' reading


def bursty_stream(stream, state):
    """Windows handed out a block at a time, as a stream's shuffle block is (data/streaming.py):
    the whole block's reading happens before its first window."""
    for i in range(10 ** 6):
        if i % BLOCK == 0:
            time.sleep(BLOCK * READ_S)
        yield np.arange(17) + i, (START, i % BLOCK + 1)


def waits_per_step(read_ahead_steps, steps=3 * BLOCK // B):
    batches = StreamingBatches(bursty_stream, 1, B, MICRO, 0, 1, 0, {}, read_ahead_steps)
    waits = []
    for _ in range(steps):
        before = batches.waited_s
        for _ in range(B // MICRO):
            next(batches)
        waits.append(batches.waited_s - before)
        time.sleep(1.5 * B * READ_S)  # the trainer: 1.5x the reader's average per step
    batches.close()
    return waits


@pytest.mark.waits
@pytest.mark.slow  # 5 s of sleeps: the fast tier keeps the one-step test above
def test_the_default_read_ahead_spreads_a_block_refill():
    """One step ahead cannot hide a refill that costs 4 steps' reading; the default depth (the
    steps between refills) can, with a trainer only 1.5x slower than the reader on average."""
    depth = default_read_ahead_steps([DataSpec(streaming=True, shuffle_buffer=BLOCK, streams=1)], B)
    assert depth == BLOCK // B
    one_step, default = waits_per_step(1), waits_per_step(depth)
    first_block = BLOCK // B
    # One step ahead waits at every refill: the thread holds at most one step queued and one in
    # hand, so the trainer waits the refill (BLOCK * READ_S) less two of its steps, 0.12 s here.
    least = BLOCK * READ_S - 2 * 1.5 * B * READ_S
    refills = one_step[first_block::first_block]
    assert len(refills) == 2 and all(wait > 0.5 * least for wait in refills), one_step
    assert sum(default[first_block:]) < 0.1 * BLOCK * READ_S, default


CLOSED_WITHIN_S = 3.0  # against CLOSE_WAIT_S (10 s) and the 12 s refill below: closing waited on neither


def test_closing_ends_the_worker_blocked_on_a_full_queue():
    """`close` returns with the worker ended (a process may exit right after it), and a draw
    after it fails instead of waiting forever."""
    batches = StreamingBatches(slow_stream, 1, B, MICRO, 0, 1, 0, {}, 1)
    next(batches)
    time.sleep(10 * READ_S)  # the worker fills its one step ahead and waits for room
    assert batches._batches.queue.full()
    start = time.monotonic()
    batches.close()
    assert time.monotonic() - start < CLOSED_WITHIN_S
    assert not batches._batches.thread.is_alive()
    with pytest.raises(Closed):
        next(batches)


def test_the_exit_tells_every_open_worker_to_stop_before_it_waits_for_any(monkeypatch):
    """Workers nobody closed are closed at exit (prefetch._close_at_exit). Each waiting to put its
    next item sees a stop within its put's 0.1 s timeout; told one at a time, a process that left
    many open (a test module, a loop left by an exception) waited for them one after another."""
    monkeypatch.setattr(prefetch, "_started", weakref.WeakSet())
    workers = [ReadAhead(itertools.count(), depth=1, name=f"worker {i}") for i in range(3)]
    for worker in workers:
        next(worker)  # started; it fills its queue and waits for room
    stopped_at_each_wait, join = [], ReadAhead.join

    def noting_join(worker, deadline):
        stopped_at_each_wait.append([w.stopping.is_set() for w in workers])
        join(worker, deadline)

    monkeypatch.setattr(ReadAhead, "join", noting_join)
    prefetch._close_at_exit()
    assert stopped_at_each_wait == [[True] * 3] * 3
    assert not any(worker.thread.is_alive() for worker in workers)


class SlowUnits(UnitSource):
    """Units of one document each, every read taking READ_S: slow storage."""
    label = "slow"

    def __init__(self, n: int):
        self.units, self.read = UnitTable.of(Unit(0, i, i, i + 1) for i in range(n)), 0

    def texts(self, unit: Unit):
        time.sleep(READ_S)
        self.read += 1
        return [f"document {unit.part} says " * 10]


def test_closing_ends_a_block_refill_at_the_next_unit():
    """A worker closed while it refills a shuffle block (here the whole epoch: 400 units, 12 s
    of reading) stops before its next unit read, not after the block."""
    units = SlowUnits(400)
    source, tokenizer = StreamSource(units, units.units), load_tokenizer("builtin")
    batches = StreamingBatches(lambda stream, state: stream_windows(source, tokenizer, 16, 1, False, 10 ** 6, stream,
                                                                    1, state), 1, B, MICRO, 0, 1, 0, {}, 1)
    drawn = []
    drawer = threading.Thread(target=lambda: drawn.append(pytest.raises(Closed, next, batches)), daemon=True)
    drawer.start()  # the trainer's draw: it waits on the refill
    while units.read < 3:
        time.sleep(READ_S)
    start = time.monotonic()
    batches.close()
    assert time.monotonic() - start < CLOSED_WITHIN_S
    assert not batches._batches.thread.is_alive()
    read = units.read
    drawer.join(CLOSED_WITHIN_S)
    assert drawn and units.read == read < 20  # the drawer's wait ended; no unit read after close


class DocUnits(UnitSource):
    """Units of `per_unit` documents of the same length (~60 tokens each), counting the documents
    tokenized and the reads in progress at once."""
    label = "docs"

    def __init__(self, n: int, per_unit: int, read_s: float = 0.0):
        self.units, self.per_unit, self.read_s = UnitTable.of(Unit(0, i, i, i + 1) for i in range(n)), per_unit, read_s
        self.lock, self.reading, self.most_at_once = threading.Lock(), 0, 0

    def texts(self, unit: Unit):
        with self.lock:
            self.reading += 1
            self.most_at_once = max(self.most_at_once, self.reading)
        time.sleep(self.read_s)
        with self.lock:
            self.reading -= 1
        return [f"unit {unit.part} document {d} says " * 10 for d in range(self.per_unit)]


def doc_batches(units, read_ahead_steps, global_batch=B, micro=MICRO, seq_len=16, block=4):
    source, tokenizer = StreamSource(units, units.units), load_tokenizer("builtin")
    return StreamingBatches(lambda stream, state: stream_windows(source, tokenizer, seq_len, 1, True, block, stream,
                                                                 global_batch, state),
                            global_batch, global_batch, micro, 0, 1, 0, {}, read_ahead_steps)


def test_the_queue_holds_one_narrow_array_per_micro_batch():
    """What the read-ahead queue holds of a micro-batch is one (b, seq_len + 1) array of the
    vocabulary's narrowest dtype (uint16 for the builtin 4,096 ids: 2 bytes a token, where
    int64 inputs and labels held 16), the inputs and labels views of it; the trainer gets int64
    tensors, the inputs' next tokens being the labels."""
    batches = doc_batches(DocUnits(8, 50), read_ahead_steps=2)
    x, y = next(batches)
    while not batches._batches.queue.full():
        time.sleep(0.01)
    queued = list(batches._batches.queue.queue)
    batches.close()
    for qx, qy, _ in queued:
        assert qx.dtype == qy.dtype == np.uint16 and qx.shape == qy.shape == (MICRO, 16)
        assert qx.base is qy.base and qx.base.shape == (MICRO, 17)  # views of one array, no copies
        assert np.array_equal(qx[:, 1:], qy[:, :-1])
    assert x.dtype == y.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])


def test_streams_open_together_and_tokenize_what_their_first_block_needs(monkeypatch):
    """A rank's streams read their first units side by side (a bounded pool), and a stream's
    first block tokenizes about the documents its windows need, not a batch of 64: the batches
    are the ones read one stream after another with 64-document tokenizer batches."""
    import data.streaming as streaming
    tokenized = []
    counted = streaming.document_tokens
    monkeypatch.setattr(streaming, "document_tokens", lambda texts, tok: tokenized.append(len(texts)) or counted(texts, tok))
    units = DocUnits(16, 200, read_s=0.05)
    together = doc_batches(units, 0, global_batch=8, micro=8)
    first = next(together)
    assert 1 < units.most_at_once <= streaming.OPEN_THREADS
    per_doc = len(counted(["unit 0 document 0 says " * 10], load_tokenizer("builtin"))[0])
    needed = -(-4 * 17 // per_doc)  # a block of 4 windows of 17 tokens
    assert len(tokenized) >= 8 and max(tokenized) <= needed + 1 and sum(tokenized) <= 8 * (needed + 2), tokenized

    monkeypatch.setattr(streaming, "OPEN_THREADS", 1)
    packed = streaming.packed_windows  # batches of 64 documents (or to a unit's end), as before
    monkeypatch.setattr(streaming, "packed_windows", lambda *a, **k: packed(*a, **{**k, "batch_tokens": 10 ** 9}))
    units = DocUnits(16, 200, read_s=0.0)
    alone = next(doc_batches(units, 0, global_batch=8, micro=8))
    assert units.most_at_once == 1
    assert all(torch.equal(a, b) for a, b in zip(first, alone))
