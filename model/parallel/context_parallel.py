"""The run side of context parallelism (Jacobs et al. 2023, DeepSpeed-Ulysses): which
tokens a CP rank holds and the token-weighted loss over the CP group. The attention's
all-to-alls live in model/parallel/mappings.py, the whole sequence's document ids in model/transformer/documents.py.

CP rank r of a replica holds the contiguous tokens [r T/cp, (r+1) T/cp) of every sequence of the
replica's micro-batches, inputs and labels alike. Everything outside attention (embeddings, norms,
MLP, loss) runs on those local tokens; what depends on a token's place in the whole sequence
(learned positions, document positions) is computed from the global index (model/transformer/block.py).
"""
from typing import Iterator, Tuple

import torch
import torch.distributed as dist

from model.parallel.mappings import Group


def sequence_shard(x: torch.Tensor, cp_rank: int, cp_size: int) -> torch.Tensor:
    """(B, T, ...) -> (B, T/cp, ...): CP rank r's contiguous tokens [r T/cp, (r+1) T/cp)."""
    if cp_size == 1:
        return x
    local = x.size(1) // cp_size
    return x[:, cp_rank * local:(cp_rank + 1) * local].contiguous()


def sequence_shards(batches: Iterator[Tuple[torch.Tensor, torch.Tensor]], cp_rank: int, cp_size: int
                    ) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """Each (inputs, labels) micro-batch, (B, T) each, as this CP rank's (B, T/cp) shards. The CP
    ranks of a replica draw the same samples (their dp rank is the replica's), so each sequence's
    shards meet again in attention's all-to-all."""
    if cp_size == 1:
        return batches
    return ((sequence_shard(x, cp_rank, cp_size), sequence_shard(y, cp_rank, cp_size)) for x, y in batches)


def token_weighted_mean(token_loss: torch.Tensor, counted: torch.Tensor, cp_group: Group) -> torch.Tensor:
    """This CP rank's share of the mean loss over the counted tokens of the whole sequences.

    token_loss, counted: (B, T/cp) this rank's per-token loss and which tokens count. DeepSpeed
    averages gradients (and reports losses) over its data axis, dp x cp, so CP rank r returns
    cp * sum_r / N, N the counted tokens of all cp shards: the average over the group is then
    sum / N, the single-process mean, also when the shards count unequal numbers of tokens."""
    local_sum = token_loss.sum()
    if cp_group is None:
        return local_sum / counted.sum()
    count = counted.sum(dtype=torch.float32).reshape(1)
    dist.all_reduce(count, group=cp_group)  # no gradient: N is data, not a function of the weights
    return local_sum * dist.get_world_size(cp_group) / count.squeeze(0)
