"""Tensor-parallel layers (Megatron-LM, Shoeybi et al. 2019), built on `model/mappings.py`.

Layout-invariant initialisation (DESIGN.md contract 2): each layer draws its *full* weight from
the generator it is given and keeps only its shard, so step-0 weights are identical at every
tp size. Sharded parameters carry `tensor_model_parallel = True` (plus Megatron's
`partition_dim` / `partition_stride`): DeepSpeed's gradient-norm code counts a parameter on
every TP rank only when it carries that flag, and replicated ones (biases after a reduce,
LayerNorm) on TP rank 0 only.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from model.mappings import (Group, copy_to_tp_region, gather_from_tp_region,
                            reduce_from_tp_region)


def group_size(group: Group) -> int:
    return 1 if group is None else torch.distributed.get_world_size(group)


def group_rank(group: Group) -> int:
    return 0 if group is None else torch.distributed.get_rank(group)


def split_rows(full: torch.Tensor, tp_rank: int, tp_size: int, stride: int = 1) -> torch.Tensor:
    """Rank `tp_rank`'s share of dim 0 of `full`, taken from each of `stride` equal blocks.

    stride=3 shards a fused [Q; K; V] weight so that each rank gets [Q_r; K_r; V_r], i.e. whole
    attention heads (Megatron's `stride`).
    """
    blocks = full.chunk(stride, dim=0)
    return torch.cat([b.chunk(tp_size, dim=0)[tp_rank] for b in blocks], dim=0).contiguous()


def shard_rows(full: torch.Tensor, group: Group, stride: int = 1) -> torch.Tensor:
    """This rank's share of dim 0 of `full` (see `split_rows`)."""
    return split_rows(full, group_rank(group), group_size(group), stride)


def _mark_tp(param: nn.Parameter, partition_dim: int, stride: int = 1) -> None:
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = stride


class ColumnParallelLinear(nn.Module):
    """Y = XA^T + b with A split by output rows: A = [A_1; ...; A_p], Y_i = X A_i^T + b_i.

    Input (..., in) replicated on the TP group; output (..., out/p) sharded, or (..., out) when
    `gather_output`. Backward all-reduces dL/dX (copy_to_tp_region).
    """

    def __init__(self, in_features: int, out_features: int, tp_group: Group,
                 generator: torch.Generator, init_std: float, bias: bool = True,
                 gather_output: bool = False, stride: int = 1):
        super().__init__()
        tp_size = group_size(tp_group)
        assert out_features % (tp_size * stride) == 0, (out_features, tp_size, stride)
        self.tp_group = tp_group
        self.gather_output = gather_output
        self.output_size_per_partition = out_features // tp_size
        full = torch.empty(out_features, in_features).normal_(0.0, init_std, generator=generator)
        self.weight = nn.Parameter(shard_rows(full, tp_group, stride))  # (out/p, in)
        _mark_tp(self.weight, partition_dim=0, stride=stride)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition))
            _mark_tp(self.bias, partition_dim=0, stride=stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_tp_region(x, self.tp_group), self.weight, self.bias)
        return gather_from_tp_region(y, self.tp_group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = XA^T + b with A split by input columns: A = [A_1 ... A_p], Y = sum_i X_i A_i^T + b.

    Input (..., in/p) already sharded (the output of a ColumnParallelLinear); output (..., out)
    replicated after one all-reduce. The bias is added after the reduce, so it is replicated
    and is not marked as TP-split.
    """

    def __init__(self, in_features: int, out_features: int, tp_group: Group,
                 generator: torch.Generator, init_std: float, bias: bool = True):
        super().__init__()
        tp_size = group_size(tp_group)
        assert in_features % tp_size == 0, (in_features, tp_size)
        self.tp_group = tp_group
        self.input_size_per_partition = in_features // tp_size
        full = torch.empty(out_features, in_features).normal_(0.0, init_std, generator=generator)
        self.weight = nn.Parameter(shard_rows(full.t(), tp_group).t().contiguous())  # (out, in/p)
        _mark_tp(self.weight, partition_dim=1)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x_parallel: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp_region(F.linear(x_parallel, self.weight), self.tp_group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """E[ids] with the vocabulary rows split across TP: rank r holds rows [r*V/p, (r+1)*V/p).

    The vocabulary is padded to `padded_vocab_size` (a multiple of tp); rows >= `vocab_size`
    start at zero and `logits()` masks them to -inf, so padding never takes probability mass
    and the loss is the same at every padding (DESIGN.md contract 4).
    The same weight serves as the output head (tied embeddings, GPT-2).
    """

    def __init__(self, vocab_size: int, padded_vocab_size: int, embedding_dim: int,
                 tp_group: Group, generator: torch.Generator, init_std: float):
        super().__init__()
        tp_size, tp_rank = group_size(tp_group), group_rank(tp_group)
        assert padded_vocab_size % tp_size == 0 and padded_vocab_size >= vocab_size
        self.tp_group = tp_group
        self.vocab_size = vocab_size
        self.rows_per_partition = padded_vocab_size // tp_size
        self.vocab_start = tp_rank * self.rows_per_partition
        self.vocab_end = self.vocab_start + self.rows_per_partition
        full = torch.zeros(padded_vocab_size, embedding_dim)
        full[:vocab_size].normal_(0.0, init_std, generator=generator)
        self.weight = nn.Parameter(shard_rows(full, tp_group))  # (V_pad/p, h)
        _mark_tp(self.weight, partition_dim=0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids -> (B, T, h) embeddings, replicated on the TP group."""
        if self.tp_group is None:  # one rank holds every row: no masking, no (B, T, h) masked copy
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        emb = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp_region(emb, self.tp_group)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, h) replicated -> (B, T, V_pad/p) this rank's vocab shard of the logits."""
        logits = F.linear(copy_to_tp_region(hidden, self.tp_group), self.weight)
        if self.vocab_end > self.vocab_size:  # this shard holds padding rows
            padded = torch.arange(self.vocab_start, self.vocab_end, device=logits.device) >= self.vocab_size
            logits = logits.masked_fill(padded, float("-inf"))
        return logits


def padded_vocab_size(vocab_size: int, tp_size: int, multiple: int = 1) -> int:
    """Smallest size >= vocab_size divisible by multiple * tp_size (Megatron's padding)."""
    step = multiple * tp_size
    return -(-vocab_size // step) * step

