"""Streaming mode: documents from an `IterableDataset`, tokenized and packed on the fly, in a
fixed number of logical streams, with a position that resumes without re-reading (docs/design.md
contract 14).

Row i of every shard belongs to stream i % S (S = `data.streams`); the global batch of step k
is stream 0's windows [k*B/S, (k+1)*B/S), then stream 1's, and so on, at every layout; dp rank r
takes the r-th contiguous 1/dp of it and reads only the streams that slice covers. A stream's
position (its shuffle block's first position and the windows of the block taken) resumes by
reading at most one shard and one block. The shuffle order and the position's fields:
docs/data.md, "Streaming"."""
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import datasets
import numpy as np
import pyarrow as pa
import torch
from transformers import PreTrainedTokenizerBase

from data.spec import DataError

Position = Tuple[int, int, int, int]  # (epoch, place in the shard order, row, token offset)
START: Position = (0, 0, 0, 0)
StreamState = Tuple[Position, int]    # (first position of the current block, windows taken)
Batch = Tuple[torch.Tensor, torch.Tensor]


@dataclass
class StreamSource:
    """What the streams read: the shards of one split, its text column, which rows train."""
    name: str
    shards: List[datasets.IterableDataset]
    text_field: str
    keep: Callable[[str], bool]

    @classmethod
    def of(cls, name: str, dataset: datasets.IterableDataset, text_field: str,
           keep: Callable[[str], bool]) -> "StreamSource":
        n = dataset.num_shards
        return cls(name, [dataset.shard(num_shards=n, index=i) for i in range(n)], text_field, keep)


def shard_order(n_shards: int, seed: int, epoch: int, shuffle: bool) -> List[int]:
    if not shuffle:
        return list(range(n_shards))
    return np.random.default_rng([seed, epoch]).permutation(n_shards).tolist()


def read_rows(source: StreamSource, shard: int, first_row: int, stream: int, n_streams: int,
              batch_rows: int = 1024) -> Iterator[Tuple[int, Optional[str]]]:
    """(row, text) of one shard's rows of this stream from `first_row` on. Rows before it and
    rows of other streams are skipped as Arrow tables: never converted, never tokenized."""
    row0 = 0
    for table in source.shards[shard].with_format("arrow").iter(batch_size=batch_rows):
        n = len(table)
        if row0 + n > first_row:
            if source.text_field not in table.column_names:
                raise DataError(f"data.text_field={source.text_field!r} is not a column of {source.name!r}; "
                                f"columns: {', '.join(table.column_names)}")
            lo = max(first_row - row0, 0)
            idx = list(range(lo + (stream - row0 - lo) % n_streams, n, n_streams))
            texts = table.column(source.text_field).take(pa.array(idx, type=pa.int64())).to_pylist()
            for i, text in zip(idx, texts):
                yield row0 + i, text
        row0 += n


def stream_documents(source: StreamSource, stream: int, n_streams: int, seed: int, shuffle: bool,
                     start: Position, epochs: Optional[int] = None) -> Iterator[Tuple[Position, Optional[str]]]:
    """(position of its first token, text) of this stream's training documents from `start`;
    (end of epoch, None) after each epoch. Endless unless `epochs` is given."""
    epoch, place, row, _ = start
    while epochs is None or epoch < epochs:
        order = shard_order(len(source.shards), seed, epoch, shuffle)
        for p in range(place, len(order)):
            for r, text in read_rows(source, order[p], row, stream, n_streams):
                if text and source.keep(text):
                    yield (epoch, p, r, 0), text
            row = 0
        yield (epoch, len(order), 0, 0), None
        epoch, place = epoch + 1, 0


