"""One source's data prepared before the run: `prepare_source_data` checks the source against
the run and gives data/pipeline.py's SourceData, its units listed (`stream_sources`), its streams
checked (`check_streams`), its validation windows built (`validation_windows_across_units`) and its
read-ahead chosen (`read_ahead_steps`); a mixture's sources use the same steps (data/mixture_run.py). Separate from
data/pipeline.py, which holds what the training loop draws from a prepared source: this runs once,
before any process group starts.

`prepare_source_data` checks, in both modes, that the training data holds at least one global batch
and the validation data `eval_batches` of them, so that a run never stops at its first step or its
first evaluation. Validation is windows in memory (map-style: the cached stream; streaming:
eval_batches * B windows sampled across the held-out units, `validation_windows_across_units`, read
once and cached), evaluated the same way in both modes.
"""
import dataclasses
import hashlib
import json
from itertools import islice, zip_longest
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import numpy as np
from transformers import PreTrainedTokenizerBase

from data.builtin import BUILTIN
from data.cache import build_once, default_cache_dir
from data.files import resolve_files
from data.pipeline import SourceData
from data.sources import in_memory_split, saved_dataset_dir
from data.spec import DataError, DataSpec
from data.streaming import (START, StreamSource, default_streams, packed_windows, stream_documents, stream_units,
                            unit_order)
from data.tokens import longest_token_bytes, tokenize_batch
from data.units import DatasetUnits, FileUnits, Unit, UnitSource
from data.windows import cached_validation_windows, prepare_streams, tokenizer_fingerprint, windows


