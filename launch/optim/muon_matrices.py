"""Which parameters Muon updates, and how each one's local tensor maps to whole logical matrices
(docs/design.md, "Muon at every layout").

Muon orthogonalises each logical matrix of the one-device model on its own: Q, K, V, the attention
output projection, the MLP's gate, up (or c_fc) and down (c_proj), and each expert's. Here a
parameter may hold less (a TP shard) or more (a fused weight; a stack of experts) than one:
- the TP-sharded linears (model/parallel/layers.py) mark `partition_dim`, `partition_stride` and
  `partition_sections`: the full weight's dim `partition_dim` is cut into blocks (stride equal ones,
  or `sections` rows), and each block into tp chunks, rank r keeping chunk r of every block
  (`split_rows`). Those blocks are the fused logical matrices: GPT-2's c_attn [Q; K; V] (stride 3),
  Llama's qkv_proj [Q; K; V] (sections (a d, kv d, kv d), also when tp > kv heads), gate_up_proj [G; U];
- an expert weight (model/transformer/moe.py) is a stack (E/ep, rows, cols): each expert on its own.
`assemble` rebuilds the logical matrices from the TP ranks' local tensors (gathered by
launch/optim/muon_tp_owners.py), `local_part` cuts a rank's rows back out: the exact inverse of
`split_rows`. Everything else (embeddings, the
output head, norms, biases, routers, learned positions) is AdamW's.
"""
from dataclasses import dataclass
from typing import List, Tuple

import torch
import torch.nn as nn


@dataclass(frozen=True)
class MatrixLayout:
    """How one parameter's local tensor holds logical matrices: its `partition_dim` over tp ranks,
    the full size of each fused part along it (`parts`), and whether dim 0 stacks experts."""
    partition_dim: int
    parts: Tuple[int, ...]  # full sizes along partition_dim, one per logical matrix
    tp_size: int
    experts: bool

    def local_sizes(self) -> List[int]:
        return [size // self.tp_size for size in self.parts]


def muon_matrices(module: nn.Module) -> List[nn.Parameter]:
    """The hidden matrices of `module` (a stage): the weights of the TP linears and the experts'."""
    from model.parallel.layers import ColumnParallelLinear, RowParallelLinear
    from model.transformer.moe import ExpertMLPs
    found = []
    for sub in module.modules():
        if isinstance(sub, (ColumnParallelLinear, RowParallelLinear)):
            found.append(sub.weight)
        elif isinstance(sub, ExpertMLPs):
            found += [sub.gate_up_proj, sub.down_proj]
    return [p for p in found if p.requires_grad]


def matrix_layout(param: torch.Tensor, tp_size: int) -> MatrixLayout:
    """The layout of a Muon matrix (one of `muon_matrices`), from the marks its layer gave it."""
    dim = param.partition_dim
    full = param.shape[dim] * tp_size
    sections = getattr(param, "partition_sections", None)
    parts = tuple(sections) if sections else (full // param.partition_stride,) * param.partition_stride
    if sum(parts) != full or any(size % tp_size for size in parts):
        raise ValueError(f"a matrix of local shape {tuple(param.shape)} does not split into parts {parts} over tp {tp_size}")
    return MatrixLayout(partition_dim=dim, parts=parts, tp_size=tp_size, experts=param.dim() == 3)


def assemble(shards: List[torch.Tensor], layout: MatrixLayout) -> List[torch.Tensor]:
    """The logical matrices that the TP ranks' local tensors `shards` (rank order) make up."""
    dim = layout.partition_dim
    per_rank = [shard.split(layout.local_sizes(), dim=dim) for shard in shards]  # rank r: its chunk of each part
    return [torch.cat([chunks[part] for chunks in per_rank], dim=dim) for part in range(len(layout.parts))]


def local_part(parts: List[torch.Tensor], layout: MatrixLayout, tp_rank: int) -> torch.Tensor:
    """This TP rank's local tensor of the logical matrices `parts` (`split_rows` along partition_dim)."""
    dim = layout.partition_dim
    return torch.cat([part.chunk(layout.tp_size, dim=dim)[tp_rank] for part in parts], dim=dim).contiguous()
