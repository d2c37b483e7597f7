"""Streaming mode: documents from an `IterableDataset`, tokenized and packed on the fly.

Layout invariance needs global positions: window p of the packed stream is sample p of the
run, and dp rank r of step k takes positions [k*B + r*B/dp, k*B + (r+1)*B/dp). Each rank reads
the stream and keeps only its own windows, so every rank tokenizes the whole stream: exact and
layout-invariant, at the cost of dp-fold tokenization work (cheap next to the model). The TP
ranks of a replica and its first and last stage read identical sequences. When the stream
ends, the next epoch starts over, reshuffled through a buffer seeded by (seed, epoch).
"""
from typing import Iterator, Optional, Tuple

import datasets
import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from data.tokens import stream_tokens


def packed_windows(dataset: datasets.IterableDataset, tokenizer: PreTrainedTokenizerBase, text_field: str,
                   seq_len: int, seed: int, shuffle: bool, shuffle_buffer: int,
                   epochs: Optional[int] = None) -> Iterator[np.ndarray]:
    """Endless (or `epochs` passes of) windows of seq_len + 1 tokens, in stream order."""
    window = seq_len + 1
    epoch = 0
    while epochs is None or epoch < epochs:
        docs = dataset.shuffle(seed=seed * 7919 + epoch, buffer_size=shuffle_buffer) if shuffle else dataset
        carry = np.empty(0, dtype=np.int64)
        produced = 0
        for chunk in stream_tokens(docs, tokenizer, text_field):
            carry = np.concatenate([carry, chunk])
            n = len(carry) // window
            for i in range(n):
                yield carry[i * window:(i + 1) * window]
            produced += n
            carry = carry[n * window:]
        if produced == 0:
            raise ValueError("the streaming dataset produced no complete window")
        epoch += 1


def streaming_micro_batches(windows: Iterator[np.ndarray], global_batch_size: int, micro_batch_size: int,
                            dp_rank: int, dp_size: int, start_sample: int = 0
                            ) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, labels) micro-batches of this dp rank from the global window stream."""
    per_rank = global_batch_size // dp_size
    position = 0
    mine = []
    for window in windows:
        step_offset = position % global_batch_size
        if position >= start_sample and dp_rank * per_rank <= step_offset < (dp_rank + 1) * per_rank:
            mine.append(window)
            if len(mine) == micro_batch_size:
                batch = torch.from_numpy(np.stack(mine).astype(np.int64))  # (b, seq_len + 1)
                yield batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
                mine = []
        position += 1