def packed_windows(docs: Iterator[Tuple[Position, Optional[str]]], tokenizer: PreTrainedTokenizerBase,
                   window: int, skip_tokens: int = 0, batch_docs: int = 64
                   ) -> Iterator[Tuple[Position, Optional[np.ndarray]]]:
    """(position of its first token, window) in stream order; (end of epoch, None) after an
    epoch's last complete window. Each document is its tokens and EOS (documents that tokenize
    to nothing are dropped: the rule of data/tokens.py, so streaming packs what map-style does).
    The first document loses its first `skip_tokens` tokens (a resume inside a document)."""
    eos = tokenizer.eos_token_id
    carry = np.empty(0, dtype=np.int64)
    pieces: List[Tuple[int, Position]] = []  # (index in carry, position of that token)

    def tokenized(batch):
        ids = tokenizer([text for _, text in batch], add_special_tokens=False,
                        return_attention_mask=False)["input_ids"]
        return [(pos, doc) for (pos, _), doc in zip(batch, ids) if doc]

    batch: List[Tuple[Position, str]] = []
    for pos, text in docs:
        if text is not None:
            batch.append((pos, text))
            if len(batch) < batch_docs:
                continue
        for doc_pos, ids in tokenized(batch) if batch else []:
            tokens = np.asarray(ids + [eos], dtype=np.int64)
            if skip_tokens:
                tokens, doc_pos, skip_tokens = tokens[skip_tokens:], doc_pos[:3] + (skip_tokens,), 0
            pieces.append((len(carry), doc_pos))
            carry = np.concatenate([carry, tokens])
            while len(carry) >= window:
                yield pieces[0][1], carry[:window]
                carry = carry[window:]
                if len(carry) == 0:  # a document ended with the window: the next one starts the next
                    pieces = []
                    break
                shifted = [(i - window, p) for i, p in pieces]
                inside = [k for k, (i, _) in enumerate(shifted) if i <= 0][-1]  # holds the new first token
                i, p = shifted[inside]
                pieces = [(0, p[:3] + (p[3] - i,))] + shifted[inside + 1:]
        batch = []
        if text is None:  # end of epoch: the partial window is dropped
            carry, pieces = carry[:0], []
            yield pos, None


def shuffled_windows(packed: Iterator[Tuple[Position, Optional[np.ndarray]]], block: int, seed: int,
                     stream: int, shuffle: bool) -> Iterator[Tuple[np.ndarray, StreamState]]:
    """Windows permuted within blocks of `block` (an epoch's end closes a block), each with the
    stream state after it: (its block's first position, windows of the block taken)."""
    pending: List[np.ndarray] = []
    first: Position = START
    in_epoch = 0
    for pos, w in packed:
        if w is not None:
            if not pending:
                first = pos
            pending.append(w)
            in_epoch += 1
        if pending and (w is None or len(pending) == block):
            order = np.random.default_rng([seed, stream, *first]).permutation(len(pending)) \
                if shuffle else range(len(pending))
            for taken, j in enumerate(order, start=1):
                yield pending[j], (first, taken)
            pending = []
        if w is None:
            if in_epoch == 0:  # data/pipeline.py checks this before training; a changed source can still
                raise DataError(f"streaming stream {stream} holds no complete window in epoch {pos[0]}")
            in_epoch = 0


def stream_windows(source: StreamSource, tokenizer: PreTrainedTokenizerBase, seq_len: int, seed: int,
                   shuffle: bool, block: int, stream: int, n_streams: int, state: StreamState
                   ) -> Iterator[Tuple[np.ndarray, StreamState]]:
    """Stream `stream`'s endless windows, each with the state after it, from `state` on."""
    first, taken = state
    docs = stream_documents(source, stream, n_streams, seed, shuffle, first)
    windows = shuffled_windows(packed_windows(docs, tokenizer, seq_len + 1, skip_tokens=first[3]),
                               block, seed, stream, shuffle)
    for i, item in enumerate(windows):
        if i >= taken:  # the resumed block's windows before `taken` were trained on already
            yield item


