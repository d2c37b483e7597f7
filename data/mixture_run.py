"""The data of a run over a mixture (`data.mix`): every source checked and its cache built (a
streamed source, `streaming: true`, is read on the fly instead), the run's micro-batches
interleaved from them (data/mixture.py), and validation per source.

Start-up checks, before any process group: every source has at least one complete window (in
every stream, when streamed); a source smaller than its share repeats, and the run says how
often. With evaluation on, every source has `eval_batches` global batches of validation
windows. A source's own errors (an unknown file, a missing text column...) name the source.
"""
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from data.mixture import Interleave, MixtureBatches, SourceReader, merge_mixture_states, mixture_states_from, source_seed
from data.mixture_spec import MixSource, parse_mixture
from data.pipeline import (Batch, RunData, check_streams, first_windows, on_device, shared_over_tp, stream_sources,
                           train_source)
from data.spec import DataError, DataSpec
from data.streaming import stream_windows
from data.windows import CachedStreams, cached_validation_windows, prepare_streams, windows


@contextmanager
def naming(source: MixSource):
    """A source's own DataError, prefixed with the source's label."""
    try:
        yield
    except DataError as e:
        raise DataError(f"data.mix source {source.label!r}: {e}") from None


def build_source_caches(sources: List[MixSource], tokenizer: PreTrainedTokenizerBase,
                        progress: bool = False) -> List[Optional[CachedStreams]]:
    """Every cached source's token streams, built once (or reused), in source order; None for a
    streamed source (it tokenizes on the fly)."""
    built = []
    for source in tqdm(sources, desc="sources", unit="source", disable=not progress):
        with naming(source):
            built.append(None if source.spec.streaming else prepare_streams(source.spec, tokenizer))
    return built


@dataclass
class MixtureData:
    """data/pipeline.py's RunData for a mixture: the same methods the training loop calls, plus
    the counts per source and validation per source."""
    sources: List[MixSource]
    parts: List[RunData]
    """One per source: its windows (train_windows None when streamed), its seed
    (data/mixture.py: source_seed) and its spec."""
    windows_per_epoch: List[Optional[int]]
    """Training windows per epoch of each source; None for a streamed source too large to count
    at start-up."""
    interleave: Interleave
    tokenizer: PreTrainedTokenizerBase
    seq_len: int
    seed: int
    global_batch_size: int
    micro_batch_size: int

    @property
    def labels(self) -> List[str]:
        return [s.label for s in self.sources]

    @property
    def has_validation(self) -> bool:
        return all(part.has_validation for part in self.parts)

    @property
    def streamed(self) -> List[int]:
        return [i for i, part in enumerate(self.parts) if part.train_windows is None]

    def readers(self) -> List[SourceReader]:
        readers = []
        for part in self.parts:
            spec = part.spec
            if part.train_windows is not None:
                readers.append(SourceReader(part.train_windows, part.seed, spec.shuffle))
                continue
            open_stream = partial(stream_windows, train_source(spec), self.tokenizer, self.seq_len, part.seed,
                                  spec.shuffle, spec.shuffle_buffer, n_streams=spec.streams)
            readers.append(SourceReader(seed=part.seed, shuffle=spec.shuffle, n_streams=spec.streams,
                                        open_stream=lambda t, state, open_stream=open_stream:
                                        open_stream(stream=t, state=state)))
        return readers

    def train_batches(self, dp_rank: int, dp_size: int, start_sample: int = 0,
                      data_state: Optional[dict] = None) -> Iterator[Batch]:
        """This dp rank's micro-batches from global sample position `start_sample` on. Cached
        sources need nothing but the position; streamed ones resume from `data_state` (the
        checkpoint's stream positions), or without it re-read up to the position."""
        step = start_sample // self.global_batch_size
        resume_here = data_state is not None or not self.streamed
        batches = MixtureBatches(self.readers(), self.interleave, self.global_batch_size, self.micro_batch_size,
                                 dp_rank, dp_size, step if resume_here else 0, mixture_states_from(data_state))
        if not resume_here:
            for _ in range(step * self.global_batch_size // dp_size // self.micro_batch_size):
                next(batches)
        return batches

    def feed(self, batches: Iterator[Batch], tp_group, device: torch.device) -> Iterator[Batch]:
        """As RunData.feed: with a streamed source at tp > 1, only TP rank 0 of a stage reads."""
        if not self.streamed or tp_group is None:
            return on_device(batches, device)
        import torch.distributed as dist
        reader = dist.get_rank(tp_group) == 0
        return shared_over_tp(on_device(batches, device) if reader else None, tp_group,
                              (self.micro_batch_size, self.seq_len), device)

    def gather_data_state(self, batches: MixtureBatches) -> Optional[dict]:
        """Collective when a source is streamed (every rank calls it): the position of every stream
        of every streamed source. None when all are cached: the sample count is the whole position."""
        if not self.streamed:
            return None
        import torch.distributed as dist
        everyone: List[Optional[dict]] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, batches.state())
        return merge_mixture_states(everyone)

    def check_data_state(self, data_state: Optional[dict], samples: int) -> None:
        """A checkpoint's stream positions fit this mixture (before training starts)."""
        if data_state is None:
            return
        if "sources" not in data_state:
            raise DataError("the checkpoint holds the position of one streamed source, this run reads a mixture "
                            "(data.mix): resume with the data section it was saved with")
        saved = {int(s): len(streams) for s, streams in data_state["sources"].items()}
        wanted = {i: self.parts[i].spec.streams for i in self.streamed}
        if saved != wanted:
            raise DataError(f"the checkpoint's data position has streams {saved} per streamed source (by index "
                            f"in data.mix), this run {wanted}: resume with the data.mix it was saved with")
        if data_state["step"] * self.global_batch_size != samples:
            raise DataError(f"the checkpoint's data position is after {data_state['step']} steps of "
                            f"{self.global_batch_size} samples, not after its {samples} samples: "
                            f"resume with the train.global_batch_size it was saved with")

    def samples_by_source(self, samples: int) -> Dict[str, int]:
        """label -> samples drawn from that source in global positions [0, samples)."""
        return dict(zip(self.labels, (int(c) for c in self.interleave.counts(samples))))

    def eval_global_batches(self, wanted: int) -> int:
        """Validation global batches every source holds, up to `wanted`."""
        return min(part.eval_global_batches(wanted) for part in self.parts)

    def validation_losses(self, loss_of: Callable[[RunData], float]) -> Tuple[float, Dict[str, float]]:
        """(validation loss, label -> each source's own `loss_of`): the mixture's loss is the
        per-source losses weighted by the mixture's weights, i.e. the expected loss of a
        validation sample drawn the way training samples are."""
        by_source = {label: loss_of(part) for label, part in zip(self.labels, self.parts)}
        weights = {s.label: s.weight for s in self.sources}
        total = sum(weights[label] for label in by_source)
        return float(sum(float(weights[label] / total) * loss for label, loss in by_source.items())), by_source

    def repeat_report(self, steps: int) -> str:
        """What the run will draw from each source: samples, windows per epoch, epochs; once at start."""
        drawn = self.interleave.counts(steps * self.global_batch_size)
        lines = [f"data.mix: {len(self.sources)} sources over {steps} steps of {self.global_batch_size} samples"]
        for source, per_epoch, n in zip(self.sources, self.windows_per_epoch, drawn):
            head = f"  {source.label}: weight {float(source.weight):g}, {int(n):,} samples"
            if per_epoch is None:
                lines.append(head + " (streamed: windows per epoch not counted at start-up; each stream "
                                    "starts its next epoch when it ends)")
                continue
            epochs = n / per_epoch
            lines.append(head + f" of {per_epoch:,} windows = {epochs:.2f} epochs" + (" (repeats)" if epochs > 1 else ""))
        return "\n".join(lines)


