"""Streaming data on a local multi-shard parquet dataset: the held-out documents never train
and do not move with shuffling, epochs or streams; resume from a position is exact; the
samples of a step do not depend on dp; bad streaming data fails before training."""
import json
import re
import shutil
from pathlib import Path

import datasets
import numpy as np
import pytest

from data.builtin import builtin_corpus, load_tokenizer
from data.cache import default_cache_dir
from data.run import prepare_run_data
from data.spec import DataError, DataSpec
from data.streaming import merge_states
from launcher import TINY, launch_forked, read_metrics
from stream_steps import windows_per_step

N_DOCS, N_FILES = 400, 5
ID = re.compile(r"w(\d+)x")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("builtin")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """N_DOCS documents in N_FILES parquet shards; document i says `w{i}x` every few words,
    so any window that holds a few tokens of it names it."""
    root = tmp_path_factory.mktemp("corpus")
    filler = builtin_corpus().select(range(40))["text"]
    texts = [" ".join(f"w{i}x {word}" for word in filler[i % 40].split()[: 5 + i % 17]) for i in range(N_DOCS)]
    per_file = N_DOCS // N_FILES
    for f in range(N_FILES):
        datasets.Dataset.from_dict({"text": texts[f * per_file:(f + 1) * per_file],
                                    "id": list(range(f * per_file, (f + 1) * per_file))}
                                   ).to_parquet(str(root / f"part{f}.parquet"))
    return root


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr("data.windows.default_cache_dir", lambda: tmp_path / "cache")


def _ids(tokenizer, windows) -> set:
    return {int(m) for w in windows for m in ID.findall(tokenizer.decode(list(w)))}


def _spec(corpus, **kw):
    return DataSpec(**{"name": str(corpus / "part*.parquet"), "streaming": True, "val_fraction": 0.1,
                       "streams": 4, "shuffle_buffer": 8, **kw})


def _steps(data, dp, steps, start=0, data_state=None):
    """[(step's windows, sorted)] over every dp rank, and the merged stream states after the last step."""
    per_step, states = windows_per_step(data, dp, steps, start, data_state)
    return [sorted(s) for s in per_step], merge_states(states, data.spec.streams)


