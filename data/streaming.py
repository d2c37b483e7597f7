"""Streaming mode: documents read unit by unit (data/units.py: parquet row groups, byte ranges of
line files), tokenized and packed on the fly in a fixed number of logical streams, with a
position that resumes by reading one unit per stream (docs/design.md contract 14).

Epoch e of the units is a permutation drawn from (seed, e); stream t takes its units t, t + S,
t + 2S... (S = `data.streams`, unset: the global batch size B, `default_streams`) and reads only
those, so the job reads each unit once per epoch.
The global batch of step k is stream 0's windows [k*B/S, (k+1)*B/S), then stream 1's, and so
on, at every layout; dp rank r takes the r-th contiguous 1/dp of it and reads only the streams
that slice covers. A stream's position (its shuffle block's first position and the windows of
the block taken) names an epoch, a unit of the stream's list and a row in it, so a resume reads
from that unit on and never what came before. The shuffle order and the position's fields:
docs/data.md, "Streaming"."""
import functools
import sys
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import pyarrow as pa
import torch
from transformers import PreTrainedTokenizerBase

from data.prefetch import Opening, ReadAhead, stop_point
from data.spec import DataError
from data.tokens import document_tokens, token_dtype
from data.units import UnitSource, UnitTable, as_table

Position = Tuple[int, int, int, int]  # (epoch, unit in the stream's list of the epoch, row in the unit, token offset)
START: Position = (0, 0, 0, 0)
StreamState = Tuple[Position, int]    # (first position of the current block, windows taken)
Batch = Tuple[torch.Tensor, torch.Tensor]
STATE_FORMAT = "units"
"""The kind of position a checkpoint's data_state holds; one without it (saved before units) is
resumed by re-reading to its step (data/pipeline.py: RunData.reread_to)."""


@dataclass
class StreamSource:
    """What the streams of one source read: its units (and how to read them), and the ones they
    deal: the training units, or the validation ones."""
    reader: UnitSource
    units: UnitTable

    def __post_init__(self):
        self.units = as_table(self.units)


