"""What a rank is reading while its data stalls (data/reading.py), against storage that really
stalls: the test server (tests/helpers/range_server.py) holds every data request, so the read-ahead
worker (or the trainer's own thread) waits inside a real range request, and `reading_now` must
name the source, the file's URL and the unit it waits on, then nothing once the reads end."""
import re
import threading
import time

import pytest

from data.builtin import load_tokenizer
from data.prepare_source import unit_source
from data.reading import reading, reading_now
from data.run import prepare_run_data
from data.spec import DataSpec
from helpers.simulated_clock import SimulatedClock
from helpers.stream_corpus import served, write_corpus

N_DOCS, N_FILES, GROUP_ROWS = 200, 2, 20  # 10 row groups of 20 documents
WAIT_S = 10.0  # for the blocked read to show (it starts in milliseconds)
LINE = re.compile(r"(.*) for (\d+) s$")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("reading"), N_DOCS, N_FILES, GROUP_ROWS)


@pytest.fixture(scope="module")
def server(corpus):
    yield from served(corpus)


def test_reads_are_listed_oldest_first_from_every_thread_until_they_end():
    """The trainer's thread reading a row group for 312 s and another thread a footer for 12 s:
    both, oldest first; each gone when its read ends, by an exception too."""
    clock = SimulatedClock()
    entered, leave = threading.Event(), threading.Event()

    def footer_pool_thread():
        with reading("web: https://host/b.parquet footer", clock.now):
            entered.set()
            leave.wait()

    with reading("web: https://host/a.parquet row group 3", clock.now):
        clock.advance(300)
        worker = threading.Thread(target=footer_pool_thread)
        worker.start()
        entered.wait()
        clock.advance(12)
        assert reading_now(clock.now) == ["web: https://host/a.parquet row group 3 for 312 s",
                                          "web: https://host/b.parquet footer for 12 s"]
        leave.set()
        worker.join()
        assert reading_now(clock.now) == ["web: https://host/a.parquet row group 3 for 312 s"]
    with pytest.raises(OSError):
        with reading("web: https://host/c.parquet row group 0", clock.now):
            raise OSError("a failed read")
    assert reading_now(clock.now) == []


def _named_while_held(server, read):
    """The descriptions `reading_now` gives while `read` (in a thread of its own) waits on the
    held server, twice (0.2 s apart); the reader has ended when it returns."""
    server.held = threading.Event()
    reader = threading.Thread(target=read, daemon=True)
    try:
        reader.start()
        deadline = time.monotonic() + WAIT_S
        while not reading_now() and time.monotonic() < deadline:
            time.sleep(0.01)
        first = [LINE.match(line).group(1) for line in reading_now()]
        time.sleep(0.2)
        again = [LINE.match(line).group(1) for line in reading_now()]
    finally:
        server.held.set()
        server.held = None
    reader.join(WAIT_S)
    assert not reader.is_alive()
    return first, again


def test_a_stalled_row_group_read_is_named_until_it_ends(server, stream_cache):
    """The read-ahead worker's first unit (one stream, unshuffled: part0.parquet's row group 0),
    for the trainer's first draw, waits on the server: named with its URL and row group; nothing
    once the batches are closed."""
    name = f"{server.url}/part*.parquet"
    data = prepare_run_data(DataSpec(name=name, streaming=True, val_fraction=0.0, streams=1, shuffle=False,
                                     shuffle_buffer=4, read_ahead_steps=1), load_tokenizer("builtin"), 15,
                            seed=1, global_batch_size=4, micro_batch_size=2, evaluate=False)
    batches = data.train_batches(0, 1)
    first, again = _named_while_held(server, lambda: next(batches))
    assert first == [f"{name}: {server.url}/part0.parquet row group 0"], first
    assert again == first  # still that read
    data.close_batches(batches)
    assert reading_now() == []


def test_a_stalled_line_read_is_named_by_its_byte_range(server, stream_cache):
    """A JSON Lines unit read inline (the trainer's own thread): its URL and byte range."""
    name = f"{server.url}/all.jsonl"
    units = unit_source(DataSpec(name=name, streaming=True, unit_bytes=4096), "train")
    third = units.units[2]
    first, _ = _named_while_held(server, lambda: units.texts(third))
    assert first == [f"{name}: {name} bytes 8192-12288"], first
    assert reading_now() == []
