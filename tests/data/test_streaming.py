"""Streaming data by units, on local parquet, JSON Lines and text files and on the same
files over HTTP (tests/helpers/range_server.py, which counts the bytes it sends): units read every
document once; held-out units never train and do not move with shuffling, epochs, streams or
the files' location; the samples of a step do not depend on dp; a resume from a position is
exact; reading ahead changes nothing; bad data fails before training in one line."""
import json
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from data.builtin import load_tokenizer
from data.run import prepare_run_data
from data.spec import DataError, DataSpec
from data.streaming import merge_states
from data.units import Unit, UnitSource, UnitTable
from helpers.builtin_cache import cache_with_builtin
from helpers.launcher import TINY, launch_forked, read_metrics
from helpers.stream_corpus import document_texts, served, window_ids, write_corpus
from helpers.stream_steps import windows_per_step

N_DOCS, N_FILES, GROUP_ROWS = 400, 5, 8  # 50 units of 8 documents


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("builtin")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"), N_DOCS, N_FILES, GROUP_ROWS)


@pytest.fixture(scope="module")
def server(corpus):
    yield from served(corpus)


def _spec(name, **kw):
    return DataSpec(**{"name": str(name), "streaming": True, "val_fraction": 0.1, "streams": 4, "shuffle_buffer": 8,
                       **kw})


def _steps(data, dp, steps, start=0, data_state=None):
    """[(step's windows, sorted)] over every dp rank, and the merged stream states after the last step."""
    per_step, states = windows_per_step(data, dp, steps, start, data_state)
    return [sorted(s) for s in per_step], merge_states(states, data.spec.streams)


