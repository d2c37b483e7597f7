"""One source's data (SourceData), map-style (cached, memory-mapped windows) or streaming, and
what the training loop sees of a run's data (RunData, which a mixture implements too:
data/mixture_run.py): train micro-batches from any position, validation batches, the copy to
the device and TP sharing. The checks and caches that build a SourceData before the run:
data/prepare_source.py.
"""
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from data.sampler import micro_batches
from data.spec import DataError, DataSpec
from data.streaming import (Batch, StepBatches, StreamingBatches, StreamSource, StreamState, gather_data_state,
                            positions_of_units, states_from, stream_windows)


def on_device(batches: Iterator[Batch], device: torch.device) -> Iterator[Batch]:
    """The micro-batches as DeepSpeed's pipeline engine best receives them on an accelerator:
    already there, copied from pinned host memory with non_blocking=True. The engine's own
    `.to(device)` of a pageable tensor waits for the device's queued work at every micro-batch
    (the host cannot run ahead); of a tensor already on the device it does nothing. Values are
    unchanged, and nothing is fetched ahead, so the source's position (a checkpoint's
    data_state) stays exactly what was trained. Pinning goes through DeepSpeed's accelerator
    (on CPU it pins nothing and the copy to the CPU returns the tensor itself), so a test's
    accelerator sees the same calls a GPU gets (tests/runtime/test_device_sync.py)."""
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    return ((accelerator.pin_memory(x).to(device, non_blocking=True),
             accelerator.pin_memory(y).to(device, non_blocking=True)) for x, y in batches)


def shared_from_reader(batches: Optional[Iterator[Batch]], groups: List, shape: Tuple[int, int],
                       device: torch.device) -> Iterator[Batch]:
    """The replica's reader reads the micro-batches (`batches`) and broadcasts each over every
    group of `groups` in order; each other rank passes None, reads nothing and receives over its
    one group (launch/feed/replica_reader.py). The reader is rank 0 of each group. The ranks of
    a replica train on the same data, so reading and tokenizing it once per replica is enough."""
    import torch.distributed as dist
    while True:
        if batches is not None:
            x, y = next(batches)
        else:
            x = torch.empty(shape, dtype=torch.int64, device=device)
            y = torch.empty(shape, dtype=torch.int64, device=device)
        for group in groups:
            source = dist.get_global_rank(group, 0)
            dist.broadcast(x, source, group=group)
            dist.broadcast(y, source, group=group)
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

    def close_batches(self, batches: Iterator[Batch]) -> None:
        """Stop the read-ahead thread of `batches` (from `train_batches`) and wait for it to end,
        bounded (data/prefetch.py): at the end of the run and on a failure path, so that the
        process never exits while the thread is inside pyarrow's C++. Streamed data, one source
        or a mixture, holds one such thread per reading rank; cached data none. Safe to call
        more than once, and from another thread."""
        if isinstance(batches, StepBatches):
            batches.close()

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

    def feed(self, batches: Iterator[Batch], groups: List, reads: bool, device: torch.device) -> Iterator[Batch]:
        """What DeepSpeed's engine draws from: `batches` on the device (`on_device`); over
        `groups` (streamed data: launch/feed/replica_reader.py), only the replica's reader
        (`reads`) reads and tokenizes them, and the others receive them (`shared_from_reader`).
        `batches` stays the source of the position a checkpoint records."""
        if not groups:  # cached data (a memory-mapped slice, cheap on every rank), or a replica of one rank
            return on_device(batches, device)
        return shared_from_reader(on_device(batches, device) if reads else None, groups,
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
