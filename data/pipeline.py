"""The data of a run: train micro-batches from any sample position and validation batches,
map-style (cached, memory-mapped windows) or streaming. The one entry point launch/ uses."""
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from data.sampler import micro_batches
from data.sources import load_train_val
from data.spec import DataError, DataSpec
from data.streaming import packed_windows, streaming_micro_batches
from data.windows import prepare_streams, windows

Batch = Tuple[torch.Tensor, torch.Tensor]


@dataclass
class RunData:
    spec: DataSpec
    tokenizer: PreTrainedTokenizerBase
    seq_len: int
    seed: int
    global_batch_size: int
    micro_batch_size: int
    train_windows: Optional[np.ndarray] = None
    """(N, seq_len + 1) in map-style mode; None when streaming."""
    val_windows: Optional[np.ndarray] = None

    @property
    def has_validation(self) -> bool:
        return self.spec.val_split is not None or self.spec.val_fraction > 0

    def train_batches(self, dp_rank: int, dp_size: int, start_sample: int = 0) -> Iterator[Batch]:
        """This dp rank's micro-batches from global sample position `start_sample` on."""
        if self.train_windows is not None:
            return micro_batches(self.train_windows, self.seed, self.global_batch_size, self.micro_batch_size,
                                 dp_rank, dp_size, start_sample, self.spec.shuffle)
        train, _ = load_train_val(self.spec, streaming=True)
        stream = packed_windows(train, self.tokenizer, self.spec.text_field, self.seq_len, self.seed,
                                self.spec.shuffle, self.spec.shuffle_buffer)
        return streaming_micro_batches(stream, self.global_batch_size, self.micro_batch_size,
                                       dp_rank, dp_size, start_sample)

    def val_batches(self, dp_rank: int, dp_size: int, n_global_batches: int) -> Iterator[Batch]:
        """The first `n_global_batches` global batches of the validation windows, unshuffled:
        the same samples at every evaluation and at every layout."""
        if self.val_windows is not None:
            return micro_batches(self.val_windows, self.seed, self.global_batch_size, self.micro_batch_size,
                                 dp_rank, dp_size, 0, shuffle=False)
        _, val = load_train_val(self.spec, streaming=True)
        stream = packed_windows(val, self.tokenizer, self.spec.text_field, self.seq_len, self.seed,
                                shuffle=False, shuffle_buffer=0, epochs=1)
        return streaming_micro_batches(stream, self.global_batch_size, self.micro_batch_size, dp_rank, dp_size)

    def eval_global_batches(self, wanted: int) -> int:
        """How many validation global batches exist, up to `wanted` (map-style knows; streaming trusts)."""
        if self.val_windows is None:
            return wanted
        return min(wanted, len(self.val_windows) // self.global_batch_size)


def prepare_run_data(spec: DataSpec, tokenizer: PreTrainedTokenizerBase, seq_len: int, seed: int,
                     global_batch_size: int, micro_batch_size: int, evaluate: bool) -> RunData:
    """Check the data against the run and build (or reuse) its cache; raises DataError."""
    if evaluate and spec.val_split is None and spec.val_fraction <= 0:
        raise DataError("train.eval_every > 0 needs validation data: set data.val_split or data.val_fraction "
                        "(or train.eval_every=0)")
    data = RunData(spec, tokenizer, seq_len, seed, global_batch_size, micro_batch_size)
    if spec.streaming:
        train, _ = load_train_val(spec, streaming=True)  # fails early on unknown data or columns
        return data
    streams = prepare_streams(spec, tokenizer)
    data.train_windows = windows(streams.train, seq_len)
    if len(data.train_windows) == 0:
        raise DataError(f"data.name={spec.name!r} gives {len(streams.train)} tokens, fewer than one window "
                        f"of seq_len+1 = {seq_len + 1}; lower data.seq_len or use more data")
    if streams.val is not None:
        data.val_windows = windows(streams.val, seq_len)
        if evaluate and len(data.val_windows) < global_batch_size:
            raise DataError(f"the validation data gives {len(data.val_windows)} windows of {seq_len + 1} tokens, "
                            f"fewer than one global batch ({global_batch_size}); raise data.val_fraction or "
                            f"set train.eval_every=0")
    return data