def test_validation_never_trains_and_stays_put(corpus, tokenizer, cache):
    B = 16
    data = prepare_run_data(_spec(corpus), tokenizer, 15, seed=1, global_batch_size=B, micro_batch_size=2,
                            evaluate=True, eval_batches=2)
    val_ids = _ids(tokenizer, data.val_windows)
    assert 0 < len(val_ids) < N_DOCS // 5
    # The map-style pipeline, reading the files whole, holds out the same documents (all of them).
    mapped = prepare_run_data(DataSpec(name=str(corpus / "part*.parquet"), val_fraction=0.1), tokenizer, 15,
                              seed=1, global_batch_size=B, micro_batch_size=2, evaluate=False)
    held_out = _ids(tokenizer, mapped.val_windows)
    assert val_ids <= held_out and len(held_out) < N_DOCS // 5
    # Three epochs of shuffled shards and blocks, at dp=2 (reads 2 of the 4 streams per rank).
    windows_per_epoch = len(mapped.train_windows)
    steps, _ = _steps(data, 2, 3 * windows_per_epoch // B + 1)
    trained = [_ids(tokenizer, [w[:-1] for w in step]) for step in steps]
    seen = set().union(*trained)
    assert not seen & held_out
    assert seen | held_out == set(range(N_DOCS))  # and everything else trains
    # The same validation windows with another seed, another stream count and the files in
    # another order (a dataset whose shards are listed the other way round).
    files = sorted(corpus.glob("part*.parquet"), reverse=True)
    for kw in ({"streams": 2}, {"shuffle": False}):
        again = prepare_run_data(_spec(corpus, **kw), tokenizer, 15, seed=7, global_batch_size=B,
                                 micro_batch_size=2, evaluate=True, eval_batches=2)
        assert np.array_equal(again.val_windows, data.val_windows)
    reordered = datasets.load_dataset("parquet", data_files=[str(f) for f in files], split="train")
    reordered.save_to_disk(str(corpus.parent / "reordered"))
    other = prepare_run_data(_spec(corpus.parent, name=str(corpus.parent / "reordered"), streams=2), tokenizer,
                             15, seed=3, global_batch_size=B, micro_batch_size=2, evaluate=True, eval_batches=2)
    assert _ids(tokenizer, other.val_windows) <= held_out


def test_samples_of_a_step_do_not_depend_on_dp(corpus, tokenizer, cache):
    data = prepare_run_data(_spec(corpus), tokenizer, 15, seed=1, global_batch_size=16, micro_batch_size=2,
                            evaluate=False)
    reference, _ = _steps(data, 1, 6)
    for dp in (2, 4, 8):  # 8 > 4 streams: two ranks share a stream
        assert _steps(data, dp, 6)[0] == reference, dp
    assert len({w for step in reference for w in step}) == 6 * 16  # no window twice within the epoch


def test_resume_from_a_position_is_exact_at_any_dp(corpus, tokenizer, cache):
    data = prepare_run_data(_spec(corpus), tokenizer, 63, seed=1, global_batch_size=32, micro_batch_size=4,
                            evaluate=False)
    uninterrupted, end = _steps(data, 2, 45)
    assert min(s["block"][0] for s in end["streams"].values()) >= 2  # epochs ended on the way
    for stop, dp_before, dp_after in ((7, 2, 2), (17, 2, 1), (23, 1, 4)):  # 17: inside a block
        _, state = _steps(data, dp_before, stop)
        assert state["step"] == stop
        resumed, _ = _steps(data, dp_after, 45 - stop, start=stop, data_state=state)
        assert resumed == uninterrupted[stop:], (stop, dp_before, dp_after)


@pytest.mark.parametrize("rows,words", [
    ([], ["empty"]),
    ([{"text": "a b"}] * 3, ["windows of seq_len+1 = 16", "fewer than its share", "16/4 = 4", "data.streams"]),
    ([{"body": "text"}] * 3, ["data.text_field='text'", "columns: body"]),
])
def test_bad_streaming_data_fails_before_training(rows, words, tokenizer, cache, tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError) as e:
        prepare_run_data(DataSpec(name=str(path), streaming=True, streams=4), tokenizer, 15, 0, 16, 2,
                         evaluate=False)
    for word in words:
        assert word in str(e.value), str(e.value)


def test_bad_streaming_data_is_one_line_and_exit_2(corpus, tmp_path, monkeypatch, capsys):
    """launch/train.py's main, in this process (tests/test_errors.py: a real process prints only the line)."""
    from launch.train import main
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    (tmp_path / "short.jsonl").write_text('{"text": "too short for a window"}\n')
    for name, words in ((str(tmp_path / "short.jsonl"), ["fewer than its share"]),
                        (str(corpus / "part*.parquet"), ["validation data gives", "train.eval_batches"])):
        assert main(["--recipe", str(TINY), "--set", f"data.name={name}", "--set", "data.streaming=true",
                     "--set", "train.eval_batches=1000"]) == 2, name
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and all(w in err for w in words), err


@pytest.mark.slow
def test_streaming_run_resumes_exactly_and_matches_one_process(corpus, tmp_path):
    """Through launch/train.py: dp=2 streaming 5 steps with a save after step 3; the same run
    on one process and at tp=2 (TP rank 0 reads, its peer receives) (layout parity); and dp=2
    resumed from step 3 (bit for bit)."""
    common = ["--recipe", str(TINY), "--steps", "5", "--set", f"data.name={corpus / 'part*.parquet'}",
              "--set", "data.streaming=true", "--set", "data.streams=4", "--set", "data.shuffle_buffer=8"]
    runs = {}
    for name, procs, extra in (("dp2", 2, ["--save", str(tmp_path / "ck"), "--save-every", "3"]),
                               ("one", 1, []),
                               ("tp2", 2, ["--tp", "2"]),
                               ("resumed", 2, ["--load", str(tmp_path / "ck" / "step00000003")])):
        out = tmp_path / f"{name}.jsonl"
        proc = launch_forked(procs, common + extra + ["--metrics-out", str(out)])
        assert proc.returncode == 0, (name, proc.stdout[-3000:], proc.stderr[-3000:])
        runs[name] = read_metrics(out)
    dp2, one, resumed = runs["dp2"], runs["one"], runs["resumed"]
    assert [r["step"] for r in dp2] == [1, 2, 3, 4, 5] and [r["step"] for r in resumed] == [4, 5]
    for other in (dp2, runs["tp2"]):
        assert len(other) == len(one)
        for a, b in zip(other, one):
            for key in ("loss", "grad_norm", "val_loss"):
                if key in a or key in b:
                    assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), (key, a, b)
    for a, b in zip(dp2[3:], resumed):
        assert (a["loss"], a["grad_norm"], a.get("val_loss")) == (b["loss"], b["grad_norm"], b.get("val_loss"))
    meta = json.loads((tmp_path / "ck" / "step00000003" / "complete.json").read_text())
    assert meta["data_state"]["step"] == 3 and sorted(meta["data_state"]["streams"]) == ["0", "1", "2", "3"]


