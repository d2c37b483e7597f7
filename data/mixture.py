"""A mixture of data sources (`data.mix`): which source each sample comes from, and the data of
a run that draws from several sources with one tokenizer.

Interleave. Position g of the global sample stream goes to the source with the largest deficit
weight_s * (g + 1) - count_s(g) (ties to the lower index), where count_s(g) is how many of the
positions before g went to s. Every source's cumulative count then stays within one sample of
weight_s * samples after every sample, so after every step. The weights are exact fractions
(0.3 is 3/10), scaled to integers W_s with sum T: after T positions every count is exactly
W_s, the deficits are back to zero and the pattern repeats. So the source of a position is a
table lookup, cycle[g % T], a pure function of g: the same at every layout, and a resume needs
only the sample count.

Each source then reads its own windows in its own order: a source's k-th sample is position k
of that source's endless stream, reshuffled every epoch (data/sampler.py's permutation, seeded
per source), so a source smaller than its share repeats epoch after epoch. dp rank r takes the
r-th contiguous 1/dp of every global batch, as for a single source (docs/design.md contract 3).

Fields. A source is the source fields of data/spec.py's DataSpec (everything but the run-wide
tokenizer, seq_len and mix) plus `weight` and `label`; a field it leaves out takes the data
section's value, so there is one definition of what a source is.
"""
import math
from dataclasses import dataclass, fields, replace
from fractions import Fraction
from typing import Dict, Iterator, List, Optional, Tuple
import typing

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from data.sampler import epoch_order
from data.spec import DataError, DataSpec

RUN_WIDE = ("tokenizer", "seq_len", "mix")
"""DataSpec fields that belong to the run, not to a source: one tokenizer, one sample length."""
SOURCE_FIELDS = tuple(f.name for f in fields(DataSpec) if f.name not in RUN_WIDE)
MIX_FIELDS = SOURCE_FIELDS + ("weight", "label")
MAX_CYCLE = 1_000_000
"""Longest interleave cycle (T samples): computed once per process, in about a second at most."""

Batch = Tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class MixSource:
    """One checked source of a mixture."""
    index: int
    label: str
    weight: Fraction
    """As given (not normalised); exact: 0.3 is 3/10."""
    spec: DataSpec
    """The data section with this source's fields in place of the section's own, and no mix."""


def _typed(where: str, value, annotation):
    """`value` as the DataSpec field's type, or a DataError naming the field and the type."""
    if typing.get_origin(annotation) is typing.Union:  # Optional[T]
        if value is None:
            return None
        annotation = [a for a in typing.get_args(annotation) if a is not type(None)][0]
    if annotation is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if annotation is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if annotation in (str, bool) and type(value) is annotation:
        return value
    raise DataError(f"{where}={value!r} has the wrong type: expected {annotation.__name__}")


def _weight(where: str, value) -> Fraction:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DataError(f"{where}={value!r} must be a number >= 0")
    if value < 0:
        raise DataError(f"{where}={value!r} is negative; weights are shares of the samples, >= 0")
    return Fraction(repr(value)) if isinstance(value, float) else Fraction(value)


def parse_mixture(spec: DataSpec) -> List[MixSource]:
    """The checked sources of `spec.mix` (DataError, one line, naming the source and the field)."""
    hints = typing.get_type_hints(DataSpec)
    sources: List[MixSource] = []
    for i, item in enumerate(spec.mix):
        where = f"data.mix[{i}]"
        if not isinstance(item, dict):
            raise DataError(f"{where} must be a mapping of source fields ({', '.join(MIX_FIELDS)}), got {item!r}")
        for key in item:
            if key in RUN_WIDE:
                raise DataError(f"{where}.{key}: one {key} for all sources of a mixture; set data.{key} instead")
            if key not in MIX_FIELDS:
                raise DataError(f"{where} has an unknown field {key!r}; the fields of a source: {', '.join(MIX_FIELDS)}")
        values = {k: _typed(f"{where}.{k}", v, hints[k]) for k, v in item.items() if k in SOURCE_FIELDS}
        source_spec = replace(spec, mix=[], **values)
        label = item.get("label", source_spec.name)
        if not isinstance(label, str) or not label:
            raise DataError(f"{where}.label={label!r} must be a non-empty string")
        sources.append(MixSource(i, label, _weight(f"{where}.weight", item.get("weight", 1)), source_spec))
    labels = [s.label for s in sources]
    for s in sources:
        if labels.count(s.label) > 1:
            twins = [i for i, label in enumerate(labels) if label == s.label]
            raise DataError(f"data.mix: sources {twins} share the label {s.label!r}; give each its own `label`")
    if not sources:
        raise DataError("data.mix is empty; list at least one source, or leave data.mix out for one source")
    if sum(s.weight for s in sources) == 0:
        raise DataError("data.mix: every weight is 0; give at least one source a positive weight")
    return sources


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
        """Largest deficit first, in integers: deficit_s * T = W_s * (g + 1) - T * count_s(g)."""
        n, total = len(self.weights), self.period
        deficit = [0] * n  # W_s * g - T * count_s(g) before position g
        cycle = np.empty(total, dtype=np.int64)
        for g in range(total):
            best = max(range(n), key=lambda s: (deficit[s] + self.weights[s], -s))
            for s in range(n):
                deficit[s] += self.weights[s]
            deficit[best] -= total
            cycle[g] = best
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


def mixture_micro_batches(windows: List[np.ndarray], seeds: List[int], shuffles: List[bool], interleave: Interleave,
                          global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                          start_sample: int = 0) -> Iterator[Batch]:
    """Endless (input_ids, labels), each (b, seq_len) int64, of this dp rank in step order from
    global position `start_sample` (a multiple of the global batch): data/sampler.py's
    micro_batches over several sources' windows (all (N_s, seq_len + 1))."""
    assert start_sample % global_batch_size == 0, (start_sample, global_batch_size)
    orders = [SourceOrder(len(w), seed, shuffle) for w, seed, shuffle in zip(windows, seeds, shuffles)]
    per_rank = global_batch_size // dp_size
    step = start_sample // global_batch_size
    width = windows[0].shape[1]
    while True:
        first = step * global_batch_size + dp_rank * per_rank
        sources, local = interleave.slots(first, first + per_rank)
        for start in range(0, per_rank, micro_batch_size):
            source, position = sources[start:start + micro_batch_size], local[start:start + micro_batch_size]
            batch = np.empty((len(source), width), dtype=np.int64)
            for s in np.unique(source):
                mine = source == s
                batch[mine] = windows[s][orders[s].indices(position[mine])]
            batch = torch.from_numpy(batch)  # (b, seq_len + 1)
            yield batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        step += 1
