"""The data pipeline on local data only: formats, cache, packing, sharding, resume, streaming."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data.builtin import builtin_corpus, load_tokenizer
from data.run import prepare_run_data
from data.sampler import micro_batches
from data.spec import DataError, DataSpec
from data.windows import prepare_streams, windows
from helpers.builtin_cache import cache_with_builtin
from helpers.distributed import run_distributed
from helpers.launcher import REPO, TINY, launch_forked

N_DOCS = 60


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("builtin")


@pytest.fixture(scope="module")
def docs():
    """Real text: the first documents of the embedded corpus."""
    return builtin_corpus().select(range(N_DOCS))


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty data cache (the builtin tokenizer stays in the shared one)."""
    from data import cache
    shared = cache.default_cache_dir()
    monkeypatch.setattr("data.windows.default_cache_dir", lambda: tmp_path / "cache")
    return shared


def _write_formats(docs, root):
    """The same documents as .jsonl, .parquet, .csv and a save_to_disk directory."""
    docs.to_json(root / "docs.jsonl")
    docs.to_parquet(root / "docs.parquet")
    docs.to_csv(root / "docs.csv", index=False)
    docs.save_to_disk(str(root / "saved"))
    (root / "txt").mkdir()
    for i, text in enumerate(docs["text"][:20]):  # the text builder: one row per line
        (root / "txt" / f"part{i:02d}.txt").write_text(text)
    return {"jsonl": root / "docs.jsonl", "parquet": root / "docs.parquet", "csv": root / "docs.csv",
            "saved": root / "saved", "txt": root / "txt" / "part*.txt"}


