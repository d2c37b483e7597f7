"""Layout-invariant micro-batches (docs/design.md contract 3).

The samples of optimizer step k are a pure function of (seed, global batch size, k): positions
[k*B, (k+1)*B) of an endless stream that visits every window once per epoch in an order
reshuffled each epoch. The position (samples consumed) is all a resumed run needs. Data-parallel rank r takes the r-th contiguous 1/dp of that global
batch, in micro-batches of b. Nothing depends on tp or pp: the TP ranks of a replica, and its
first and last pipeline stage (DeepSpeed reads inputs on the first, labels on the last), each
iterate their own copy and see the same sequence.
"""
import functools
from typing import Iterator, Tuple

import numpy as np
import torch


@functools.lru_cache(maxsize=2)
def epoch_order(n_samples: int, seed: int, epoch: int) -> torch.Tensor:
    return torch.randperm(n_samples, generator=torch.Generator().manual_seed(seed * 7919 + epoch))


def sample_indices(n_samples: int, seed: int, positions: range, shuffle: bool = True) -> np.ndarray:
    """Window index at each position of the endless stream (reshuffled every epoch)."""
    if not shuffle:
        return np.arange(positions.start, positions.stop) % n_samples
    out = np.empty(len(positions), dtype=np.int64)
    order, order_epoch = None, -1
    for i, pos in enumerate(positions):
        epoch = pos // n_samples
        if epoch != order_epoch:
            order, order_epoch = epoch_order(n_samples, seed, epoch), epoch
        out[i] = order[pos % n_samples]
    return out


def micro_batches(windows: np.ndarray, seed: int, global_batch_size: int, micro_batch_size: int,
                  dp_rank: int, dp_size: int, start_sample: int = 0, shuffle: bool = True
                  ) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """Endless (input_ids, labels), each (b, seq_len) int64, for this dp rank, in step order,
    from global sample position `start_sample` on (a multiple of the global batch: resume)."""
    assert start_sample % global_batch_size == 0, (start_sample, global_batch_size)
    per_rank = global_batch_size // dp_size
    step = start_sample // global_batch_size
    while True:
        first = step * global_batch_size + dp_rank * per_rank
        for start in range(first, first + per_rank, micro_batch_size):
            idx = sample_indices(len(windows), seed, range(start, start + micro_batch_size), shuffle)
            batch = torch.from_numpy(windows[idx].astype(np.int64))  # (b, seq_len + 1)
            yield batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        step += 1
