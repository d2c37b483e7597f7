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
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from data.mixture import Interleave, MixtureBatches, SourceReader, merge_mixture_states, mixture_states_from, source_seed
from data.mixture_spec import MixSource, parse_mixture
from data.pipeline import Batch, RunData, SourceData
from data.prepare_source import (check_streams, read_ahead_steps, stream_sources, validation_windows_across_units,
                                 with_streams)
from data.spec import DataError, DataSpec
from data.streaming import gathered_states, positions_of_units
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


@dataclass(kw_only=True)
class MixtureData(RunData):
    """A run's data over a mixture: RunData's methods, plus the counts per source and
    validation per source."""
    sources: List[MixSource]
    parts: List[SourceData]
    """One per source: its windows (train_windows None when streamed), its seed
    (data/mixture.py: source_seed) and its spec."""
    windows_per_epoch: List[Optional[int]]
    """Training windows per epoch of each source; None for a streamed source too large to count
    at start-up."""
    interleave: Interleave

    @property
    def labels(self) -> List[str]:
        return [s.label for s in self.sources]

    @property
    def has_validation(self) -> bool:
        return all(part.has_validation for part in self.parts)

    @property
    def streamed(self) -> bool:
        return any(part.streamed for part in self.parts)

    def readers(self) -> List[SourceReader]:
        return [SourceReader(seed=part.seed, shuffle=part.spec.shuffle, n_streams=part.spec.streams,
                             open_stream=part.stream_opener()) if part.streamed
                else SourceReader(part.train_windows, part.seed, part.spec.shuffle) for part in self.parts]

    def train_batches(self, dp_rank: int, dp_size: int, start_sample: int = 0,
                      data_state: Optional[dict] = None) -> Iterator[Batch]:
        """Cached sources need nothing but the position; streamed ones resume from `data_state`,
        or without it re-read up to the position."""
        data_state = positions_of_units(data_state)
        resume_here = data_state is not None or not self.streamed
        batches = MixtureBatches(self.readers(), self.interleave, self.global_batch_size, self.micro_batch_size,
                                 dp_rank, dp_size, start_sample // self.global_batch_size if resume_here else 0,
                                 mixture_states_from(data_state), self.read_ahead_steps if self.streamed else 0)
        return batches if resume_here else self.reread_to(batches, start_sample, dp_size)

    def gather_data_state(self, batches: MixtureBatches) -> Optional[dict]:
        """The position of every stream of every streamed source."""
        if not self.streamed:
            return None
        return merge_mixture_states(gathered_states(batches.state()))

    def check_data_state(self, data_state: Optional[dict], samples: int) -> None:
        data_state = positions_of_units(data_state)
        if data_state is None:
            return
        if "sources" not in data_state:
            raise DataError("the checkpoint holds the position of one streamed source, this run reads a mixture "
                            "(data.mix): resume with the data section it was saved with")
        saved = {int(s): len(streams) for s, streams in data_state["sources"].items()}
        wanted = {i: part.spec.streams for i, part in enumerate(self.parts) if part.streamed}
        if saved != wanted:
            raise DataError(f"the checkpoint's data position has streams {saved} per streamed source (by index "
                            f"in data.mix), this run {wanted}: resume with the data.mix it was saved with")
        self.check_saved_step(data_state, samples)

    def step_record(self, samples: int) -> Dict[str, Any]:
        return {"samples_by_source": self.samples_by_source(samples)}

    def samples_by_source(self, samples: int) -> Dict[str, int]:
        """label -> samples drawn from that source in global positions [0, samples)."""
        return dict(zip(self.labels, (int(c) for c in self.interleave.counts(samples))))

    def eval_global_batches(self, wanted: int) -> int:
        """Validation global batches every source holds, up to `wanted`."""
        return min(part.eval_global_batches(wanted) for part in self.parts)

    def validation_losses(self, loss_of: Callable[[SourceData], float]) -> Tuple[float, Dict[str, float]]:
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
        part = SourceData(spec=source.spec, tokenizer=tokenizer, seq_len=seq_len, seed=source_seed(seed, source.index),
                          global_batch_size=global_batch_size, micro_batch_size=micro_batch_size)
        if streams is None:  # streamed: every stream holds a window; validation read once and cached
            with naming(source):
                train, val = stream_sources(source.spec)
                part.train_stream, part.spec = train, with_streams(source.spec, train, global_batch_size)
                per_epoch.append(check_streams(part.spec, train, tokenizer, seq_len, part.seed, global_batch_size,
                                               windows_per_stream=1))
                if val is not None and evaluate:
                    part.val_windows = cached_validation_windows(
                        part.spec, tokenizer, seq_len, need_val,
                        lambda val=val: validation_windows_across_units(val, tokenizer, seq_len, need_val),
                        val.reader.fingerprint())
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
    return MixtureData(sources=sources, parts=parts, windows_per_epoch=per_epoch, interleave=interleave,
                       tokenizer=tokenizer, seq_len=seq_len, seed=seed, global_batch_size=global_batch_size,
                       micro_batch_size=micro_batch_size,
                       read_ahead_steps=read_ahead_steps(spec, [p.spec for p in parts if p.streamed], global_batch_size))