def _held_out_groups(tokenizer, data, dp=2, epochs=3):
    """(row groups some training window holds, documents trained) over `epochs` epochs."""
    B = data.global_batch_size
    per_epoch = (N_DOCS * 50) // (16 * B)  # generous: documents average under 50 tokens
    steps, _ = _steps(data, dp, epochs * per_epoch)
    seen = set().union(*(window_ids(tokenizer, [w[:-1] for w in step]) for step in steps))
    return {(i // (N_DOCS // N_FILES), i % (N_DOCS // N_FILES) // GROUP_ROWS) for i in seen}, seen


def test_validation_holds_out_whole_units_that_never_train(corpus, server, tokenizer, stream_cache):
    B = 16
    data = prepare_run_data(_spec(corpus / "part*.parquet"), tokenizer, 15, seed=1, global_batch_size=B,
                            micro_batch_size=2, evaluate=True, eval_batches=2)
    val_ids = window_ids(tokenizer, data.val_windows)
    trained_groups, trained = _held_out_groups(tokenizer, data)
    all_groups = {(f, g) for f in range(N_FILES) for g in range(N_DOCS // N_FILES // GROUP_ROWS)}
    held = all_groups - trained_groups
    assert len(held) == 5  # ceil(0.1 x 50 units)
    assert not val_ids & trained  # validation documents never train...
    per_file = N_DOCS // N_FILES
    assert {(i // per_file, i % per_file // GROUP_ROWS) for i in val_ids} <= held  # ...and come from held-out units
    assert trained | {i for i in range(N_DOCS) if (i // per_file, i % per_file // GROUP_ROWS) in held} \
        == set(range(N_DOCS))  # everything else trains
    # The same validation windows with another seed, other streams, no shuffle, and over HTTP.
    for name, kw in ((corpus / "part*.parquet", {"streams": 2}), (corpus / "part*.parquet", {"shuffle": False}),
                     (f"{server.url}/part*.parquet", {})):
        again = prepare_run_data(_spec(name, **kw), tokenizer, 15, seed=7, global_batch_size=B,
                                 micro_batch_size=2, evaluate=True, eval_batches=2)
        assert np.array_equal(again.val_windows, data.val_windows), (name, kw)


def test_units_read_every_document_once(corpus, server, tokenizer, stream_cache):
    """Against pyarrow's reading of the whole files and Python's reading of the lines."""
    from data.prepare_source import unit_source
    texts = document_texts(N_DOCS)
    for name, unit_bytes in ((corpus / "part*.parquet", 1), (f"{server.url}/part*.parquet", 1),
                             (corpus / "all.jsonl", 1000), (f"{server.url}/all.jsonl", 777),
                             (corpus / "all.jsonl", 10 ** 9)):
        units = unit_source(_spec(name, unit_bytes=unit_bytes), "train")
        got = [t for u in units.units for t in units.texts(u)]
        assert got == texts, (name, unit_bytes)
    lines = corpus / "lines.txt"
    lines.write_text("first\n\nthird line\nno newline at the end")
    units = unit_source(_spec(lines, unit_bytes=4), "train")
    assert [t for u in units.units for t in units.texts(u)] == lines.read_text().splitlines()
    assert len(units.units) == -(-lines.stat().st_size // 4)


def test_samples_of_a_step_do_not_depend_on_dp(corpus, tokenizer, stream_cache):
    data = prepare_run_data(_spec(corpus / "part*.parquet"), tokenizer, 15, seed=1, global_batch_size=16,
                            micro_batch_size=2, evaluate=False)
    reference, _ = _steps(data, 1, 6)
    for dp in (2, 4, 8):  # 8 > 4 streams: two ranks share a stream
        assert _steps(data, dp, 6)[0] == reference, dp
    assert len({w for step in reference for w in step}) == 6 * 16  # no window twice within the epoch
    inline = prepare_run_data(_spec(corpus / "part*.parquet", read_ahead_steps=0), tokenizer, 15, seed=1,
                              global_batch_size=16, micro_batch_size=2, evaluate=False)
    assert _steps(inline, 2, 6) == _steps(data, 2, 6)  # reading ahead: the same batches and positions


class GatedUnits(UnitSource):
    """Units of 40 short documents; a read of any unit from `open_units` on waits for `gate` (up to
    GATE_S seconds, then it is recorded in `waited`)."""
    label = "gated"
    GATE_S = 10.0

    def __init__(self, n: int, open_units: int):
        self.units, self.open_units = UnitTable.of(Unit(0, i, i, i + 1) for i in range(n)), open_units
        self.gate, self.waited = threading.Event(), []

    def texts(self, unit: Unit):
        if unit.part >= self.open_units and not self.gate.wait(self.GATE_S):
            self.waited.append(unit.part)
        return [f"unit {unit.part} document {d} says " * 4 for d in range(40)]


def test_the_first_micro_batch_waits_only_for_its_streams(tokenizer, monkeypatch):
    """64 streams (one per sample) at dp 1 in micro-batches of 8: the first micro-batch is drawn
    while the reads of streams 8-63 still wait on a gate (its slots are streams 0-7's), where
    waiting for every stream's first block made the time to the first batch grow with B/dp; the
    step's micro-batches are those of streams opened one at a time, at their first draw."""
    import torch
    from data.streaming import StreamingBatches, StreamSource, stream_windows

    def step(units, threads):
        monkeypatch.setattr("data.streaming.OPEN_THREADS", threads)
        source = StreamSource(units, units.units)
        batches = StreamingBatches(lambda stream, state: stream_windows(source, tokenizer, 16, 1, False, 4, stream,
                                                                        64, state), 64, 64, 8, 0, 1, 0, {}, 0)
        try:
            first = next(batches)
            waiting = not units.gate.is_set() and not units.waited
            units.gate.set()
            return waiting, [first] + [next(batches) for _ in range(7)]
        finally:
            batches.close()

    gated = GatedUnits(64, 8)
    waiting, drawn = step(gated, 16)
    assert waiting, gated.waited  # the first micro-batch came while streams 8-63 could not read
    _, alone = step(GatedUnits(64, 64), 1)
    assert all(torch.equal(a, b) for pair, pair_alone in zip(drawn, alone) for a, b in zip(pair, pair_alone))


def test_resume_from_a_position_is_exact_at_any_dp(corpus, tokenizer, stream_cache):
    data = prepare_run_data(_spec(corpus / "part*.parquet"), tokenizer, 63, seed=1, global_batch_size=32,
                            micro_batch_size=4, evaluate=False)
    uninterrupted, end = _steps(data, 2, 45)
    assert min(s["block"][0] for s in end["streams"].values()) >= 2  # epochs ended on the way
    for stop, dp_before, dp_after in ((7, 2, 2), (17, 2, 1), (23, 1, 4)):  # 17: inside a block
        _, state = _steps(data, dp_before, stop)
        assert state["step"] == stop
        resumed, _ = _steps(data, dp_after, 45 - stop, start=stop, data_state=state)
        assert resumed == uninterrupted[stop:], (stop, dp_before, dp_after)


def test_each_window_starts_where_its_position_says(corpus, tokenizer, stream_cache):
    """The position a resume reopens: epoch e, the k-th unit of the stream's list, row r, token t,
    is the window's first token (the row read here by pyarrow from the whole file)."""
    from data.prepare_source import stream_sources
    from data.streaming import START, packed_windows, stream_documents, stream_units
    source, _ = stream_sources(_spec(corpus / "part*.parquet"))
    docs = stream_documents(source, 1, 2, seed=0, shuffle=True, start=START, epochs=1)
    mine, n = stream_units(len(source.units), 1, 2, 0, 0, True), 0
    tables = {}  # each file read once (a read per window was 1.5 of the test's 2.4 s)
    for (epoch, place, row, token), w in packed_windows(docs, tokenizer, 16):
        if w is None:
            break
        unit = source.units[mine[place]]
        name = source.reader.files.names[unit.file]
        if name not in tables:
            tables[name] = pq.read_table(corpus / name)
        text = tables[name].column("text")[unit.part * GROUP_ROWS + row].as_py()
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        head = ids[token:token + 16]
        n += token > 0
        assert list(w[:len(head)]) == head, (place, row, token)
    assert n > 50  # most windows start inside a document


@pytest.mark.parametrize("rows,words", [
    ([], ["empty"]),
    ([{"text": "a b"}] * 3, ["1 training unit(s)", "fewer than data.streams=4", "data.unit_bytes"]),
    ([{"text": "a b"}] * 30, ["windows of seq_len+1 = 16", "fewer than its share", "16/4 = 4", "data.streams"]),
    ([{"body": "text"}] * 3, ["data.text_field='text'", "columns: body"]),
])
def test_bad_streaming_data_fails_before_training(rows, words, tokenizer, stream_cache, tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError) as e:
        prepare_run_data(DataSpec(name=str(path), streaming=True, streams=4, unit_bytes=40 if len(rows) > 3 else 10 ** 6),
                         tokenizer, 15, 0, 16, 2, evaluate=False)
    for word in words:
        assert word in str(e.value), str(e.value)


def test_bad_sources_are_one_line_without_credentials(corpus, server, tokenizer, stream_cache):
    cases = [("az://bucket/corpus/*.parquet", ["needs adlfs", "pip install adlfs"]),  # s3fs is installed (checkpoints)
             (f"{server.url}/missing.parquet", ["no such file", "missing.parquet"]),
             (f"http://user:secret@{server.url[7:]}/part0.parquet", ["carries credentials", "environment"]),
             (f"{server.url}/part0.parquet?token=abc", ["carries credentials", "environment"]),
             (f"{server.url}/part*.csv", ["matches no file"]),
             (f"{server.url}/corpus", ["name a file or a glob"])]
    for name, words in cases:
        with pytest.raises(DataError) as e:
            spec = _spec(name)
            spec.validate()
            prepare_run_data(spec, tokenizer, 15, 0, 16, 2, evaluate=False)
        message = str(e.value)
        assert all(w in message for w in words) and "secret" not in message and "token=" not in message, message
        assert "\n" not in message


def test_bad_streaming_data_is_one_line_and_exit_2(corpus, tmp_path, monkeypatch, capsys):
    """launch/train.py's main, in this process (tests/runtime/test_errors.py: a real process prints only the line)."""
    from launch.train import main
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    (tmp_path / "short.jsonl").write_text('{"text": "too short for a window"}\n' * 8)
    for name, words in ((str(tmp_path / "short.jsonl"), ["fewer than its share"]),
                        (str(corpus / "part*.parquet"), ["validation data gives", "train.eval_batches"])):
        assert main(["--recipe", str(TINY), "--set", f"data.name={name}", "--set", "data.streaming=true",
                     "--set", "data.unit_bytes=64", "--set", "data.val_fraction=0.1",
                     "--set", "train.eval_batches=1000"]) == 2, name
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and all(w in err for w in words), err


def test_a_read_ahead_failure_reaches_the_trainer(corpus, server, tokenizer, stream_cache):
    """The worker's error is raised by the trainer's next draw (a storage outage after 3 reads),
    not a hang; and the draws before it were the data's own."""
    data = prepare_run_data(_spec(f"{server.url}/part*.parquet", val_fraction=0, read_ahead_steps=2), tokenizer,
                            15, seed=1, global_batch_size=16, micro_batch_size=2, evaluate=False)
    server.reset()
    server.fail_after = 3
    try:
        batches = data.train_batches(0, 1)
        start = time.monotonic()
        with pytest.raises(DataError, match="reading bytes .* failed"):
            for _ in range(10_000):
                next(batches)
        assert time.monotonic() - start < 60
    finally:
        server.fail_after = None


def _tp_feed_body(corpus_dir: str):
    """tp=2 on 2 gloo processes: TP rank 0 reads, rank 1 only receives (its own stream object
    stays at step 0); both get exactly the micro-batches one reader produces alone."""
    import torch
    import torch.distributed as dist
    tokenizer = load_tokenizer("builtin")
    data = prepare_run_data(_spec(Path(corpus_dir) / "part*.parquet"), tokenizer, seq_len=16, seed=0,
                            global_batch_size=8, micro_batch_size=2, evaluate=False)
    batches = data.train_batches(0, 1)
    feed = data.feed(batches, [dist.group.WORLD], dist.get_rank() == 0, torch.device("cpu"))
    got = [next(feed) for _ in range(6)]  # 1.5 steps of 4 micro-batches
    alone = data.train_batches(0, 1)
    for (x, y), (x_ref, y_ref) in zip(got, (next(alone) for _ in range(6))):
        assert torch.equal(x, x_ref) and torch.equal(y, y_ref)
    assert batches.state()["step"] == (1 if dist.get_rank() == 0 else 0)  # rank 1 read nothing


def test_tp_peers_read_once_and_share(corpus, tmp_path, monkeypatch):
    from helpers.distributed import run_distributed
    monkeypatch.setenv("GPT3D_CACHE", str(cache_with_builtin(tmp_path / "cache")))
    run_distributed(_tp_feed_body, 2, str(corpus))


@pytest.mark.slow
def test_streaming_run_over_http_resumes_exactly_and_matches_one_process(corpus, server, tmp_path, monkeypatch,
                                                                        capsys):
    """Through launch/train.py, reading the corpus over HTTP: dp=2 streaming 5 steps with a save
    after step 3; the same run on one process, at tp=2 cp=2 (TP rank 0 reads, its TP and CP peers
    receive) and at pp=2 cp=2 (layout parity); dp=2 resumed from step 3 (bit for bit); and a run
    whose storage fails mid-run ends with the reading rank's one line."""
    common = ["--recipe", str(TINY), "--steps", "5", "--set", f"data.name={server.url}/part*.parquet",
              "--set", "data.streaming=true", "--set", "data.streams=4", "--set", "data.shuffle_buffer=8"]
    runs, fetched = {}, {}
    for name, procs, extra in (("dp2", 2, ["--save", str(tmp_path / "ck"), "--save-every", "3"]),
                               ("one", 1, []),
                               # Context parallelism: the CP ranks of a replica read the same samples
                               # (each its sequence shard), TP rank 0 of each reading for its TP peer.
                               ("tp2-cp2", 4, ["--tp", "2", "--cp", "2"]),
                               # One reader per replica: the last stage and the CP
                               # peers receive the micro-batches from the first stage's reader.
                               ("pp2-cp2", 4, ["--pp", "2", "--cp", "2"]),
                               ("resumed", 2, ["--load", str(tmp_path / "ck" / "step00000003")])):
        out = tmp_path / f"{name}.jsonl"
        server.reset()
        proc = launch_forked(procs, common + extra + ["--metrics-out", str(out)])
        assert proc.returncode == 0, (name, proc.stdout[-3000:], proc.stderr[-3000:])
        runs[name], fetched[name] = read_metrics(out), server.total()
    dp2, one, resumed = runs["dp2"], runs["one"], runs["resumed"]
    assert [r["step"] for r in dp2] == [1, 2, 3, 4, 5] and [r["step"] for r in resumed] == [4, 5]
    assert all(0 <= r["data_wait_s"] < r["step_time_s"] for r in dp2)  # a part of the step, measured
    # One replica's 5 steps are read once whatever its layout (after the first run, dp2, the
    # validation windows and stream checks come from the data cache): a reader per rank would read
    # 2x at cp 2 and 4x at pp 2 x cp 2 what one process reads.
    for name in ("tp2-cp2", "pp2-cp2"):
        assert fetched[name] <= 1.1 * fetched["one"], (name, fetched)
    for other in (dp2, runs["tp2-cp2"], runs["pp2-cp2"]):
        assert len(other) == len(one)
        for a, b in zip(other, one):
            for key in ("loss", "grad_norm", "val_loss"):
                if key in a or key in b:
                    assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), (key, a, b)
    for a, b in zip(dp2[3:], resumed):
        assert (a["loss"], a["grad_norm"], a.get("val_loss")) == (b["loss"], b["grad_norm"], b.get("val_loss"))
    meta = json.loads((tmp_path / "ck" / "step00000003" / "complete.json").read_text())
    assert meta["data_state"]["step"] == 3 and sorted(meta["data_state"]["streams"]) == ["0", "1", "2", "3"]
    _resume_with_other_data_is_refused(corpus, common, tmp_path, monkeypatch, capsys)
    server.reset()
    server.fail_after = 6  # the start-up reads (footers, validation) succeed, training's fail
    try:
        proc = launch_forked(1, common + ["--steps", "50"])
    finally:
        server.fail_after = None
    errors = [line for line in proc.stderr.splitlines() if "reading bytes" in line]
    assert proc.returncode != 0 and len(errors) == 1 and "500" in errors[0], proc.stderr[-3000:]


def _resume_with_other_data_is_refused(corpus, common, tmp_path, monkeypatch, capsys):
    """The step-3 checkpoint's data fingerprint against a resume whose data
    deals other samples: a shuffle block of 16, a file added to the glob; a revision for a URL.
    Each is one line, exit 2, naming the change, before any process starts (launch/train.py's main
    in this process).
    --restart-data then trains, its data order begun again at step 4."""
    from launch.train import main
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")  # the saved layout: only the data differs
    ck = str(tmp_path / "ck" / "step00000003")
    added = corpus / "part9.parquet"
    shutil.copy(corpus / "part0.parquet", added)
    try:
        for extra, words in ((["--set", "data.shuffle_buffer=16"], "data.shuffle_buffer was 8, now 16; "),
                             # A URL names its files: a revision is refused before the fingerprint is read
                             # (a hub id's revision: tests/data/test_data_fingerprint.py).
                             (["--set", "data.revision=v2"], "data.revision='v2' apply to a hub dataset id"),
                             ([], "data.files: 1 added (part9.parquet); its data ")):
            capsys.readouterr()
            code = main(common + extra + ["--load", ck])
            err = capsys.readouterr().err
            assert code == 2 and err.count("\n") == 1 and words in err, (extra, err)
        monkeypatch.delenv("RANK")
        monkeypatch.delenv("WORLD_SIZE")
        out = tmp_path / "restarted.jsonl"
        proc = launch_forked(2, common + ["--load", ck, "--restart-data", "--save", str(tmp_path / "ck2"),
                                          "--metrics-out", str(out)])
    finally:
        added.unlink()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in read_metrics(out)] == [4, 5]
    meta = json.loads((tmp_path / "ck2" / "step00000005" / "complete.json").read_text())
    # The run's samples go on (5 steps of 16); the data's own position counts from step 4 (2 steps).
    assert meta["samples"] == 5 * 16 and meta["data_origin_samples"] == 3 * 16 and meta["data_state"]["step"] == 2
    assert [entry[0] for entry in meta["data_fingerprint"]["data.files"]][-1] == "part9.parquet"