class StepBatches:
    """Endless (input_ids, labels), each (b, seq_len) int64, of one dp rank, step after step from
    step `step`: the rank holds slots [lo, hi) of every global batch (its r-th contiguous 1/dp),
    drawn in micro-batches of b. A subclass gives each step's windows of those slots and the
    stream states after the step (`step_windows`); they become its position (`consumed`) when the
    step's last micro-batch is drawn, so a checkpoint records exactly what was trained."""

    def __init__(self, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int, step: int):
        self.global_batch_size, self.micro_batch_size, self.step = global_batch_size, micro_batch_size, step
        self.lo, self.hi = dp_rank * global_batch_size // dp_size, (dp_rank + 1) * global_batch_size // dp_size
        self._batches = self._generate()

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        return next(self._batches)

    def open_streams(self, open_stream: Callable[[int, StreamState], Iterator[Tuple[np.ndarray, StreamState]]],
                     n_streams: int, saved: Dict[int, StreamState]
                     ) -> Tuple[Dict[int, StreamState], Dict[int, Iterator[Tuple[np.ndarray, StreamState]]]]:
        """(state, opened stream) of each stream this rank reads: stream t owns the contiguous slots
        [t*B/S, (t+1)*B/S) of every global batch; each opens at its saved state (START when none)."""
        per = self.global_batch_size // n_streams
        states = {t: saved.get(t, (START, 0)) for t in range(self.lo // per, (self.hi - 1) // per + 1)}
        return states, {t: open_stream(t, state) for t, state in states.items()}

    def step_windows(self) -> Tuple[List[np.ndarray], Any]:
        """This rank's windows of the current step, in slot order, and the stream states after it."""
        raise NotImplementedError

    def consumed(self, after: Any) -> None:
        """The stream states after the step (from `step_windows`) are now the position."""
        raise NotImplementedError

    def _generate(self) -> Iterator[Batch]:
        b = self.micro_batch_size
        while True:
            rows, after = self.step_windows()
            for i in range(0, len(rows), b):
                if i + b >= len(rows):  # the step's last micro-batch: the step is consumed
                    self.consumed(after)
                    self.step += 1
                batch = torch.from_numpy(np.stack(rows[i:i + b]).astype(np.int64, copy=False))  # (b, seq_len + 1)
                yield batch[:, :-1].contiguous(), batch[:, 1:].contiguous()


class StreamingBatches(StepBatches):
    """StepBatches of one streamed source: each stream gives its B/S windows to every step, in
    stream order; `state()` is the position of every stream the rank reads, for checkpoints."""

    def __init__(self, open_stream: Callable[[int, StreamState], Iterator[Tuple[np.ndarray, StreamState]]],
                 n_streams: int, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                 step: int, states: Dict[int, StreamState]):
        super().__init__(global_batch_size, micro_batch_size, dp_rank, dp_size, step)
        self.per_stream = global_batch_size // n_streams
        self.states, self.streams = self.open_streams(open_stream, n_streams, states)

    def step_windows(self) -> Tuple[List[np.ndarray], Dict[int, StreamState]]:
        windows, after = [], {}
        for s, stream in self.streams.items():
            for j in range(self.per_stream):
                w, after[s] = next(stream)
                if self.lo <= s * self.per_stream + j < self.hi:
                    windows.append(w)
        return windows, after

    def consumed(self, after: Dict[int, StreamState]) -> None:
        self.states.update(after)

    def state(self) -> dict:
        """JSON-able: the steps consumed and the state of each stream this rank reads."""
        return {"step": self.step, "streams": encoded_states(self.states)}


def encoded_states(states: Dict[int, StreamState]) -> dict:
    return {str(s): {"block": list(first), "taken": taken} for s, (first, taken) in states.items()}


def decoded_states(encoded: dict) -> Dict[int, StreamState]:
    return {int(s): (tuple(v["block"]), v["taken"]) for s, v in encoded.items()}


def latest_states(local_states: List[dict]) -> Tuple[int, List[dict]]:
    """(the last step, the ranks' `state()`s at it): ranks that never read (middle pipeline
    stages) still hold an older step and are left out."""
    step = max(s["step"] for s in local_states)
    return step, [s for s in local_states if s["step"] == step]


def merge_states(local_states: List[dict], n_streams: int) -> dict:
    """One position of every stream from the ranks' `state()`s."""
    step, latest = latest_states(local_states)
    streams: Dict[str, dict] = {}
    for s in latest:
        streams.update(s["streams"])
    assert len(streams) == n_streams, (sorted(streams), n_streams)
    return {"streams_total": n_streams, "step": step, "streams": streams}


def gathered_states(local: dict) -> List[dict]:
    """Collective over the world: every rank calls it with its `state()` and gets everyone's."""
    import torch.distributed as dist
    everyone: List[Optional[dict]] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    return everyone


def gather_data_state(local: dict, n_streams: int) -> dict:
    """Collective over the world: every rank calls it and gets the whole position."""
    return merge_states(gathered_states(local), n_streams)


def states_from(data_state: Optional[dict]) -> Dict[int, StreamState]:
    return {} if data_state is None else decoded_states(data_state["streams"])