def default_read_ahead_steps(streamed: List[DataSpec], global_batch_size: int) -> int:
    """ceil(max over the streamed sources of shuffle_buffer x streams / B), at least 1. A rank
    refills all its streams' shuffle blocks in one burst, whose windows feed this many steps (a
    mixture's source with a share w of the batch refills 1/w times as rarely, but its burst is
    the same size); queued this far ahead, the read-ahead thread does the burst while the trainer
    uses the steps before it."""
    return max([1] + [-(-s.shuffle_buffer * s.streams // global_batch_size) for s in streamed])


def read_ahead_steps(spec: DataSpec, streamed: List[DataSpec], global_batch_size: int) -> int:
    """data.read_ahead_steps, or its default (null) for these streamed sources."""
    return spec.read_ahead_steps if spec.read_ahead_steps is not None else \
        default_read_ahead_steps(streamed, global_batch_size)


def unit_source(spec: DataSpec, split: str) -> UnitSource:
    """The units of one split: row ranges of a dataset in memory (`builtin`, a save_to_disk
    directory), else the files `data.name` names (data/files.py)."""
    if spec.name == BUILTIN or saved_dataset_dir(spec.name):
        return DatasetUnits(in_memory_split(spec, split), spec.text_field, spec.name)
    units = FileUnits(resolve_files(spec.name, spec.config, split, spec.revision, spec.data_files_by_split()),
                      spec.text_field, spec.unit_bytes)
    if not units.units:
        raise DataError(f"data.name={units.label!r} split {split!r} is empty")
    return units


def stream_sources(spec: DataSpec) -> Tuple[StreamSource, Optional[StreamSource]]:
    """The training units and the validation ones (None without validation): the val split's
    units, or the training split's held-out units (data/units.py), which never train."""
    train = unit_source(spec, spec.split)
    if not train.units:
        raise DataError(f"data.name={spec.name!r} split {spec.split!r} is empty")
    if spec.val_split is not None:
        val = unit_source(spec, spec.val_split)
        return StreamSource(train, train.units), StreamSource(val, val.units)
    kept, held = train.held_out(spec.val_fraction)
    return StreamSource(train, kept), (StreamSource(train, held) if held else None)


def with_streams(spec: DataSpec, train: StreamSource, global_batch_size: int) -> DataSpec:
    """The spec with data.streams resolved: as the recipe gives it, or (null) data/streaming.py's
    default_streams for this batch and these training units; never from the layout."""
    if spec.streams is not None:
        return spec
    return dataclasses.replace(spec, streams=default_streams(global_batch_size, len(train.units)))


STREAM_CHECK_VERSION = 1  # bump when read_and_check_streams's rule changes: remembered answers change with it
VAL_SEED = 0
"""The seed of the order in which streaming validation visits the held-out units: a constant, not
`train.seed`, so that runs with different seeds evaluate on the same windows and their validation
losses compare. The rest of validation takes no seed either: held-out units and documents are
chosen by hash (data/units.py, data/sources.py) and validation batches are drawn unshuffled."""
MAX_VAL_UNITS = 16
"""How many held-out units streaming validation spreads its windows over, at most (more only when
these run short). Each unit is read whole (its windows packed from its own documents), so the cap
bounds the reading done once, at the cache's build: 16 units of data.unit_bytes (32 MiB) or row
groups, while 16 units drawn at random from the held-out ones land in most of a corpus's files."""


def unit_windows(source: StreamSource, unit: Unit, tokenizer: PreTrainedTokenizerBase,
                 seq_len: int) -> Iterator[np.ndarray]:
    """The windows of one unit's documents packed on their own (its partial last window dropped),
    tokenized only as far as they are drawn."""
    docs = stream_documents(StreamSource(source.reader, [unit]), 0, 1, seed=0, shuffle=False, start=START, epochs=1)
    for _, w in packed_windows(docs, tokenizer, seq_len + 1):
        if w is None:
            return
        yield w


def validation_windows_across_units(source: StreamSource, tokenizer: PreTrainedTokenizerBase, seq_len: int,
                                    n: int) -> np.ndarray:
    """Up to `n` validation windows sampled across `source`'s units: in the order
    `unit_order(units, VAL_SEED)`, the first min(units, MAX_VAL_UNITS) of them give ceil(n / used)
    windows each (each unit's first windows, its documents packed on their own); when some hold
    fewer, a second pass takes more from those that hold more, in the same order, and then further
    units of the order give what is still missing, until `n` or the units run out. Reading the
    units in file order instead would take every window from the first file(s) (for FineWeb-Edu,
    sorted by crawl: the oldest dump only). One unit's texts are held at a time; the windows come
    interleaved (every unit's first, then every unit's second...), so that any whole number of
    global batches spreads across the units too. Deterministic: the same units and tokenizer give
    the same windows in every process and run."""
    order = [source.units[i] for i in unit_order(len(source.units), VAL_SEED, 0, shuffle=True)]
    used = min(len(order), MAX_VAL_UNITS)
    taken: List[List[np.ndarray]] = []  # per unit of the order, its windows in unit order
    if n > 0 and used:
        share = -(-n // used)
        for unit in order[:used]:
            taken.append(list(islice(unit_windows(source, unit, tokenizer, seq_len), share)))
        missing = n - sum(len(w) for w in taken)
        for k, unit in enumerate(order[:used]):  # second pass: more from the units that may hold more
            if missing <= 0:
                break
            if len(taken[k]) == share:
                more = list(islice(unit_windows(source, unit, tokenizer, seq_len), share, share + missing))
                taken[k] += more
                missing -= len(more)
        for unit in order[used:]:  # then further units
            if missing <= 0:
                break
            taken.append(list(islice(unit_windows(source, unit, tokenizer, seq_len), missing)))
            missing -= len(taken[-1])
    found = [w for row in zip_longest(*taken) for w in row if w is not None][:n]
    return np.stack(found) if found else np.empty((0, seq_len + 1), dtype=np.int64)


def _tokens_of(texts, tokenizer: PreTrainedTokenizerBase) -> int:
    return sum(len(ids) for k in range(0, len(texts), 256)
               for ids in tokenize_batch([t for t in texts[k:k + 256] if t], tokenizer))


def _stream_tokens(source: StreamSource, stream: int, n_streams: int, seed: int, shuffle: bool,
                   tokenizer: PreTrainedTokenizerBase, need: int) -> Tuple[int, bool]:
    """(tokens of the stream's epoch-0 documents, read to the end?), reading only until `need`.
    A line unit is tried by its head first (data/units.py: head_texts, 8 bytes a needed token, at
    least 64 KiB): with one stream per sample of the batch, reading a whole 8 MiB unit per stream
    would read 8 GiB at start-up for 1,024 streams."""
    tokens, head_bytes = 0, max(64 * 1024, 8 * need)
    for i in stream_units(len(source.units), stream, n_streams, seed, 0, shuffle):
        unit = source.units[i]
        head = source.reader.head_texts(unit, head_bytes)
        if head is not None and tokens + _tokens_of(head, tokenizer) >= need:
            return need, False  # the lines that start in the head are the unit's first lines
        tokens += _tokens_of(source.reader.texts(unit), tokenizer)
        if tokens >= need:
            return tokens, False
    return tokens, True


def check_streams(spec: DataSpec, source: StreamSource, tokenizer: PreTrainedTokenizerBase, seq_len: int, seed: int,
                  global_batch_size: int, windows_per_stream: Optional[int] = None) -> Optional[int]:
    """`read_and_check_streams`, done by one process per node and remembered in the data cache
    under the units and every setting the answer depends on (a line format's check reads
    a whole unit per stream, too much for every process of every run to repeat). A failed check is not
    remembered: each process raises the same one-line error."""
    key = hashlib.sha256(json.dumps([STREAM_CHECK_VERSION, source.reader.fingerprint(), len(source.units),
                                     [source.reader.identity(source.units[i]) for i in (0, -1)],
                                     tokenizer_fingerprint(tokenizer), seq_len, seed, global_batch_size, spec.streams,
                                     spec.shuffle, windows_per_stream]).encode()).hexdigest()[:20]

    def check(tmp: Path) -> None:
        tmp.write_text(json.dumps(read_and_check_streams(spec, source, tokenizer, seq_len, seed, global_batch_size,
                                                         windows_per_stream)))

    return json.loads(build_once(default_cache_dir() / "data" / f"streams-checked-{key}.json", check).read_text())


def read_and_check_streams(spec: DataSpec, source: StreamSource, tokenizer: PreTrainedTokenizerBase, seq_len: int,
                           seed: int, global_batch_size: int, windows_per_stream: Optional[int] = None) -> Optional[int]:
    """Every stream holds a global batch's share (B/S windows; or `windows_per_stream`, a mixture's
    source, which repeats) in its units of epoch 0. A stream whose units' text (from parquet
    footers) must hold that many tokens even at the tokenizer's longest token passes unread;
    the others are read until shown, or to their end. Returns the windows per epoch when every
    stream was read to its end (the data is that small), else None."""
    S, window = spec.streams, seq_len + 1
    if global_batch_size % S:
        raise DataError(f"data.streams={S} must divide train.global_batch_size={global_batch_size}: every stream "
                        f"gives B/streams windows to each step")
    n_units = len(source.units)
    if n_units < S:
        raise DataError(f"data.name={spec.name!r} (streaming) has {n_units} training unit(s), fewer than "
                        f"data.streams={S}: each stream reads whole units (parquet row groups, "
                        f"data.unit_bytes of a line file); lower data.streams, or use more or smaller units")
    share = windows_per_stream or global_batch_size // S
    need, longest = share * window, longest_token_bytes(tokenizer)
    per_stream, all_read = [], True
    for t in range(S):
        text_bytes = source.units.text_bytes()[stream_units(n_units, t, S, seed, 0, spec.shuffle)]
        if (text_bytes >= 0).all() and text_bytes.sum() >= need * longest:
            all_read = False
            continue
        tokens, to_end = _stream_tokens(source, t, S, seed, spec.shuffle, tokenizer, need)
        all_read &= to_end
        per_stream.append(tokens)
        if tokens < need:
            raise DataError(f"data.name={spec.name!r} (streaming): stream {t} of data.streams={S} holds "
                            f"{tokens // window} windows of seq_len+1 = {window} tokens per epoch, fewer than "
                            + (f"its share of one global batch ({global_batch_size}/{S} = {share}); "
                               if windows_per_stream is None else f"{share} (no complete window); ")
                            + "lower data.streams, train.global_batch_size or data.seq_len, or use more data")
    return sum(t // window for t in per_stream) if all_read else None  # each stream packs its own documents


def prepare_source_data(spec: DataSpec, tokenizer: PreTrainedTokenizerBase, seq_len: int, seed: int,
                        global_batch_size: int, micro_batch_size: int, evaluate: bool,
                        eval_batches: int = 1) -> SourceData:
    """Check one source's data against the run and build (or reuse) its cache; raises DataError."""
    if evaluate and spec.val_split is None and spec.val_fraction <= 0:
        raise DataError("train.eval_every > 0 needs validation data: set data.val_split or data.val_fraction "
                        "(or train.eval_every=0)")
    data = SourceData(spec=spec, tokenizer=tokenizer, seq_len=seq_len, seed=seed,
                      global_batch_size=global_batch_size, micro_batch_size=micro_batch_size)
    window, need_val = seq_len + 1, eval_batches * global_batch_size
    if spec.streaming:
        train, val = stream_sources(spec)  # one listing of the units for both checks
        spec = data.spec = with_streams(spec, train, global_batch_size)
        check_streams(spec, train, tokenizer, seq_len, seed, global_batch_size)
        data.train_stream, data.read_ahead_steps = train, read_ahead_steps(spec, [spec], global_batch_size)
        if val is not None:
            data.val_windows = cached_validation_windows(
                spec, tokenizer, seq_len, need_val,
                lambda: validation_windows_across_units(val, tokenizer, seq_len, need_val), val.reader.fingerprint())
    else:
        streams = prepare_streams(spec, tokenizer)
        data.train_windows = windows(streams.train, seq_len)
        if len(data.train_windows) < global_batch_size:
            raise DataError(f"data.name={spec.name!r} gives {len(streams.train)} training tokens = "
                            f"{len(data.train_windows)} windows of seq_len+1 = {window}, fewer than one global batch "
                            f"({global_batch_size}); lower train.global_batch_size or data.seq_len, or use more data")
        if streams.val is not None:
            data.val_windows = windows(streams.val, seq_len)
    if evaluate and (data.val_windows is None or len(data.val_windows) < need_val):
        found = 0 if data.val_windows is None else len(data.val_windows)
        raise DataError(f"the validation data gives {found} windows of seq_len+1 = {window} tokens, fewer than "
                        f"train.eval_batches x global batch = {eval_batches} x {global_batch_size} = {need_val}; "
                        f"raise data.val_fraction, lower train.eval_batches, or set train.eval_every=0")
    return data
