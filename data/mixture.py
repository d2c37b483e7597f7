"""A mixture of data sources (`data.mix`): which source each sample comes from, and the batches
of a run that draws from several sources with one tokenizer.

The source of global sample g is cycle[g % T], Tijdeman's earliest-deadline interleave ("The
chairman assignment problem", 1980): every source stays within 1 - 1/(2(k-1)) < 1 sample of its
share after every sample, for any number k of sources; a pure function of g, so it is the same at
every layout and a resume needs only the sample count. Each source then reads its own windows in
its own order (cached: reshuffled per epoch; streamed: its streams' next windows). docs/data.md,
"Mixtures", states the rule and the order; data/mixture_spec.py holds the sources' fields.
"""
import heapq
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

from data.sampler import epoch_order
from data.spec import DataError
from data.streaming import (STATE_FORMAT, Batch, StepBatches, StreamState, decoded_states, encoded_states,
                            latest_states)

MAX_CYCLE = 1_000_000
"""Longest interleave cycle (T samples): computed once per process at start-up (1 s for 1,000,000
samples of 3 or 34 sources on a loaded 2-core machine; 0.3 of 1 and 0.7 is a cycle of 10)."""


class Interleave:
    """The source of every position of the global sample stream, and the counts per source."""

    def __init__(self, weights: List[Fraction]):
        denominator = math.lcm(*(w.denominator for w in weights))
        scaled = [int(w * denominator) for w in weights]
        divisor = math.gcd(*scaled)
        self.weights = [w // divisor for w in scaled]  # W_s, integers, sum T
        self.period = sum(self.weights)
        if self.period > MAX_CYCLE:
            shown = ", ".join(str(float(w)) for w in weights)
            raise DataError(f"data.mix weights [{shown}] repeat only every {self.period:,} samples (over "
                            f"{MAX_CYCLE:,}); give them with fewer digits (e.g. 0.33 or integers like 1, 2)")
        self.cycle = self._one_cycle()

    def _one_cycle(self) -> np.ndarray:
        """Tijdeman's rule in integers, with D = 2(k - 1) and n = g + 1: source s may take sample n
        from its release, the least n with D * (W_s * n - T * count_s) >= T, and is due at
        T * (D * count_s + D - 1) / (D * W_s); of the released sources the earliest due goes
        first. Two heaps keep each position O(log k)."""
        positive = [s for s, w in enumerate(self.weights) if w > 0]
        if len(positive) == 1:
            return np.full(self.period, positive[0], dtype=np.int64)
        T, D = self.period, 2 * (len(positive) - 1)
        scale = math.lcm(*(self.weights[s] for s in positive))  # due dates as exact integers

        def release(s: int, count: int) -> int:
            return -(-T * (D * count + 1) // (D * self.weights[s]))

        def due(s: int, count: int) -> int:
            return (D * count + D - 1) * (scale // self.weights[s])

        counts = [0] * len(self.weights)
        waiting = [(release(s, 0), s) for s in positive]
        heapq.heapify(waiting)
        ready: List[Tuple[int, int]] = []
        cycle = np.empty(T, dtype=np.int64)
        for g in range(T):
            while waiting and waiting[0][0] <= g + 1:
                _, s = heapq.heappop(waiting)
                heapq.heappush(ready, (due(s, counts[s]), s))
            s = heapq.heappop(ready)[1]  # never empty: Tijdeman's theorem
            cycle[g] = s
            counts[s] += 1
            heapq.heappush(waiting, (release(s, counts[s]), s))
        return cycle

    def counts(self, position: int) -> np.ndarray:
        """Samples each source gave to positions [0, position)."""
        cycles, rest = divmod(position, self.period)
        return cycles * np.asarray(self.weights, dtype=np.int64) + np.bincount(self.cycle[:rest],
                                                                             minlength=len(self.weights))

    def slots(self, start: int, stop: int) -> Tuple[np.ndarray, np.ndarray]:
        """(source, that source's own sample position) of each global position in [start, stop)."""
        source = self.cycle[np.arange(start, stop) % self.period]
        local = np.empty(stop - start, dtype=np.int64)
        before = self.counts(start)
        for s in np.unique(source):
            mine = source == s
            local[mine] = before[s] + np.arange(int(mine.sum()))
        return source, local


class SourceOrder:
    """Window index at each of one source's sample positions: every window once per epoch,
    reshuffled by (the source's seed, epoch) like data/sampler.py. Keeps its current epoch's
    permutation itself (the sampler's shared cache of two would thrash between sources)."""

    def __init__(self, n_windows: int, seed: int, shuffle: bool):
        self.n, self.seed, self.shuffle = n_windows, seed, shuffle
        self.epoch, self.order = -1, None

    def indices(self, positions: np.ndarray) -> np.ndarray:
        if not self.shuffle:
            return positions % self.n
        out = np.empty(len(positions), dtype=np.int64)
        epochs = positions // self.n
        for epoch in np.unique(epochs):
            if epoch != self.epoch:
                self.epoch, self.order = int(epoch), epoch_order.__wrapped__(self.n, self.seed, int(epoch)).numpy()
            here = epochs == epoch
            out[here] = self.order[positions[here] % self.n]
        return out


def source_seed(seed: int, index: int) -> int:
    """Source i's own data order: the run's seed plus i (a one-source mixture is the plain source)."""
    return seed + index


@dataclass
class SourceReader:
    """Where one source's samples come from: cached windows (map-style), or `n_streams` logical
    streams opened by `open_stream(stream, state)` (data/streaming.py's stream_windows)."""
    windows: Optional[np.ndarray] = None
    seed: int = 0
    shuffle: bool = True
    open_stream: Optional[Callable[[int, StreamState], Iterator[Tuple[np.ndarray, StreamState]]]] = None
    n_streams: int = 1


class MixtureBatches(StepBatches):
    """data/streaming.py's StepBatches over a mixture, and the position of every stream it reads
    (`state()`, for checkpoints).

    Slot j of step k's global batch (position k*B + j) holds the interleave's source for that
    position. A cached source gives it the window at that source's own position (SourceOrder).
    A streamed source with S streams gives it the next window of stream j * S // B: each stream
    owns a contiguous B/S of the slots, as in data/streaming.py, and advances by the slots of its
    share the source holds in that step. So a rank reads only the streams of its slots, and a
    one-source mixture is that source's own order."""

    def __init__(self, readers: List[SourceReader], interleave: Interleave, global_batch_size: int,
                 micro_batch_size: int, dp_rank: int, dp_size: int, step: int = 0,
                 states: Optional[Dict[int, Dict[int, StreamState]]] = None, read_ahead_steps: int = 0):
        super().__init__(global_batch_size, micro_batch_size, dp_rank, dp_size, step, read_ahead_steps)
        self.readers, self.interleave = readers, interleave
        self.orders = {s: SourceOrder(len(r.windows), r.seed, r.shuffle)
                       for s, r in enumerate(readers) if r.windows is not None}
        self.states: Dict[int, Dict[int, StreamState]] = {}
        self.streams: Dict[int, Dict[int, Iterator]] = {}
        for s, r in enumerate(readers):
            if r.open_stream is not None:
                saved = (states or {}).get(s, {})
                self.states[s], self.streams[s] = self.open_streams(r.open_stream, r.n_streams, saved)

    def step_windows(self, step: int) -> Tuple[List[np.ndarray], Dict[int, Dict[int, StreamState]]]:
        B, lo, hi = self.global_batch_size, self.lo, self.hi
        sources, local = self.interleave.slots(step * B, (step + 1) * B)
        rows: List[Optional[np.ndarray]] = [None] * (hi - lo)
        after: Dict[int, Dict[int, StreamState]] = {}
        for s, reader in enumerate(self.readers):
            if reader.windows is not None:
                slots = np.flatnonzero(sources[lo:hi] == s)
                for j, w in zip(slots, reader.windows[self.orders[s].indices(local[lo:hi][slots])]):
                    rows[j] = w
                continue
            per = B // reader.n_streams
            after[s] = {}
            for t, stream in self.streams[s].items():
                for j in range(t * per, (t + 1) * per):
                    if sources[j] == s:  # the stream's next window; kept where the slot is this rank's
                        w, after[s][t] = next(stream)
                        if lo <= j < hi:
                            rows[j - lo] = w
        return rows, after

    def consumed(self, after: Dict[int, Dict[int, StreamState]]) -> None:
        for s, states in after.items():
            self.states[s].update(states)

    def state(self) -> dict:
        """JSON-able: the steps consumed and the state of each stream this rank reads, per source."""
        return {"step": self.step, "sources": {str(s): encoded_states(states) for s, states in self.states.items()}}


def merge_mixture_states(local_states: List[dict]) -> dict:
    """One position of every stream of every source from the ranks' `state()`s."""
    step, latest = latest_states(local_states)
    sources: Dict[str, dict] = {}
    for local in latest:
        for s, streams in local["sources"].items():
            sources.setdefault(s, {}).update(streams)
    return {"format": STATE_FORMAT, "step": step, "sources": sources}


def mixture_states_from(data_state: Optional[dict]) -> Dict[int, Dict[int, StreamState]]:
    if data_state is None:
        return {}
    return {int(s): decoded_states(streams) for s, streams in data_state["sources"].items()}


def mixture_micro_batches(windows: List[np.ndarray], seeds: List[int], shuffles: List[bool], interleave: Interleave,
                          global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                          start_sample: int = 0) -> Iterator[Batch]:
    """MixtureBatches over cached sources only (all windows (N_s, seq_len + 1)), from global
    position `start_sample` (a multiple of the global batch): a pure function of the position."""
    assert start_sample % global_batch_size == 0, (start_sample, global_batch_size)
    readers = [SourceReader(w, seed, shuffle) for w, seed, shuffle in zip(windows, seeds, shuffles)]
    return MixtureBatches(readers, interleave, global_batch_size, micro_batch_size, dp_rank, dp_size,
                          start_sample // global_batch_size)
