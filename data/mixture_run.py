"""The data of a run over a mixture (`data.mix`): every source's cache, checked, and the run's
micro-batches interleaved from them (data/mixture.py), with validation per source.

Start-up checks, before any process group: every source has at least one complete window (a
source smaller than its share repeats, and the run says how often); with evaluation on, every
source has `eval_batches` global batches of validation windows. A source's own errors (an
unknown file, a missing text column...) name the source.
"""
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from data.mixture import Interleave, MixSource, mixture_micro_batches, parse_mixture, source_seed
from data.pipeline import Batch, RunData, on_device
from data.spec import DataError, DataSpec
from data.windows import CachedStreams, prepare_streams, windows


def build_source_caches(sources: List[MixSource], tokenizer: PreTrainedTokenizerBase,
                        progress: bool = False) -> List[CachedStreams]:
    """Every source's token streams, built once (or reused), in source order."""
    built = []
    for source in tqdm(sources, desc="sources", unit="source", disable=not progress):
        if source.spec.streaming:
            raise DataError(f"data.mix source {source.label!r}: streaming sources in a mixture are not "
                            f"supported yet; set streaming: false for it (map-style, cached)")
        try:
            built.append(prepare_streams(source.spec, tokenizer))
        except DataError as e:
            raise DataError(f"data.mix source {source.label!r}: {e}") from None
    return built


@dataclass
class MixtureData:
    """data/pipeline.py's RunData for a mixture: the same methods the training loop calls, plus
    the counts per source and validation per source."""
    sources: List[MixSource]
    parts: List[RunData]
    """One per source: its windows, its seed (data/mixture.py: source_seed) and its spec."""
    interleave: Interleave
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

    def train_batches(self, dp_rank: int, dp_size: int, start_sample: int = 0,
                      data_state: Optional[dict] = None) -> Iterator[Batch]:
        """This dp rank's micro-batches from global sample position `start_sample` on: a pure
        function of the position, so a resume needs nothing else."""
        return mixture_micro_batches([p.train_windows for p in self.parts], [p.seed for p in self.parts],
                                     [p.spec.shuffle for p in self.parts], self.interleave, self.global_batch_size,
                                     self.micro_batch_size, dp_rank, dp_size, start_sample)

    def feed(self, batches: Iterator[Batch], tp_group, device: torch.device) -> Iterator[Batch]:
        return on_device(batches, device)

    def gather_data_state(self, batches: Iterator[Batch]) -> Optional[dict]:
        return None  # the sample count is the whole position

    def check_data_state(self, data_state: Optional[dict], samples: int) -> None:
        if data_state is not None:
            raise DataError("the checkpoint holds the position of streamed data, this run reads a mixture of "
                            "cached sources (data.mix): resume with the data section it was saved with")

    def samples_by_source(self, samples: int) -> Dict[str, int]:
        """label -> samples drawn from that source in global positions [0, samples)."""
        return dict(zip(self.labels, (int(c) for c in self.interleave.counts(samples))))

    def eval_global_batches(self, wanted: int) -> int:
        """Validation global batches every source holds, up to `wanted`."""
        return min(part.eval_global_batches(wanted) for part in self.parts)

    def overall_val_loss(self, by_source: Dict[str, float]) -> float:
        """The mixture's validation loss: the per-source losses weighted by the mixture's weights,
        i.e. the expected loss of a validation sample drawn the way training samples are."""
        weights = {s.label: s.weight for s in self.sources}
        total = sum(weights[label] for label in by_source)
        return float(sum(float(weights[label] / total) * loss for label, loss in by_source.items()))

    def repeat_report(self, steps: int) -> str:
        """What the run will draw from each source: samples, windows per epoch, epochs; once at start."""
        drawn = self.interleave.counts(steps * self.global_batch_size)
        lines = [f"data.mix: {len(self.sources)} sources over {steps} steps of {self.global_batch_size} samples"]
        for source, part, n in zip(self.sources, self.parts, drawn):
            epochs = n / len(part.train_windows)
            lines.append(f"  {source.label}: weight {float(source.weight):g}, {int(n):,} samples of "
                         f"{len(part.train_windows):,} windows = {epochs:.2f} epochs"
                         + (" (repeats)" if epochs > 1 else ""))
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
    parts = []
    for source, streams in zip(sources, build_source_caches(sources, tokenizer)):
        part = RunData(source.spec, tokenizer, seq_len, source_seed(seed, source.index), global_batch_size,
                       micro_batch_size, windows(streams.train, seq_len),
                       windows(streams.val, seq_len) if streams.val is not None else None)
        if len(part.train_windows) == 0:
            raise DataError(f"data.mix source {source.label!r} gives {len(streams.train)} training tokens, not one "
                            f"complete window of seq_len+1 = {window}; use more data or a shorter data.seq_len")
        found = 0 if part.val_windows is None else len(part.val_windows)
        if evaluate and found < need_val:
            raise DataError(f"data.mix source {source.label!r}: the validation data gives {found} windows of "
                            f"seq_len+1 = {window} tokens, fewer than train.eval_batches x global batch = "
                            f"{eval_batches} x {global_batch_size} = {need_val}; raise its val_fraction, lower "
                            f"train.eval_batches, or set train.eval_every=0")
        parts.append(part)
    return MixtureData(sources, parts, interleave, seq_len, seed, global_batch_size, micro_batch_size)