def prepare_mixture(spec: DataSpec, tokenizer: PreTrainedTokenizerBase, seq_len: int, seed: int,
                    global_batch_size: int, micro_batch_size: int, evaluate: bool,
                    eval_batches: int = 1) -> MixtureData:
    """Check the mixture against the run and build (or reuse) every source's cache; raises DataError."""
    sources = parse_mixture(spec)
    interleave = Interleave([s.weight for s in sources])
    if evaluate:
        for s in sources:
            if s.spec.val_split is None and s.spec.val_fraction <= 0:
                raise DataError(f"train.eval_every > 0 needs validation data from every source: data.mix source "
                                f"{s.label!r} has neither val_split nor val_fraction (or set train.eval_every=0)")
    window, need_val = seq_len + 1, eval_batches * global_batch_size
    parts, per_epoch = [], []
    for source, streams in zip(sources, build_source_caches(sources, tokenizer)):
        part = RunData(source.spec, tokenizer, seq_len, source_seed(seed, source.index), global_batch_size,
                       micro_batch_size)
        if streams is None:  # streamed: every stream holds a window; validation read once and cached
            with naming(source):
                train, val = stream_sources(source.spec)
                per_epoch.append(check_streams(source.spec, train, tokenizer, seq_len, global_batch_size,
                                               windows_per_stream=1))
                if val is not None and evaluate:
                    part.val_windows = cached_validation_windows(
                        source.spec, tokenizer, seq_len, need_val,
                        lambda val=val: first_windows(val, tokenizer, seq_len, need_val))
        else:
            part.train_windows = windows(streams.train, seq_len)
            part.val_windows = windows(streams.val, seq_len) if streams.val is not None else None
            per_epoch.append(len(part.train_windows))
            if len(part.train_windows) == 0:
                raise DataError(f"data.mix source {source.label!r} gives {len(streams.train)} training tokens, not "
                                f"one complete window of seq_len+1 = {window}; use more data or a shorter data.seq_len")
        found = 0 if part.val_windows is None else len(part.val_windows)
        if evaluate and found < need_val:
            raise DataError(f"data.mix source {source.label!r}: the validation data gives {found} windows of "
                            f"seq_len+1 = {window} tokens, fewer than train.eval_batches x global batch = "
                            f"{eval_batches} x {global_batch_size} = {need_val}; raise its val_fraction, lower "
                            f"train.eval_batches, or set train.eval_every=0")
        parts.append(part)
    return MixtureData(sources, parts, per_epoch, interleave, tokenizer, seq_len, seed, global_batch_size,
                       micro_batch_size)
