"""The read-ahead thread takes the reading off the trainer's draw (data/prefetch.py): with a
trainer slower than the reader, the draws stop waiting; and `waited_s` (the step's data_wait_s)
counts what the trainer did wait, inline or on the thread. A reader that sleeps stands in for
storage, so the times are large against this machine's noise."""
import time

import numpy as np

from data.streaming import START, StreamingBatches

READ_S = 0.05  # per window: 0.2 s per step of 4 windows
B, MICRO, STEPS = 4, 2, 4


def slow_stream(stream, state):
    for i in range(10 ** 6):
        time.sleep(READ_S)
        yield np.arange(17) + i, (START, i + 1)


def batches(read_ahead_steps):
    return StreamingBatches(slow_stream, 1, B, MICRO, 0, 1, 0, {}, read_ahead_steps)


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
