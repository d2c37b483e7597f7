"""Streaming validation sampled across the held-out units, not the first ones
in file order: the windows come from most of the files that hold held-out units, the same on
every build and whatever the training seed; a unit short of its share is made up by the others,
then by further units (data/prepare_source.py's validation_windows_across_units)."""
import json
from typing import List

import numpy as np
import pytest

from data.builtin import load_tokenizer
from data.prepare_source import MAX_VAL_UNITS, VAL_SEED, validation_windows_across_units, stream_sources, unit_windows
from data.run import prepare_run_data
from data.spec import DataSpec
from data.streaming import StreamSource, unit_order
from data.units import Unit, UnitSource
from helpers.stream_corpus import document_texts, window_ids

N_FILES, PER_FILE = 10, 80  # documents of ~80 tokens: a unit of 2,000 bytes holds ~50 windows of 16
SEQ_LEN, B, EVAL_BATCHES = 15, 16, 2


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("builtin")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """part{f}.jsonl holds documents [f*PER_FILE, (f+1)*PER_FILE): a window's document markers
    (helpers/stream_corpus.py) name its file."""
    root, texts = tmp_path_factory.mktemp("val_sample"), document_texts(N_FILES * PER_FILE)
    for f in range(N_FILES):
        rows = range(f * PER_FILE, (f + 1) * PER_FILE)
        (root / f"part{f}.jsonl").write_text("".join(json.dumps({"text": texts[i]}) + "\n" for i in rows))
    return root


def _spec(corpus, **kw):
    return DataSpec(**{"name": str(corpus / "part*.jsonl"), "streaming": True, "val_fraction": 0.25,
                       "unit_bytes": 2000, "streams": 2, **kw})


def _prepare(corpus, tokenizer, seed=1):
    return prepare_run_data(_spec(corpus), tokenizer, SEQ_LEN, seed=seed, global_batch_size=B, micro_batch_size=2,
                            evaluate=True, eval_batches=EVAL_BATCHES)


def test_validation_windows_come_from_most_files_with_held_out_units(corpus, tokenizer, stream_cache):
    _, val = stream_sources(_spec(corpus))
    held_files = {val.reader.files.names[u.file] for u in val.units}
    assert len(held_files) >= N_FILES // 2 and len(val.units) > MAX_VAL_UNITS  # the corpus is what the test needs
    data = _prepare(corpus, tokenizer)
    assert len(data.val_windows) == EVAL_BATCHES * B
    assert all(window_ids(tokenizer, [w]) for w in data.val_windows)  # every window names its documents
    docs = window_ids(tokenizer, data.val_windows)
    files = {f"part{i // PER_FILE}.jsonl" for i in docs}
    assert files <= held_files
    # the first-in-file-order rule took all 32 windows from the first held-out unit: one file
    assert len(files) >= len(held_files) / 2, (sorted(files), sorted(held_files))
    held_docs = set()
    for u in val.units:
        held_docs |= window_ids(tokenizer, unit_windows(val, u, tokenizer, SEQ_LEN))
    assert docs <= held_docs  # from held-out units only


def test_validation_windows_are_the_same_on_every_build_and_seed(corpus, tokenizer, stream_cache, tmp_path,
                                                                monkeypatch):
    data = _prepare(corpus, tokenizer, seed=1)
    _, val = stream_sources(_spec(corpus))
    built = validation_windows_across_units(val, tokenizer, SEQ_LEN, EVAL_BATCHES * B)
    assert np.array_equal(built, data.val_windows)
    _, val_again = stream_sources(_spec(corpus))  # a fresh listing of the units
    assert np.array_equal(validation_windows_across_units(val_again, tokenizer, SEQ_LEN, EVAL_BATCHES * B), built)
    for module in ("data.windows", "data.units"):  # a cache built afresh, by a run of another seed
        monkeypatch.setattr(f"{module}.default_cache_dir", lambda: tmp_path / "other_cache")
    other = _prepare(corpus, tokenizer, seed=7)
    assert np.array_equal(other.val_windows, data.val_windows)


class ListUnits(UnitSource):
    """Units of documents given in memory: unit k's documents all say `w{k}x`."""

    def __init__(self, docs: List[List[str]]):
        self.docs, self.label = docs, "units in memory"
        self.units = [Unit(0, k, 0, len(d)) for k, d in enumerate(docs)]

    def texts(self, unit: Unit) -> List[str]:
        return self.docs[unit.part]


def _units(sizes_in_order: List[int]) -> StreamSource:
    """Units whose k-th in validation_windows_across_units' order holds documents of about sizes_in_order[k] x 16
    tokens (as many windows of 16 tokens)."""
    order = unit_order(len(sizes_in_order), VAL_SEED, 0, shuffle=True)
    docs: List[List[str]] = [[] for _ in sizes_in_order]
    for place, unit in enumerate(order):
        docs[unit] = [" ".join(f"w{unit}x word" for _ in range(6))] * sizes_in_order[place]
    reader = ListUnits(docs)
    return StreamSource(reader, reader.units)


def _per_place(source, tokenizer, windows) -> List[int]:
    """Windows of each unit, by its place in validation_windows_across_units' order."""
    order = unit_order(len(source.units), VAL_SEED, 0, shuffle=True).tolist()
    counts = [0] * len(order)
    for w in windows:
        (unit,) = window_ids(tokenizer, [w])  # each unit is packed on its own
        counts[order.index(unit)] += 1
    return counts


def test_short_units_are_made_up_by_the_others_then_by_further_units(tokenizer):
    n_units = MAX_VAL_UNITS + 4
    # every other unit of the first MAX_VAL_UNITS holds one window, the others plenty
    source = _units([1 if k % 2 == 0 and k < MAX_VAL_UNITS else 8 for k in range(n_units)])
    held = [len(list(unit_windows(source, u, tokenizer, SEQ_LEN))) for u in source.units]
    order = unit_order(n_units, VAL_SEED, 0, shuffle=True)
    assert [held[u] for u in order][:2] == [1, held[order[1]]] and held[order[1]] > 4
    n = 3 * MAX_VAL_UNITS - 8  # a share of 3: the short half leaves 8 missing, the first full unit gives them
    counts = _per_place(source, tokenizer, validation_windows_across_units(source, tokenizer, SEQ_LEN, n))
    assert counts[:4] == [1, 3 + 8, 1, 3] and counts[MAX_VAL_UNITS:] == [0] * 4 and sum(counts) == n, counts
    # every unit holds one window: the first MAX_VAL_UNITS, then further units in order
    ones = _units([1] * n_units)
    assert _per_place(ones, tokenizer, validation_windows_across_units(ones, tokenizer, SEQ_LEN, MAX_VAL_UNITS + 2)) == \
        [1] * (MAX_VAL_UNITS + 2) + [0] * 2
    assert len(validation_windows_across_units(ones, tokenizer, SEQ_LEN, 100)) == n_units  # the data runs out: all there is