@functools.lru_cache(maxsize=8)
def unit_order(n_units: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Epoch `epoch`'s order of the units, (n_units,) int64, read-only. Kept: a rank's streams all
    deal from it (1.4M units: 30 ms a permutation, once per epoch instead of once per stream)."""
    order = np.random.default_rng([seed, epoch]).permutation(n_units) if shuffle else np.arange(n_units)
    order.flags.writeable = False
    return order


def stream_units(n_units: int, stream: int, n_streams: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The units stream `stream` reads in epoch `epoch`, in order: every S-th of the epoch's order."""
    return unit_order(n_units, seed, epoch, shuffle)[stream::n_streams]


def default_streams(global_batch_size: int, n_units: int) -> int:
    """`data.streams` unset: B, one stream per sample of the global batch. Every dp divides B, so a
    rank reads only its own B/dp streams whatever the layout, and a step's B windows come from B
    different units. A corpus of fewer than B training units gets the largest divisor of B it can
    fill (its replicas may then share streams: data/prepare_source.py warns)."""
    return max(s for s in range(1, min(global_batch_size, n_units) + 1) if global_batch_size % s == 0)


def rank_slots(dp_rank: int, dp_size: int, global_batch_size: int) -> Tuple[int, int]:
    """The slots [lo, hi) of every global batch that dp rank `dp_rank` trains: its r-th contiguous 1/dp."""
    return dp_rank * global_batch_size // dp_size, (dp_rank + 1) * global_batch_size // dp_size


def streams_of_slots(lo: int, hi: int, global_batch_size: int, n_streams: int) -> range:
    """The streams a rank holding slots [lo, hi) reads: stream t owns slots [t B/S, (t+1) B/S)."""
    per = global_batch_size // n_streams
    return range(lo // per, (hi - 1) // per + 1)


def read_share(n_streams: int, dp: int) -> float:
    """The most windows any dp rank reads and tokenizes per step, over the windows it trains: the
    streams its slice of the batch touches (each read whole) x B/S windows, over B/dp. 1 when dp
    divides S; dp/S when S divides dp (a stream shared by dp/S replicas, each reading all of it)."""
    touched = max(-(-(r + 1) * n_streams // dp) - (r * n_streams // dp) for r in range(dp))
    return touched * dp / n_streams


OPEN_THREADS = 16
"""Streams of a rank that read their first unit and fill their first shuffle block at once."""


def unit_text_bytes(texts) -> int:
    """What a stream holds of a unit's texts: its Arrow array (UnitSource.text_array: the UTF-8
    bytes, offsets and validity), or where Arrow could not hold them, the list of Python strings
    (CPython stores a string at 1, 2 or 4 bytes a character by its widest character, PEP 393,
    plus a 49-80 byte header; the list 8 bytes a document)."""
    if isinstance(texts, pa.Array):
        return texts.get_total_buffer_size()
    return sum(sys.getsizeof(t) for t in texts if t) + 8 * len(texts) + 56


def rank_memory_bytes(streams: int, block: int, window: int, token_bytes: int, unit_bytes: float,
                      read_ahead_windows: int, chunk_bytes: float, open_threads: int = OPEN_THREADS) -> float:
    """docs/data.md's memory of one reading rank, above what it held before its streams opened:
    `streams` R x (a shuffle block of `block` windows of `window` tokens + the unit's texts
    (`unit_bytes`, unit_text_bytes) + a stream's tokens in making and state) + the read-ahead queue
    (`read_ahead_windows` windows) + what the streams that read at once (min(R, OPEN_THREADS))
    hold while a unit is read: the fetched chunk (`chunk_bytes`: a parquet unit's compressed text
    column, a line unit's bytes) and a tokenizer batch's Python ids (~40 bytes a token).
    What reading a unit allocates and frees (the fetched bytes, their copy, decompressed pages)
    the allocators keep in part (glibc's heap, Arrow's mimalloc in each reading thread): counted
    as a chunk a stream and half a unit's text a reading thread, which puts the formula within
    0.93-1.03 of the peak RSS measured at 32 and 256 streams (bench/data/first_batch.py).
    Footers (rank 0 listing, or a column the unit list cannot describe) are not in it."""
    tokens = block * window * token_bytes
    per_stream = tokens + unit_bytes + chunk_bytes + 2 * window * token_bytes + STREAM_STATE_BYTES
    reading = min(streams, open_threads) * (chunk_bytes + unit_bytes / 2 + block * window * 40)
    return streams * per_stream + read_ahead_windows * window * token_bytes + reading


STREAM_STATE_BYTES = 4096
"""A stream's generators, positions and window objects, about 3 KiB."""


UNIT_END = ""
"""The text stream_documents gives after a unit's last document: a consumer that batches
documents (for the tokenizer) takes what it holds now, so the next unit is read only when its
first document is needed, never ahead of it."""


def stream_documents(source: StreamSource, stream: int, n_streams: int, seed: int, shuffle: bool,
                     start: Position, epochs: Optional[int] = None) -> Iterator[Tuple[Position, Optional[str]]]:
    """(position of its first token, text) of this stream's documents from `start`; (end of
    the unit, UNIT_END) after each unit; (end of epoch, None) after each epoch. Reads the units
    from the start's on, one at a time, each piece of a unit (UnitSource.text_pieces) when its
    first document is needed. Endless unless `epochs` is given."""
    epoch, place, row, _ = start
    while epochs is None or epoch < epochs:
        mine = stream_units(len(source.units), stream, n_streams, seed, epoch, shuffle)
        for p in range(place, len(mine)):
            rows = 0  # of the unit's pieces before this one
            # UTF-8 arrays (a str only while tokenized); a line unit in pieces, each read when its first
            # document is needed (its first MiB, then the rest: data/units.py, LINE_FIRST_READ)
            pieces = source.reader.text_pieces(source.units[mine[p]])
            while True:
                stop_point()  # a closed read-ahead's worker ends here, not after the block it refills
                texts = next(pieces, None)
                if texts is None:
                    break
                arrow = isinstance(texts, pa.Array)
                for r in range(max(row - rows, 0), len(texts)):
                    text = texts[r].as_py() if arrow else texts[r]
                    if text:
                        yield (epoch, p, rows + r, 0), text
                rows += len(texts)
            yield (epoch, p, rows, 0), UNIT_END
            row = 0
        yield (epoch, len(mine), 0, 0), None
        epoch, place = epoch + 1, 0


def packed_windows(docs: Iterator[Tuple[Position, Optional[str]]], tokenizer: PreTrainedTokenizerBase,
                   window: int, skip_tokens: int = 0, batch_docs: int = 64, batch_tokens: Optional[int] = None
                   ) -> Iterator[Tuple[Position, Optional[np.ndarray]]]:
    """(position of its first token, window) in stream order; (end of epoch, None) after an
    epoch's last complete window. Each document is data/tokens.py's `document_tokens` of it (its
    tokens and EOS; empty ones dropped), so streaming packs what map-style does.
    The first document loses its first `skip_tokens` tokens (a resume inside a document).
    Tokens are held in the narrowest dtype of the vocabulary (data/tokens.py: token_dtype, 2 or 4
    bytes, not int64's 8), and each window is its own array, not a view that would keep the whole
    buffer it was cut from alive in the shuffle block.
    Tokenization follows demand: a tokenizer batch holds the documents (at most `batch_docs`)
    whose text should give the `batch_tokens` (default: 16 windows, a default shuffle block) that
    the tokens held lack, at the characters per token seen so far. A stream's first block
    tokenizes about that block, where 64 documents of 3.5 KB were 3x the 16 windows of 1,025
    tokens it needed. The batching changes no token: each document is tokenized on its own."""
    dtype = token_dtype(len(tokenizer))
    batch_tokens = batch_tokens or 16 * window
    seen_chars, seen_tokens = 0, 0
    chars = 0  # of the documents in `batch`
    carry = np.empty(0, dtype=dtype)
    pieces: List[Tuple[int, Position]] = []  # (index in carry, position of that token)

    def tokenized(batch):
        nonlocal seen_chars, seen_tokens
        stop_point()
        ids = document_tokens([text for _, text in batch], tokenizer)
        seen_chars, seen_tokens = seen_chars + chars, seen_tokens + sum(map(len, ids))
        return [(pos, doc) for (pos, _), doc in zip(batch, ids) if doc]

    batch: List[Tuple[Position, str]] = []
    for pos, text in docs:
        if text:
            batch.append((pos, text))
            chars += len(text)
            # 3 characters a token until some are seen: errs towards a second, small batch
            per_token = seen_chars / seen_tokens if seen_tokens else 3.0
            if len(batch) < batch_docs and chars < (batch_tokens - len(carry)) * per_token:
                continue
        elif text == UNIT_END and not batch:
            continue
        for doc_pos, ids in tokenized(batch) if batch else []:
            tokens = np.asarray(ids, dtype=dtype)
            if skip_tokens:
                tokens, doc_pos, skip_tokens = tokens[skip_tokens:], doc_pos[:3] + (skip_tokens,), 0
            pieces.append((len(carry), doc_pos))
            carry = np.concatenate([carry, tokens])
            while len(carry) >= window:
                yield pieces[0][1], carry[:window].copy()
                carry = carry[window:]
                if len(carry) == 0:  # a document ended with the window: the next one starts the next
                    pieces = []
                    break
                shifted = [(i - window, p) for i, p in pieces]
                inside = [k for k, (i, _) in enumerate(shifted) if i <= 0][-1]  # holds the new first token
                i, p = shifted[inside]
                pieces = [(0, p[:3] + (p[3] - i,))] + shifted[inside + 1:]
        batch, chars = [], 0
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
            if in_epoch == 0:  # data/prepare_source.py checks this before training; a changed source can still
                raise DataError(f"streaming stream {stream} holds no complete window in epoch {pos[0]}")
            in_epoch = 0


def stream_windows(source: StreamSource, tokenizer: PreTrainedTokenizerBase, seq_len: int, seed: int,
                   shuffle: bool, block: int, stream: int, n_streams: int, state: StreamState
                   ) -> Iterator[Tuple[np.ndarray, StreamState]]:
    """Stream `stream`'s endless windows, each with the state after it, from `state` on."""
    first, taken = state
    docs = stream_documents(source, stream, n_streams, seed, shuffle, first)
    windows = shuffled_windows(packed_windows(docs, tokenizer, seq_len + 1, skip_tokens=first[3],
                                              batch_tokens=block * (seq_len + 1)),
                               block, seed, stream, shuffle)
    for i, item in enumerate(windows):
        if i >= taken:  # the resumed block's windows before `taken` were trained on already
            yield item


class StepBatches:
    """Endless (input_ids, labels), each (b, seq_len) int64, of one dp rank, step after step from
    step `step`: the rank holds slots [lo, hi) of every global batch (its r-th contiguous 1/dp),
    drawn in micro-batches of b. A subclass gives each step's windows of those slots and the
    stream states after the step (`step_windows`, or `step_rows` to draw them as they are asked
    for); they become its position (`consumed`) when the step's last micro-batch is drawn, so a
    checkpoint records exactly what was trained. With
    `read_ahead_steps` > 0 a worker thread prepares that many steps ahead (data/prefetch.py);
    what it prepared is not part of the position until drawn. `waited_s` counts the seconds
    spent in drawing."""

    def __init__(self, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int, step: int,
                 read_ahead_steps: int = 0):
        self.global_batch_size, self.micro_batch_size, self.step = global_batch_size, micro_batch_size, step
        self.lo, self.hi = rank_slots(dp_rank, dp_size, global_batch_size)
        self._unopened: List[Dict[int, Iterator]] = []  # the streams `open_streams` gave, not yet read
        self._opening: Optional[Opening] = None  # their first windows, drawn in the background
        produced = self._generate(step)
        per_step = -(-(self.hi - self.lo) // micro_batch_size)
        self._batches = ReadAhead(produced, read_ahead_steps * per_step, f"read-ahead dp{dp_rank}") \
            if read_ahead_steps > 0 else produced
        self.waited_s = 0.0
        """Seconds the trainer spent drawing micro-batches: waiting on the read-ahead thread, or
        reading and tokenizing inline (the step's metric data_wait_s)."""

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        start = time.perf_counter()
        x, y, done = next(self._batches)
        self.waited_s += time.perf_counter() - start
        if done is not None:  # the step's last micro-batch: the step is consumed
            self.consumed(done[0])
            self.step += 1
        # int64 (the embedding's and the loss's index type) only for the micro-batch handed on
        return torch.from_numpy(x.astype(np.int64)), torch.from_numpy(y.astype(np.int64))

    def close(self) -> None:
        """Stop the read-ahead thread, if any, and the threads still opening streams, and wait for
        them to end (bounded: data/prefetch.py); the training loop calls it (RunData.close_batches) at the end of the run and on a
        failure path, and benches and tests that open many."""
        if isinstance(self._batches, ReadAhead):
            self._batches.close()  # first: the streams opening in its name end at their next stop_point
        if self._opening is not None:
            self._opening.close()  # a stream not yet opened is not

    def open_streams(self, open_stream: Callable[[int, StreamState], Iterator[Tuple[np.ndarray, StreamState]]],
                     n_streams: int, saved: Dict[int, StreamState]
                     ) -> Tuple[Dict[int, StreamState], Dict[int, Iterator[Tuple[np.ndarray, StreamState]]]]:
        """(state, opened stream) of each stream this rank reads: stream t owns the contiguous slots
        [t*B/S, (t+1)*B/S) of every global batch; each opens at its saved state (START when none)."""
        states = {t: saved.get(t, (START, 0))
                  for t in streams_of_slots(self.lo, self.hi, self.global_batch_size, n_streams)}
        opened = {t: open_stream(t, state) for t, state in states.items()}
        self._unopened.append(opened)
        return states, opened

    def _read_first_blocks(self) -> None:
        """Every opened stream's first window drawn in the background, OPEN_THREADS streams at a
        time in slot order: each reads its first unit and fills its first shuffle block. Drawn one
        after another, they made the time to the first batch grow with the B/dp streams a rank
        reads; waited for all at once, it still did (bench/data/first_batch.py): a micro-batch now
        waits for the streams of its own slots, so the first one is ready after the first streams
        and the engine computes on it while the others open. The windows are the ones the streams
        give anyway; only when they are read changes."""
        pending = [(opened, t, opened[t]) for opened in self._unopened for t in opened]
        self._unopened = []
        if len(pending) <= 1 or OPEN_THREADS <= 1:
            return  # each opens at its first draw
        self._opening = Opening(lambda item: next(item[2]), pending, OPEN_THREADS)
        for (opened, t, stream), first in zip(pending, self._opening.futures):
            opened[t] = _first_then(first, stream)

    def step_windows(self, step: int) -> Tuple[List[np.ndarray], Any]:
        """This rank's windows of step `step` (the one after the previous call's), in slot order,
        and the stream states after it."""
        raise NotImplementedError

    def step_rows(self, step: int) -> Tuple[Iterator[np.ndarray], Any]:
        """`step_windows` as an iterator of the rank's hi - lo windows, drawn as they are asked
        for, and the states after the step, complete once the iterator is exhausted."""
        rows, after = self.step_windows(step)
        return iter(rows), after

    def consumed(self, after: Any) -> None:
        """The stream states after the step (from `step_windows`) are now the position."""
        raise NotImplementedError

    def _generate(self, step: int) -> Iterator[Tuple[np.ndarray, np.ndarray, Optional[Tuple[Any]]]]:
        """(input_ids, labels, (states after the step,) on its last micro-batch else None): the
        ids as views of one (b, seq_len + 1) array of the windows' own dtype (2 or 4 bytes a token),
        which is what the read-ahead queue holds; `__next__` makes the int64 tensors."""
        b, n = self.micro_batch_size, self.hi - self.lo
        self._read_first_blocks()
        while True:
            rows, after = self.step_rows(step)
            for i in range(0, n, b):
                batch = np.stack([next(rows) for _ in range(min(b, n - i))])  # (b, seq_len + 1)
                last = i + b >= n
                if last:  # the step's windows of other ranks' slots drawn too: `after` is complete
                    rest = next(rows, None)
                    assert rest is None, "a step gives hi - lo windows"
                yield batch[:, :-1], batch[:, 1:], (after,) if last else None
            step += 1


def _first_then(first: Future, rest: Iterator):
    """A stream whose first window `first` is being drawn in the background: it, then the rest."""
    yield first.result()
    yield from rest


class StreamingBatches(StepBatches):
    """StepBatches of one streamed source: each stream gives its B/S windows to every step, in
    stream order; `state()` is the position of every stream the rank reads, for checkpoints."""

    def __init__(self, open_stream: Callable[[int, StreamState], Iterator[Tuple[np.ndarray, StreamState]]],
                 n_streams: int, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                 step: int, states: Dict[int, StreamState], read_ahead_steps: int = 0):
        self.per_stream = global_batch_size // n_streams
        super().__init__(global_batch_size, micro_batch_size, dp_rank, dp_size, step, read_ahead_steps)
        self.states, self.streams = self.open_streams(open_stream, n_streams, states)

    def step_rows(self, step: int) -> Tuple[Iterator[np.ndarray], Dict[int, StreamState]]:
        """Drawn as asked for: a micro-batch waits only for its own streams (`_read_first_blocks`)."""
        after: Dict[int, StreamState] = {}

        def rows() -> Iterator[np.ndarray]:  # stream by stream, in slot order
            for s, stream in self.streams.items():
                for j in range(self.per_stream):
                    w, after[s] = next(stream)
                    if self.lo <= s * self.per_stream + j < self.hi:
                        yield w
        return rows(), after

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
    return {"format": STATE_FORMAT, "streams_total": n_streams, "step": step, "streams": streams}


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


def positions_of_units(data_state: Optional[dict]) -> Optional[dict]:
    """The checkpoint's stream positions when they are positions in units, else None (saved
    before units: the run re-reads to the checkpoint's step instead)."""
    return data_state if data_state is not None and data_state.get("format") == STATE_FORMAT else None
