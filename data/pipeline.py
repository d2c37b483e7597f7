"""One source's data (SourceData), map-style (cached, memory-mapped windows) or streaming, and
what the training loop sees of a run's data (RunData, which a mixture implements too:
data/mixture_run.py): train micro-batches from any position, validation batches, the copy to
the device and TP sharing.

`prepare_source_data` runs before any process group starts and checks, in both modes, that the
training data holds at least one global batch and the validation data `eval_batches` of them,
so that a run never stops at its first step or its first evaluation. Validation is windows in
memory (map-style: the cached stream; streaming: the first eval_batches * B windows of the
held-out documents, read once and cached), evaluated the same way in both modes.
"""
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from data.sampler import micro_batches
from data.builtin import BUILTIN
from data.files import resolve_files
from data.sources import in_memory_split, saved_dataset_dir
from data.spec import DataError, DataSpec
from data.streaming import (START, Batch, StreamingBatches, StreamSource, StreamState, gather_data_state,
                            packed_windows, positions_of_units, states_from, stream_documents, stream_units,
                            stream_windows)
from data.tokens import longest_token_bytes, tokenize_batch
from data.units import DatasetUnits, FileUnits, UnitSource
from data.windows import cached_validation_windows, prepare_streams, windows


def on_device(batches: Iterator[Batch], device: torch.device) -> Iterator[Batch]:
    """The micro-batches as DeepSpeed's pipeline engine best receives them on an accelerator:
    already there, copied from pinned host memory with non_blocking=True. The engine's own
    `.to(device)` of a pageable tensor waits for the device's queued work at every micro-batch
    (the host cannot run ahead); of a tensor already on the device it does nothing. Values are
    unchanged, and nothing is fetched ahead, so the source's position (a checkpoint's
    data_state) stays exactly what was trained. Pinning goes through DeepSpeed's accelerator
    (on CPU it pins nothing and the copy to the CPU returns the tensor itself), so a test's
    accelerator sees the same calls a GPU gets (tests/runtime/test_device_sync.py, issue 24)."""
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    return ((accelerator.pin_memory(x).to(device, non_blocking=True),
             accelerator.pin_memory(y).to(device, non_blocking=True)) for x, y in batches)


def shared_over_tp(batches: Optional[Iterator[Batch]], tp_group, shape: Tuple[int, int],
                   device: torch.device) -> Iterator[Batch]:
    """TP rank 0 of a stage reads the micro-batches (`batches`) and broadcasts each to its TP
    peers, which pass None and read nothing: the TP ranks of a replica train on the same data,
    so reading and tokenizing it once per replica is enough. Every TP rank of the stage draws
    its micro-batches at the same point of the same schedule, so the broadcasts pair up."""
    import torch.distributed as dist
    source = dist.get_global_rank(tp_group, 0)
    while True:
        if batches is not None:
            x, y = next(batches)
        else:
            x = torch.empty(shape, dtype=torch.int64, device=device)
            y = torch.empty(shape, dtype=torch.int64, device=device)
        dist.broadcast(x, source, group=tp_group)
        dist.broadcast(y, source, group=tp_group)
        yield x, y