def test_windows_reproduce_the_token_stream(docs, tokenizer, fresh_cache, tmp_path):
    paths = _write_formats(docs, tmp_path)
    streams = prepare_streams(DataSpec(name=str(paths["jsonl"]), tokenizer="builtin"), tokenizer)
    expected = [t for text in docs["text"] for t in tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]]
    assert streams.train.dtype == np.uint16  # 4096-token vocabulary: two bytes a token
    assert streams.train.tolist() == expected
    w = windows(streams.train, 31)
    assert w.shape == (len(expected) // 32, 32)
    assert w.reshape(-1).tolist() == expected[: w.size]  # packed windows are the stream, in order


def test_every_local_format_gives_the_same_stream(docs, tokenizer, fresh_cache, tmp_path):
    paths = _write_formats(docs, tmp_path)
    streams = {k: prepare_streams(DataSpec(name=str(p)), tokenizer).train for k, p in paths.items()}
    for fmt in ("parquet", "csv", "saved"):
        assert np.array_equal(streams[fmt], streams["jsonl"]), fmt
    lines = [l for i in range(20) for l in (tmp_path / "txt" / f"part{i:02d}.txt").read_text().splitlines()]
    assert len(streams["txt"]) == sum(len(tokenizer(l)["input_ids"]) + 1 for l in lines if tokenizer(l)["input_ids"])


@pytest.mark.slow
def test_every_local_format_trains(docs, tmp_path):
    """A saved dataset and a text file train through launch/train.py (JSON Lines and Parquet train
    in the streaming and line-source runs of tests/data/test_streaming*.py; every format's reading
    is checked in process above)."""
    paths = _write_formats(docs, tmp_path)
    for fmt in ("saved", "txt"):
        out = tmp_path / f"{fmt}.jsonl"
        proc = launch_forked(1, ["--recipe", str(TINY), "--steps", "2", "--set", f"data.name={paths[fmt]}",
                                 "--metrics-out", str(out)], timeout=300)
        assert proc.returncode == 0, (fmt, proc.stderr[-2000:])
        records = [json.loads(l) for l in out.read_text().splitlines()]
        assert [r["step"] for r in records] == [1, 2] and "val_loss" in records[1], (fmt, records)


def _build_in_process(name, cache_dir, out_dir):
    """One of several processes (tests/helpers/distributed.py) preparing the same data at once."""
    import os

    import torch.distributed as dist
    os.environ["GPT3D_CACHE"] = str(cache_dir)
    from data.builtin import load_tokenizer as load
    from data.windows import prepare_streams as prepare
    streams = prepare(DataSpec(name=name), load("builtin"))
    (Path(out_dir) / f"rank{dist.get_rank()}.json").write_text(json.dumps([streams.built_here,
                                                                          int(streams.train.sum())]))


def _outcomes(out_dir):
    return [json.loads(path.read_text()) for path in sorted(out_dir.glob("rank*.json"))]


@pytest.mark.slow
def test_cache_is_built_once_across_processes_and_reused(docs, tmp_path, fresh_cache):
    paths = _write_formats(docs, tmp_path)
    cache_dir = cache_with_builtin(tmp_path / "shared-cache")  # only the data cache is new
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    run_distributed(_build_in_process, 4, str(paths["parquet"]), str(cache_dir), str(first))
    outcomes = _outcomes(first)
    assert sorted(built for built, _ in outcomes) == [False, False, False, True]
    assert len({checksum for _, checksum in outcomes}) == 1
    run_distributed(_build_in_process, 1, str(paths["parquet"]), str(cache_dir), str(second))
    assert _outcomes(second)[0][0] is False  # a second run reuses it
    entries = sorted(e.name for e in (cache_dir / "data").iterdir())
    assert len(entries) == 2 and entries[0].endswith(".lock"), entries  # the cache and its lock, no temporaries


def _indices(windows_arr, dp, steps, B=8, b=2, start_sample=0, seed=3):
    """{step: sorted window ids} over all dp ranks; windows hold their own id in column 0."""
    per_step = {}
    for rank in range(dp):
        it = micro_batches(windows_arr, seed, B, b, rank, dp, start_sample)
        for step in range(start_sample // B, start_sample // B + steps):
            for _ in range(B // dp // b):
                x, _ = next(it)
                per_step.setdefault(step, []).extend(x[:, 0].tolist())
    return {k: sorted(v) for k, v in per_step.items()}


def test_the_corpus_walk_finds_what_ast_walk_finds_in_its_order():
    """The builtin corpus reads each standard-library module's definitions with a walk of its own
    (statement lists only, data/builtin.py): the same nodes in ast.walk's order, on standard-library
    modules and on one with a definition in each kind of body (try, except, match, with)."""
    import ast
    import sysconfig

    from data.builtin import _definitions
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    root = Path(sysconfig.get_paths()["stdlib"])
    every_body = ("def f():\n    'f'\n    try:\n        def g(): 'g'\n    except E:\n        def h(): 'h'\n"
                  "    match x:\n        case 1:\n            class C: 'C'\n    with y:\n        async def i(): 'i'\n")
    sources = [(root / name).read_text(encoding="utf-8") for name in
               ("argparse.py", "typing.py", "asyncio/base_events.py", "json/decoder.py", "ast.py")] + [every_body]
    for source in sources:
        tree = ast.parse(source)
        assert list(_definitions(tree)) == [n for n in ast.walk(tree) if isinstance(n, kinds)], source[:60]


def test_dp_shards_are_disjoint_cover_the_epoch_and_do_not_depend_on_dp():
    n = 40  # 5 steps of 8 per epoch
    ids = np.repeat(np.arange(n)[:, None], 5, axis=1)
    reference = _indices(ids, 1, 10)
    for dp in (2, 4):
        assert _indices(ids, dp, 10) == reference  # step k's samples at any dp
    epoch0 = [i for k in range(5) for i in reference[k]]
    epoch1 = [i for k in range(5, 10) for i in reference[k]]
    assert sorted(epoch0) == sorted(epoch1) == list(range(n))  # each epoch: every window once
    assert epoch0 != epoch1  # reshuffled
    per_rank = [[next(micro_batches(ids, 3, 8, 2, r, 4))[0][:, 0].tolist()] for r in range(4)]
    assert len({i for chunk in per_rank for i in chunk[0]}) == 8  # ranks of a step are disjoint


def test_resume_from_a_sample_position_continues_exactly():
    ids = np.repeat(np.arange(40)[:, None], 5, axis=1)
    uninterrupted = _indices(ids, 2, 12)
    resumed = _indices(ids, 2, 5, start_sample=7 * 8)  # crosses the epoch boundary at step 5
    assert all(resumed[k] == uninterrupted[k] for k in range(7, 12))


def test_streaming_yields_the_same_batches_as_map_style(docs, tokenizer, fresh_cache, tmp_path):
    """Without shuffling, one stream of units in file order packs the documents as the map-style
    pipeline packs the whole file. (Validation is not compared: streaming holds out whole units,
    map-style single documents; tests/data/test_streaming.py covers streaming's validation.)"""
    paths = _write_formats(docs, tmp_path)
    spec = DataSpec(name=str(paths["jsonl"]), shuffle=False, val_fraction=0.0)
    mapped = prepare_run_data(spec, tokenizer, 31, seed=0, global_batch_size=8, micro_batch_size=2, evaluate=False)
    for unit_bytes in (10 ** 6, 97):  # one unit, and many units cut inside lines
        streamed = prepare_run_data(DataSpec(**{**spec.__dict__, "streaming": True, "unit_bytes": unit_bytes,
                                             "streams": 1}),
                                    tokenizer, 31, seed=0, global_batch_size=8, micro_batch_size=2, evaluate=False)
        for rank in range(2):
            a, b = mapped.train_batches(rank, 2, start_sample=8), streamed.train_batches(rank, 2, start_sample=8)
            for _ in range(6):
                (xa, ya), (xb, yb) = next(a), next(b)
                assert np.array_equal(xa, xb) and np.array_equal(ya, yb), unit_bytes


@pytest.mark.parametrize("setting,words", [
    ({"name": "/no/such/file.jsonl"}, ["/no/such/file.jsonl", "no such file"]),
    ({"text_field": "body"}, ["text_field='body'", "columns: text"]),
])
def test_bad_data_is_a_clear_error(setting, words, docs, tokenizer, fresh_cache, tmp_path):
    paths = _write_formats(docs, tmp_path)
    spec = DataSpec(**{"name": str(paths["jsonl"]), **setting})
    with pytest.raises(DataError) as e:
        prepare_run_data(spec, tokenizer, 31, 0, 8, 2, evaluate=False)
    for word in words:
        assert word in str(e.value)


def test_empty_and_blank_data_are_clear_errors(tokenizer, fresh_cache, tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n{"text": ""}\n')
    for name, word in (("empty.jsonl", "empty"), ("blank.jsonl", "tokenized to nothing")):
        with pytest.raises(DataError) as e:
            prepare_run_data(DataSpec(name=str(tmp_path / name)), tokenizer, 31, 0, 8, 2, evaluate=False)
        assert word in str(e.value), str(e.value)


@pytest.mark.slow  # a fresh process (the hub's offline switch is read at import): 4.5 CPU-s
def test_unknown_hub_dataset_exits_2():
    """In a fresh process with the hub offline (datasets reads that at import); a data.seq_len longer
    than the model's: tests/runtime/test_errors.py, in process."""
    for extra, words in ((["--set", "data.name=nobody/no-such-dataset"], ["nobody/no-such-dataset", "could not be loaded"]),):
        proc = subprocess.run([sys.executable, "launch/train.py", "--recipe", str(TINY)] + extra, cwd=REPO,
                              capture_output=True, text=True, timeout=300,
                              env={**__import__("os").environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
        assert proc.returncode == 2, proc.stderr
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("error: ") and all(w in last for w in words), proc.stderr
        assert "Traceback" not in proc.stderr


def test_short_training_or_validation_data_fails_before_training(docs, tokenizer, fresh_cache, tmp_path):
    """Map-style: training must hold one global batch, validation eval_batches of them."""
    paths = _write_formats(docs, tmp_path)
    spec = DataSpec(name=str(paths["jsonl"]), val_fraction=0.1)
    n_train = len(prepare_run_data(spec, tokenizer, 31, 0, 8, 2, evaluate=False).train_windows)
    with pytest.raises(DataError) as e:
        prepare_run_data(spec, tokenizer, 31, 0, n_train + 2, 2, evaluate=False)
    assert f"{n_train} windows of seq_len+1 = 32" in str(e.value) and f"({n_train + 2})" in str(e.value)
    with pytest.raises(DataError) as e:
        prepare_run_data(spec, tokenizer, 31, 0, 8, 2, evaluate=True, eval_batches=1000)
    assert "1000 x 8 = 8000" in str(e.value) and "data.val_fraction" in str(e.value)