def test_each_window_starts_where_its_position_says(corpus, tokenizer):
    """The position a resume reopens: row r of shard p, token t, is the window's first token."""
    from data.pipeline import train_source
    from data.streaming import START, packed_windows, shard_order, stream_documents
    source = train_source(_spec(corpus))
    docs = stream_documents(source, 1, 2, seed=0, shuffle=True, start=START, epochs=1)
    order, shard_rows, n = shard_order(len(source.shards), 0, 0, True), {}, 0
    for (epoch, place, row, token), w in packed_windows(docs, tokenizer, 16):
        if w is None:
            break
        rows = shard_rows.setdefault(place, list(source.shards[order[place]]))  # read whole, independently
        n += token > 0
        ids = tokenizer(rows[row]["text"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        head = ids[token:token + 16]
        assert row % 2 == 1 and list(w[:len(head)]) == head, (place, row, token)
    assert n > 100  # most windows start inside a document


def _tp_feed_body(corpus_dir: str):
    """tp=2 on 2 gloo processes: TP rank 0 reads, rank 1 only receives (its own stream object
    stays at step 0); both get exactly the micro-batches one reader produces alone."""
    import torch
    import torch.distributed as dist
    tokenizer = load_tokenizer("builtin")
    spec = _spec(Path(corpus_dir))
    data = prepare_run_data(spec, tokenizer, seq_len=16, seed=0, global_batch_size=8, micro_batch_size=2,
                            evaluate=False)
    batches = data.train_batches(0, 1)
    feed = data.feed(batches, dist.group.WORLD, torch.device("cpu"))
    got = [next(feed) for _ in range(6)]  # 1.5 steps of 4 micro-batches
    alone = data.train_batches(0, 1)
    for (x, y), (x_ref, y_ref) in zip(got, (next(alone) for _ in range(6))):
        assert torch.equal(x, x_ref) and torch.equal(y, y_ref)
    assert batches.state()["step"] == (1 if dist.get_rank() == 0 else 0)  # rank 1 read nothing


def test_tp_peers_read_once_and_share(corpus, tmp_path, monkeypatch):
    from distributed import run_distributed
    # A data cache of the test's own, with the shared builtin tokenizer copied in (not trained again).
    for entry in default_cache_dir().iterdir():
        if entry.name.startswith(("builtin-bpe", "builtin-corpus")):
            shutil.copytree(entry, tmp_path / "cache" / entry.name)
    monkeypatch.setenv("GPT3D_CACHE", str(tmp_path / "cache"))
    run_distributed(_tp_feed_body, 2, str(corpus))
