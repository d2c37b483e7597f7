"""What a streaming job fetches, counted by the test server (tests/helpers/range_server.py) and
checked against the files' own layout read by pyarrow: every unit is fetched once per epoch by
one rank, and nothing but the text column's chunks and the footers; a job of separate processes
fetches each footer once and each byte once, at dp 8 and at pp 2 x cp 2 x dp 2; a unit reads
without its footer; a line stream reads what its first windows need before the rest of its unit;
a resume fetches the same bytes at step 3 as at step 30; validation fetches about what its
windows hold; start-up fetches footers only."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.builtin import load_tokenizer
from data.run import prepare_run_data
from data.spec import DataSpec
from data.files import resolve_files
from data.streaming import merge_states
from data.units import FileUnits
from helpers.builtin_cache import cache_with_builtin
from helpers.range_server import RangeServer
from helpers.stream_corpus import served, window_ids, write_corpus
from helpers.stream_steps import windows_per_step

N_DOCS, N_FILES, GROUP_ROWS = 8000, 10, 16  # 500 row groups of 16 documents
SEQ_LEN, B, MICRO = 63, 32, 4
STEPS = 50  # about a third of an epoch of the parquet files
READ_BOUND = 1.1  # fetched <= 1.1 x the consumed units' bytes + footers


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("builtin")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("reads"), N_DOCS, N_FILES, GROUP_ROWS)


@pytest.fixture(scope="module")
def server(corpus):
    yield from served(corpus)


class ParquetLayout:
    """The corpus's bytes as pyarrow lays them out: each row group's text chunk and each footer."""

    def __init__(self, corpus, n_files=N_FILES, group_rows=GROUP_ROWS):
        self.n_files, self.group_rows = n_files, group_rows
        self.chunks, self.footers, self.sizes = {}, {}, {}
        for f in range(n_files):
            name, path = f"part{f}.parquet", corpus / f"part{f}.parquet"
            meta, data = pq.ParquetFile(path).metadata, path.read_bytes()
            for g in range(meta.num_row_groups):
                chunk = meta.row_group(g).column(0)  # "text"
                start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
                self.chunks[(name, start, start + chunk.total_compressed_size)] = (f, g)
            self.sizes[name] = len(data)
            self.footers[name] = 8 + int.from_bytes(data[-8:-4], "little")

    def unit_of_document(self, i: int):
        per_file = N_DOCS // self.n_files
        return i // per_file, i % per_file // self.group_rows

    def bytes_of(self, units) -> int:
        units = set(units)
        return sum(end - start for (_, start, end), unit in self.chunks.items() if unit in units)

    def is_footer(self, name, start, end) -> bool:
        return self.sizes[name] - self.footers[name] <= start < end <= self.sizes[name]

    def all_footers(self) -> int:
        return sum(self.footers.values())


def _spec(name, **kw):
    return DataSpec(**{"name": str(name), "streaming": True, "val_fraction": 0.0, "streams": 4,
                       "shuffle_buffer": 8, "read_ahead_steps": 0, **kw})


def _prepare(spec, tokenizer, evaluate=False):
    return prepare_run_data(spec, tokenizer, SEQ_LEN, seed=1, global_batch_size=B, micro_batch_size=MICRO,
                            evaluate=evaluate, eval_batches=2)


def _rank_reads(server, data, tokenizer, dp, steps=STEPS, start=0, data_state=None):
    """Per dp rank: (the requests it made, the documents its windows trained)."""
    per_rank = []
    for rank in range(dp):
        server.reset()
        it = data.train_batches(rank, dp, start_sample=start * B, data_state=data_state)
        windows = [x for _ in range(steps * B // dp // MICRO) for x in next(it)[0]]
        per_rank.append((list(server.requests), window_ids(tokenizer, windows)))
    return per_rank


# The default streams in the fast tier; 4 and 8 (10-11 s each there) in the full suite.
@pytest.mark.parametrize("streams", [pytest.param(4, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow), None])
def test_each_unit_is_fetched_once_by_the_rank_that_trains_it(streams, corpus, server, tokenizer, stream_cache):
    """At dp 1, 2, 4 with 4 and 8 streams, and at dp 1 and 8 with the default streams (B)."""
    layout = ParquetLayout(corpus)
    for dp in (1, 2, 4) if streams else (1, 8):
        server.reset()
        data = _prepare(_spec(f"{server.url}/part*.parquet", streams=streams), tokenizer)
        started = list(server.requests)
        assert all(layout.is_footer(*r) for r in started), [r for r in started if not layout.is_footer(*r)]  # footers only
        per_rank = _rank_reads(server, data, tokenizer, dp)
        fetched, consumed_by = [], []
        for requests, docs in per_rank:
            assert all(r in layout.chunks or layout.is_footer(*r) for r in requests), requests  # text chunks only
            fetched.append({layout.chunks[r] for r in requests if r in layout.chunks})
            consumed_by.append({layout.unit_of_document(i) for i in docs})
        every_fetch = [layout.chunks[r] for requests, _ in per_rank for r in requests if r in layout.chunks]
        assert len(every_fetch) == len(set(every_fetch)), (dp, streams)  # no unit twice in the job
        for rank in range(dp):
            others = set().union(*(c for r, c in enumerate(consumed_by) if r != rank))
            assert not fetched[rank] & others, (dp, streams, rank)  # a rank reads only its streams' units
            assert consumed_by[rank] <= fetched[rank]
        consumed = set().union(*consumed_by)
        assert 0.1 < len(consumed) / len(layout.chunks) < 0.6, len(consumed)  # a fraction of an epoch
        chunk_bytes = layout.bytes_of(every_fetch)
        footer_bytes = sum(end - start for requests, _ in per_rank for r in requests if r not in layout.chunks
                           for (_, start, end) in [r])
        assert chunk_bytes <= READ_BOUND * layout.bytes_of(consumed), (dp, streams, chunk_bytes, len(consumed))
        assert footer_bytes == 0  # the unit list says what a read needs: no footer


def test_line_units_fetch_about_what_they_train(corpus, server, tokenizer, stream_cache):
    """A JSON Lines file in byte ranges: the bytes fetched against the bytes of the lines that start
    in the units that trained (each line's place in the file, from the file itself)."""
    unit_bytes = 32 * 1024
    data = _prepare(_spec(f"{server.url}/all.jsonl", unit_bytes=unit_bytes), tokenizer)
    line_unit, offset = {}, 0
    for line in (corpus / "all.jsonl").read_bytes().splitlines(keepends=True):
        line_unit[json.loads(line)["id"]] = offset // unit_bytes
        offset += len(line)
    per_rank = _rank_reads(server, data, tokenizer, 2, steps=80)
    units = set().union(*({line_unit[i] for i in docs} for _, docs in per_rank))
    size = (corpus / "all.jsonl").stat().st_size
    consumed = sum(min(size, (u + 1) * unit_bytes) - u * unit_bytes for u in units)
    total = sum(end - start for requests, _ in per_rank for (_, start, end) in requests)
    assert 0.1 < consumed / size < 0.7, consumed / size
    assert total <= READ_BOUND * consumed, (total, consumed)


def test_a_resume_fetches_the_same_at_step_3_and_30(corpus, server, tokenizer, stream_cache):
    """The bytes fetched before the first resumed step's batches do not grow with the step: equal
    within one unit per stream (each stream reopens the unit where its shuffle block starts), and
    no footer (the unit list says what a read needs)."""
    layout = ParquetLayout(corpus)
    spec, dp = _spec(f"{server.url}/part*.parquet"), 2
    data = _prepare(spec, tokenizer)
    units, footers = {}, {}
    for step in (3, 30):
        _, states = windows_per_step(data, dp, step)
        state = merge_states(states, spec.streams)
        fresh = _prepare(spec, tokenizer)  # a new process's view: the unit list from the cache
        requests = [r for rank_requests, _ in _rank_reads(server, fresh, tokenizer, dp, steps=1, start=step,
                                                          data_state=state) for r in rank_requests]
        assert all(r in layout.chunks or layout.is_footer(*r) for r in requests)
        units[step] = [layout.chunks[r] for r in requests if r in layout.chunks]
        footers[step] = {r[0] for r in requests if r not in layout.chunks}
    largest_unit = max(end - start for _, start, end in layout.chunks)
    assert abs(layout.bytes_of(units[30]) - layout.bytes_of(units[3])) <= spec.streams * largest_unit, units
    for step in (3, 30):  # a unit or two per stream (30 steps trained ~45 units), no footer
        assert spec.streams <= len(units[step]) <= 2 * spec.streams, units[step]
        assert not footers[step], footers[step]


def test_validation_fetches_about_what_its_windows_hold(corpus, server, tokenizer, stream_cache):
    """Held-out units (up to 16, in a seeded order) are read until eval_batches global batches are packed: the bytes
    fetched are at most 2x those of the units its windows came from, not 1/val_fraction times."""
    layout = ParquetLayout(corpus)
    server.reset()
    data = _prepare(_spec(f"{server.url}/part*.parquet", val_fraction=0.1), tokenizer, evaluate=True)
    assert len(data.val_windows) == 2 * B
    val_units = {layout.unit_of_document(i) for i in window_ids(tokenizer, data.val_windows)}
    chunks = sum(end - start for r in server.requests if r in layout.chunks for (_, start, end) in [r])
    assert all(r in layout.chunks or layout.is_footer(*r) for r in server.requests)
    assert chunks <= 2 * layout.bytes_of(val_units), (chunks, layout.bytes_of(val_units))


def _resolve_on_each_rank(url: str, own_caches: str = "") -> None:
    import os
    from data.files import resolve_files
    if own_caches:  # every rank on a node of its own: no data cache in common
        os.environ["GPT3D_CACHE"] = f"{own_caches}/node{os.environ['RANK']}"
    files = resolve_files(url, None, "train", None)
    assert files.names == [f"part{f}.parquet" for f in range(N_FILES)], files.names
    assert len(FileUnits(files, "text", 2 ** 20).units) == N_DOCS // GROUP_ROWS


@pytest.mark.slow  # separate processes (6 CPU-s)
def test_the_files_are_resolved_once_per_job(corpus, server, tmp_path, monkeypatch):
    """Four ranks of one job, each on a node of its own, ask the server about the files once
    between them (rank 0, through the job's rendezvous store): one listing and one HEAD per file,
    not four, and each footer once for the list of units; a second job asks again (files may have
    changed between runs)."""
    from helpers.distributed import run_distributed
    layout = ParquetLayout(corpus)
    monkeypatch.setenv("GPT3D_CACHE", str(tmp_path / "cache"))
    server.reset()
    _resolve_on_each_rank(f"{server.url}/part*.parquet")  # one process alone: it asks for itself
    once = server.lookups
    assert once >= 1 + N_FILES  # the glob's directory listing, a HEAD per file
    for launch in (1, 2):
        server.reset()
        run_distributed(_resolve_on_each_rank, 4, f"{server.url}/part*.parquet", str(tmp_path / f"job{launch}"))
        assert server.lookups == once, (launch, server.lookups)
        assert all(layout.is_footer(*r) for r in server.requests)
        assert server.total() == layout.all_footers(), (launch, server.total() / layout.all_footers())
    server.reset()  # a glob that matches nothing: rank 0's one line, on every rank
    _refused_on_each_rank(f"{server.url}/nothing*.parquet")
    alone = server.lookups
    server.reset()
    run_distributed(_refused_on_each_rank, 4, f"{server.url}/nothing*.parquet")
    assert server.lookups == alone, (alone, server.lookups)


def _refused_on_each_rank(url: str) -> None:
    from data.files import resolve_files
    from data.spec import DataError
    with pytest.raises(DataError, match="nothing\\*.parquet' matches no file"):
        resolve_files(url, None, "train", None)


def test_the_stream_check_reads_line_units_by_their_heads(corpus, server, tokenizer, stream_cache):
    """With a stream per sample of the batch, the start-up check (every stream holds its share)
    reads the head of each stream's first line unit (64 KiB here), not the unit (200 KiB): 1,024
    streams of 8 MiB units would otherwise read 8 GiB before step 1."""
    unit_bytes, head = 200 * 1024, 64 * 1024
    size = (corpus / "all.jsonl").stat().st_size
    server.reset()
    data = _prepare(_spec(f"{server.url}/all.jsonl", unit_bytes=unit_bytes, streams=None), tokenizer)
    streams = data.spec.streams
    assert -(-size // unit_bytes) == 9 and streams == 8, (streams, size)  # fewer units than B: the largest divisor
    assert server.total() <= streams * (head + 8 * 1024) + 4096 < size, (server.total(), size)


def test_a_line_stream_reads_what_its_first_windows_need_first(corpus, server, tokenizer, stream_cache,
                                                               monkeypatch):
    """A JSON Lines stream reads the first LINE_FIRST_READ bytes of its unit (16 KiB of 128 KiB here)
    before its first windows, the rest when its first document is needed: 4 streams fetch 4 x 16
    KiB for their first step (8 windows of each), not 4 x 128 KiB; and 20 steps (past the first
    read) fetch the bytes of whole-unit reads, each once (a line cut by the first read's end is
    completed by the second), and give their windows and stream positions."""
    import torch
    unit_bytes, first = 128 * 1024, 16 * 1024
    data = _prepare(_spec(f"{server.url}/all.jsonl", unit_bytes=unit_bytes), tokenizer)
    step_one, windows, states, requests = {}, {}, {}, {}
    for read in (unit_bytes, first):  # whole units (as before pieces), then the first 16 KiB first
        monkeypatch.setattr("data.units.LINE_FIRST_READ", read)
        server.reset()
        batches = data.train_batches(0, 1)
        drawn = [next(batches)[0] for _ in range(B // MICRO)]
        step_one[read] = server.total()
        drawn += [next(batches)[0] for _ in range(19 * B // MICRO)]
        windows[read], states[read], requests[read] = torch.cat(drawn), batches.state(), list(server.requests)
    streams = data.spec.streams
    assert step_one[first] <= streams * (first + 1) and step_one[unit_bytes] >= streams * unit_bytes, step_one
    assert torch.equal(windows[first], windows[unit_bytes]) and states[first] == states[unit_bytes]
    # The same bytes as whole units, each once, in one more request a unit (its rest, read by step 20).
    sent = {read: sum(end - start for _, start, end in requests[read]) for read in requests}
    assert sent[first] == sent[unit_bytes] and _union_bytes(requests[first]) == _union_bytes(requests[unit_bytes])
    assert len(requests[first]) == len(requests[unit_bytes]) + streams, requests


def test_a_line_unit_in_pieces_holds_its_lines_once(tmp_path, monkeypatch):
    """A text file of lines cut by units and by the first read anywhere (inside a line, at its
    newline, a line longer than a unit, "\r\n" endings, no newline at the end): each unit's pieces
    hold the lines that start in its range, in order, as the file's own line starts say."""
    lines = [b"short", b"", b"x" * 300, b"crlf line\r", b"word " * 20, b"y" * 47, b"last, no newline"]
    blob = b"\n".join(lines * 3)
    (tmp_path / "lines.txt").write_bytes(blob)
    starts = [0] + [i + 1 for i, byte in enumerate(blob) if byte == ord("\n")]
    source = FileUnits(resolve_files(str(tmp_path / "lines.txt"), None, "train", None), "text", 64)
    for read in (1, 7, 48, 64):
        monkeypatch.setattr("data.units.LINE_FIRST_READ", read)
        for unit in source.units:
            owned = [a for a in starts if unit.start <= a < unit.stop]
            expected = [blob[a:blob.find(b"\n", a) if b"\n" in blob[a:] else len(blob)] for a in owned]
            expected = [line.decode() for part in expected for line in (part.splitlines() or [part])]
            got = [text for piece in source.text_pieces(unit) for text in piece.to_pylist()]
            assert got == expected == source.texts(unit), (read, unit)


def _prepare_on_each_rank(url: str, unit_bytes: int) -> None:
    _prepare(_spec(url, unit_bytes=unit_bytes, val_fraction=0.1), load_tokenizer("builtin"), evaluate=True)


@pytest.mark.slow  # 9 ranks in three launches (~4 CPU-s)
def test_a_line_sources_start_up_reading_is_done_once_per_node(server, tmp_path, monkeypatch):
    """A JSON Lines source's start-up reads units (the streams' size check, the validation
    windows): one process alone fetches some bytes; four ranks of a launch fetch them once between
    them, not four times; a later run on the same node fetches none (the answers are remembered
    under the units, the tokenizer and the settings)."""
    from helpers.distributed import run_distributed
    url, unit_bytes = f"{server.url}/all.jsonl", 32 * 1024
    monkeypatch.setenv("GPT3D_CACHE", str(cache_with_builtin(tmp_path / "alone")))  # each node's data cache
    server.reset()
    run_distributed(_prepare_on_each_rank, 1, url, unit_bytes)
    alone = server.total()
    assert alone > 4 * unit_bytes, alone  # several units read: a stream's check and the validation windows
    monkeypatch.setenv("GPT3D_CACHE", str(cache_with_builtin(tmp_path / "node")))
    fetched = []
    for run in (1, 2):
        server.reset()
        run_distributed(_prepare_on_each_rank, 4, url, unit_bytes)
        fetched.append(server.total())
    # Each rank still reads the first record of the file itself (its text field checked): 4 KiB.
    first_record = 4096
    assert alone - first_record < fetched[0] <= alone + 3 * first_record and fetched[1] <= 4 * first_record, \
        (alone, fetched)


WRITERS = {"snappy": {}, "uncompressed": dict(compression="NONE"), "gzip": dict(compression="GZIP"),
           "brotli": dict(compression="BROTLI"), "zstd": dict(compression="ZSTD"), "plain": dict(use_dictionary=False),
           "pages v2": dict(data_page_version="2.0"), "many pages": dict(data_page_size=256),
           "no statistics": dict(write_statistics=False), "lz4": dict(compression="LZ4")}


def test_a_unit_reads_without_its_footer_as_pyarrow_reads_it(tmp_path, stream_cache):
    """Row groups written every way pyarrow writes them (codecs, dictionary or not, page versions,
    many pages, nulls, a required large_string column, bytes without a string annotation): once
    the units are listed, each reads exactly its text chunk (no footer) and gives pyarrow's own
    texts of that row group. An LZ4 file (two framings, one name in pyarrow) reads its footer once."""
    texts = [None if i % 7 == 3 else f"doc {i} " + "word " * (i % 50) for i in range(150)]
    tables = {name: (pa.table({"id": list(range(150)), "text": texts}), kw) for name, kw in WRITERS.items()}
    required = pa.schema([pa.field("text", pa.large_string(), nullable=False)])
    tables["required"] = (pa.table({"text": [t or "" for t in texts]}, schema=required), {})
    tables["bytes"] = (pa.table({"text": [(t or "").encode() for t in texts]}), {})
    for name, (table, kw) in tables.items():
        pq.write_table(table, tmp_path / f"{name}.parquet", row_group_size=64, **kw)
    server = RangeServer(tmp_path)
    try:
        for name in tables:
            path = tmp_path / f"{name}.parquet"
            files = resolve_files(f"{server.url}/{name}.parquet", None, "train", None)
            FileUnits(files, "text", 2 ** 20)  # the listing, which reads the footer
            server.reset()
            source = FileUnits(files, "text", 2 ** 20)  # another process's: the listing from the cache
            assert len(source.units) == 3 and not server.requests, name
            for unit in source.units:
                expected = pq.ParquetFile(path).read_row_group(unit.part, columns=["text"]).column(0).to_pylist()
                assert source.texts(unit) == expected, (name, unit)
            chunks = [(f"{name}.parquet", u.start, u.stop) for u in source.units]
            footer = [r for r in server.requests if r not in chunks]
            assert sorted(set(server.requests) - set(footer)) == sorted(chunks), name
            assert len(footer) == (2 if name == "lz4" else 0), (name, footer)  # its length, then the footer
    finally:
        server.close()


JOB_DP, JOB_STEPS, JOB_FILES, JOB_GROUP_ROWS = 8, 20, 8, 200  # 40 row groups of 200 documents


@pytest.fixture(scope="module")
def job_server(tmp_path_factory):
    """Larger row groups than `corpus`'s: footers a few percent of the bytes, as in real data."""
    yield from served(write_corpus(tmp_path_factory.mktemp("job"), N_DOCS, JOB_FILES, JOB_GROUP_ROWS))


def _train_on_each_rank(url: str, caches: str, out: str, pp: int, cp: int) -> None:
    """One rank of a job at pp x cp x dp, on a node of its own (its own data cache): it prepares
    the run's data and draws JOB_STEPS steps of micro-batches as the training loop does
    (launch/trainer/loop.py): its dp rank's batches, fed through its replica's reader
    (replica_reader_groups decides who reads; the others receive the reader's broadcasts). At pp 2
    both stages draw (DeepSpeed's pipeline loads the inputs on the first, the labels on the last),
    and each CP rank draws whole micro-batches (then keeps its sequence shard). It writes its dp
    rank and the documents its windows hold."""
    import os
    from pathlib import Path

    import torch

    from launch.feed.replica_reader import replica_reader_groups
    from model.parallel.state import init_parallel_state
    rank = int(os.environ["RANK"])
    # The tokenizer from the test's cache (the module's fixture built it), before the node's own
    # data cache: training the builtin BPE afresh on each of 8 nodes cost 5 CPU-s a rank, and the
    # store never sees it (it is built from the Python's own text).
    tokenizer = load_tokenizer("builtin")
    os.environ["GPT3D_CACHE"] = f"{caches}/node{rank}"
    state = init_parallel_state(1, pp, cp)
    data = _prepare(_spec(url, streams=None), tokenizer)
    batches = data.train_batches(state.dp_rank, state.dp_size)
    drawn = data.feed(batches, *replica_reader_groups(state, data.streamed), torch.device("cpu"))
    windows = [x for _ in range(JOB_STEPS * B // state.dp_size // MICRO) for x in next(drawn)[0]]
    Path(out, f"rank{rank}.json").write_text(json.dumps({"dp": state.dp_rank,
                                                         "docs": sorted(window_ids(tokenizer, windows))}))


def _union_bytes(requests) -> int:
    """Bytes of the union of the requested ranges, file by file."""
    total, by_file = 0, {}
    for name, start, end in requests:
        by_file.setdefault(name, []).append((start, end))
    for ranges in by_file.values():
        reach = -1
        for start, end in sorted(ranges):
            total += max(0, end - max(start, reach))
            reach = max(reach, end)
    return total


@pytest.mark.slow  # 8 processes (~4 CPU-s each layout); the fast tier's 4 ranks list the units once per job
@pytest.mark.parametrize("pp,cp", [(1, 1), (2, 2)], ids=["dp8", "pp2-cp2-dp2"])
def test_a_job_of_separate_processes_fetches_each_byte_once(pp, cp, job_server, tokenizer, tmp_path):
    """Eight ranks, each a process on a node of its own sharing nothing but the job's rendezvous
    store, train JOB_STEPS steps (a stream per sample) at dp 8, and at pp 2 x cp 2 x dp 2, where
    the runtime's wiring lets one rank of each replica's four read: the server sends each byte
    once (footers included: the unit table, with what a read needs of each row group, is built by
    rank 0 alone) and about what the ranks train. Were every stage or CP rank to read, each unit
    would be sent 2 or 4 times."""
    from helpers.distributed import run_distributed
    server, layout = job_server, ParquetLayout(job_server.root, JOB_FILES, JOB_GROUP_ROWS)
    server.reset()
    run_distributed(_train_on_each_rank, JOB_DP, f"{server.url}/part*.parquet", str(tmp_path / "caches"),
                    str(tmp_path), pp, cp)
    requests = list(server.requests)
    assert all(r in layout.chunks or layout.is_footer(*r) for r in requests), requests
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(JOB_DP)]
    for got in ranks:  # every rank of a replica drew its reader's windows
        assert got["docs"] == next(r["docs"] for r in ranks if r["dp"] == got["dp"]), got["dp"]
    trained = set().union(*({layout.unit_of_document(i) for i in got["docs"]} for got in ranks))
    sent, distinct = sum(end - start for _, start, end in requests), _union_bytes(requests)
    footers = sum(end - start for r in requests if r not in layout.chunks for (_, start, end) in [r])
    print(f"sent / distinct {sent / distinct:.3f}, sent / trained {sent / layout.bytes_of(trained):.3f}")
    assert footers == layout.all_footers(), (footers, layout.all_footers())  # each once in the job, by rank 0
    assert sent <= 1.1 * distinct, (sent, distinct)
    assert sent <= READ_BOUND * layout.bytes_of(trained), (sent, layout.bytes_of(trained))