@dataclass(kw_only=True)
class RunData(ABC):
    """What the training loop sees of a run's data: one source (SourceData) or a mixture
    (data/mixture_run.py's MixtureData), built by data/run.py's prepare_run_data."""
    tokenizer: PreTrainedTokenizerBase
    seq_len: int
    seed: int
    global_batch_size: int
    micro_batch_size: int
    read_ahead_steps: int = 0
    """Steps a worker thread reads streamed data ahead of the trainer (data.read_ahead_steps)."""

    @property
    @abstractmethod
    def streamed(self) -> bool:
        """Whether any training data is read on the fly (its positions go into checkpoints)."""

    @property
    @abstractmethod
    def has_validation(self) -> bool:
        """Whether validation data is held out (in every source)."""

    @abstractmethod
    def train_batches(self, dp_rank: int, dp_size: int, start_sample: int = 0,
                      data_state: Optional[dict] = None) -> Iterator[Batch]:
        """This dp rank's micro-batches from global sample position `start_sample` on. Streamed
        data resumes from `data_state` (the checkpoint's stream positions) without re-reading; a
        checkpoint without one (saved before streams had positions) is re-read up to its step."""

    @abstractmethod
    def gather_data_state(self, batches: Iterator[Batch]) -> Optional[dict]:
        """Collective when streamed (every rank calls it): the position of every stream, gathered
        from the ranks that read them, for the checkpoint; None when nothing is streamed, where
        the sample count is the whole position."""

    @abstractmethod
    def check_data_state(self, data_state: Optional[dict], samples: int) -> None:
        """A checkpoint's stream positions fit this run (before training starts); DataError if not."""

    @abstractmethod
    def eval_global_batches(self, wanted: int) -> int:
        """How many validation global batches exist (in every source), up to `wanted`."""

    @abstractmethod
    def validation_losses(self, loss_of: Callable[["SourceData"], float]
                          ) -> Tuple[float, Optional[Dict[str, float]]]:
        """(validation loss, label -> each source's loss, or None for one source), `loss_of`
        giving one source's loss."""

    def step_record(self, samples: int) -> Dict[str, Any]:
        """What a step's metrics record adds after `samples` samples: nothing for one source."""
        return {}

    def repeat_report(self, steps: int) -> Optional[str]:
        """What the run will draw from each source, printed once at the start; None for one source."""
        return None

    def feed(self, batches: Iterator[Batch], tp_group, device: torch.device) -> Iterator[Batch]:
        """What DeepSpeed's engine draws from: `batches` on the device (`on_device`); when data
        is streamed at tp > 1, only TP rank 0 of a stage reads and tokenizes them
        (`shared_over_tp`). `batches` stays the source of the position a checkpoint records."""
        if not self.streamed or tp_group is None:  # cached: a memory-mapped slice, cheap on every rank
            return on_device(batches, device)
        import torch.distributed as dist
        reader = dist.get_rank(tp_group) == 0
        return shared_over_tp(on_device(batches, device) if reader else None, tp_group,
                              (self.micro_batch_size, self.seq_len), device)

    def reread_to(self, batches: Iterator[Batch], start_sample: int, dp_size: int) -> Iterator[Batch]:
        """`batches`, opened at sample 0, advanced to `start_sample` by reading (a streamed resume
        from a checkpoint without stream positions)."""
        for _ in range(start_sample // dp_size // self.micro_batch_size):
            next(batches)
        return batches

    def check_saved_step(self, data_state: dict, samples: int) -> None:
        """The stream positions were saved after the checkpoint's samples (the same global batch)."""
        if data_state["step"] * self.global_batch_size != samples:
            raise DataError(f"the checkpoint's data position is after {data_state['step']} steps of "
                            f"{self.global_batch_size} samples, not after its {samples} samples: "
                            f"resume with the train.global_batch_size it was saved with")


@dataclass(kw_only=True)
class SourceData(RunData):
    """One source's data: cached windows (map-style) or streamed (`spec.streaming`)."""
    spec: DataSpec
    train_windows: Optional[np.ndarray] = None
    """(N, seq_len + 1) in map-style mode; None when streaming."""
    val_windows: Optional[np.ndarray] = None
    train_stream: Optional[StreamSource] = None
    """The training units when streaming (its files resolved and listed once, at preparation)."""

    @property
    def streamed(self) -> bool:
        return self.train_windows is None

    @property
    def has_validation(self) -> bool:
        return self.spec.val_split is not None or self.spec.val_fraction > 0

    def stream_opener(self) -> Callable[[int, StreamState], Iterator[Tuple[np.ndarray, StreamState]]]:
        """(stream, state) -> that stream's windows from `state` on (data/streaming.py's stream_windows)."""
        spec = self.spec
        open_stream = partial(stream_windows, self.train_stream, self.tokenizer, self.seq_len, self.seed,
                              spec.shuffle, spec.shuffle_buffer, n_streams=spec.streams)
        return lambda stream, state: open_stream(stream=stream, state=state)

    def train_batches(self, dp_rank: int, dp_size: int, start_sample: int = 0,
                      data_state: Optional[dict] = None) -> Iterator[Batch]:
        if not self.streamed:
            return micro_batches(self.train_windows, self.seed, self.global_batch_size, self.micro_batch_size,
                                 dp_rank, dp_size, start_sample, self.spec.shuffle)
        data_state = positions_of_units(data_state)
        resume_here = data_state is not None
        step = start_sample // self.global_batch_size if resume_here else 0
        batches = StreamingBatches(self.stream_opener(), self.spec.streams, self.global_batch_size,
                                   self.micro_batch_size, dp_rank, dp_size, step, states_from(data_state),
                                   self.read_ahead_steps)
        return batches if resume_here else self.reread_to(batches, start_sample, dp_size)

    def gather_data_state(self, batches: Iterator[Batch]) -> Optional[dict]:
        if not self.streamed:
            return None
        return gather_data_state(batches.state(), self.spec.streams)

    def check_data_state(self, data_state: Optional[dict], samples: int) -> None:
        data_state = positions_of_units(data_state)
        if data_state is None or not self.streamed:
            return
        if "sources" in data_state:  # saved by a mixture's streamed sources (data/mixture.py)
            raise DataError("the checkpoint holds the stream positions of a mixture (data.mix), this run reads one "
                            "streamed source: resume with the data section it was saved with")
        if data_state["streams_total"] != self.spec.streams:
            raise DataError(f"the checkpoint's data position is for data.streams={data_state['streams_total']}, "
                            f"this run has data.streams={self.spec.streams}; resume with "
                            f"--set data.streams={data_state['streams_total']}")
        self.check_saved_step(data_state, samples)

    def val_batches(self, dp_rank: int, dp_size: int, n_global_batches: int) -> Iterator[Batch]:
        """The first `n_global_batches` global batches of the validation windows, unshuffled:
        the same samples at every evaluation and at every layout."""
        return micro_batches(self.val_windows, self.seed, self.global_batch_size, self.micro_batch_size,
                             dp_rank, dp_size, 0, shuffle=False)

    def eval_global_batches(self, wanted: int) -> int:
        if self.val_windows is None:
            return 0
        return min(wanted, len(self.val_windows) // self.global_batch_size)

    def validation_losses(self, loss_of: Callable[["SourceData"], float]) -> Tuple[float, None]:
        return loss_of(self), None


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
    units = FileUnits(resolve_files(spec.name, spec.config, split, spec.revision), spec.text_field, spec.unit_bytes)
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


def first_windows(source: StreamSource, tokenizer: PreTrainedTokenizerBase, seq_len: int, n: int) -> np.ndarray:
    """Up to `n` windows of one pass over `source`'s units in index order (a single stream):
    reads units only until it has them."""
    docs = stream_documents(source, 0, 1, seed=0, shuffle=False, start=START, epochs=1)
    found: List[np.ndarray] = []
    for _, w in packed_windows(docs, tokenizer, seq_len + 1):
        if w is None:
            break
        found.append(w)
        if len(found) == n:
            break
    return np.stack(found) if found else np.empty((0, seq_len + 1), dtype=np.int64)


def _stream_tokens(source: StreamSource, stream: int, n_streams: int, seed: int, shuffle: bool,
                   tokenizer: PreTrainedTokenizerBase, need: int) -> Tuple[int, bool]:
    """(tokens of the stream's epoch-0 documents, read to the end?), reading only until `need`."""
    tokens, batch = 0, []
    docs = stream_documents(source, stream, n_streams, seed, shuffle, START, epochs=1)
    for _, text in docs:
        if text:
            batch.append(text)
        if batch and (len(batch) == 256 or not text):  # a batch, a unit's end (UNIT_END) or the epoch's
            tokens += sum(len(ids) for ids in tokenize_batch(batch, tokenizer))
            batch = []
            if tokens >= need:
                return tokens, False
    return tokens, True


def check_streams(spec: DataSpec, source: StreamSource, tokenizer: PreTrainedTokenizerBase, seq_len: int, seed: int,
                  global_batch_size: int, windows_per_stream: Optional[int] = None) -> Optional[int]:
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
        mine = [source.units[i] for i in stream_units(n_units, t, S, seed, 0, spec.shuffle)]
        if all(u.text_bytes >= 0 for u in mine) and sum(u.text_bytes for u in mine) >= need * longest:
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
        check_streams(spec, train, tokenizer, seq_len, seed, global_batch_size)
        data.train_stream, data.read_ahead_steps = train, read_ahead_steps(spec, [spec], global_batch_size)
        if val is not None:
            data.val_windows = cached_validation_windows(
                spec, tokenizer, seq_len, need_val, lambda: first_windows(val, tokenizer, seq_len, need_val),
                val.reader.fingerprint())
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
