"""Owner ranks for Muon under ZeRO-1: each whole matrix is orthogonalised by one rank of
its data-parallel group, not by all of them.

DeepSpeed's ZeRO-1 and BF16 optimizers cut a param group's flat buffer (its parameters end to end,
with alignment gaps) into dp equal pieces, one per rank (launch/optim/muon_partitions.py). A matrix
may straddle pieces, and Newton-Schulz needs it whole. Moonlight's Distributed Muon all-gathers the
whole buffer on every rank and orthogonalises every matrix there (dp times the work, and each rank
receives (dp - 1)/dp of the buffer). Here every matrix has an owner, chosen once by the longest-
processing-time rule over the Newton-Schulz FLOPs (launch/analysis/muon_cost.py: assign_owners), and two
all-to-alls move only what must move:
- to the owners: each rank sends the elements of its piece that belong to matrices another rank owns;
  the owner assembles each of its matrices whole (as its TP shard: TP peers hold the same piece
  numbers of the same parameters, so they own the same matrices and gather over TP together);
- back: each owner returns to each rank the update of the elements that rank holds.
A rank receives about 2 (dp - 1)/dp^2 of the buffer instead of (dp - 1)/dp, and computes 1/dp of the
Newton-Schulz FLOPs. The momentum stays in DeepSpeed's flat pieces (element-wise, so ZeRO-1's
partition of it is already 1/dp per rank and its checkpoints stay DeepSpeed's). The update is the
same numbers as the all-gather's: the same whole matrix orthogonalised, only on one rank.

Shapes: `u` and the returned update are this rank's flat piece (size,); the owned buffer is this
rank's owned parameters' local (TP-shard) tensors end to end (owned_numel,).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from launch.analysis.muon_cost import newton_schulz_flops


@dataclass
class OwnerExchange:
    """The all-to-all plan of one rank of one flat param group."""
    owner: List[int]  # per parameter (flat order), the dp rank that orthogonalises it
    owned: List[int]  # the parameters this rank owns, in flat order
    owned_offsets: List[int]  # where each owned parameter starts in the owned buffer
    owned_numel: int
    send_index: torch.Tensor  # positions in this rank's piece, grouped by owner, then parameter
    send_splits: List[int]  # elements sent to each dp rank
    recv_index: torch.Tensor  # positions in the owned buffer, grouped by source rank, then parameter
    recv_splits: List[int]  # elements received from each dp rank


def newton_schulz_cost(param: torch.Tensor) -> int:
    """The Newton-Schulz FLOPs of the whole logical matrices `param` holds (its `muon_layout`; the
    same on every TP peer, so peers own the same parameters)."""
    return matrix_cost(tuple(param.shape), param.muon_layout)


def matrix_cost(local_shape: Tuple[int, ...], layout) -> int:
    """The Newton-Schulz FLOPs of the whole logical matrices of a local tensor of `local_shape`
    laid out as `layout` (launch/optim/muon_matrices.py: MatrixLayout)."""
    shape = list(local_shape)
    stacked = shape[0] if layout.experts else 1
    total = 0
    for part in layout.parts:
        shape[layout.partition_dim] = part
        total += stacked * newton_schulz_flops(*shape[-2:])
    return total


def _overlap(start: int, end: int, piece: int, size: int) -> Optional[range]:
    """The elements of [start, end) in piece `piece` of `size`, or None."""
    low, high = max(start, piece * size), min(end, (piece + 1) * size)
    return range(low, high) if low < high else None


def plan_exchange(numels: Sequence[int], offsets: Sequence[int], owner: Sequence[int], size: int,
                  dp_size: int, dp_rank: int) -> OwnerExchange:
    """The plan of rank `dp_rank` for parameters of `numels` at `offsets` of the flat buffer, cut into
    pieces of `size`. Sender and receiver walk the parameters in flat order, so both sides agree."""
    owned = [i for i in range(len(numels)) if owner[i] == dp_rank]
    owned_offsets, total = [], 0
    for i in owned:
        owned_offsets.append(total)
        total += numels[i]
    where_owned = dict(zip(owned, owned_offsets))
    send, send_splits = [], []
    for dest in range(dp_size):
        count = 0
        for i in range(len(numels)):
            span = _overlap(offsets[i], offsets[i] + numels[i], dp_rank, size) if owner[i] == dest else None
            if span is not None:
                send.append(torch.arange(span.start - dp_rank * size, span.stop - dp_rank * size))
                count += len(span)
        send_splits.append(count)
    recv, recv_splits = [], []
    for source in range(dp_size):
        count = 0
        for i in owned:
            span = _overlap(offsets[i], offsets[i] + numels[i], source, size)
            if span is not None:
                start = where_owned[i] + span.start - offsets[i]
                recv.append(torch.arange(start, start + len(span)))
                count += len(span)
        recv_splits.append(count)
    empty = torch.zeros(0, dtype=torch.long)
    return OwnerExchange(owner=list(owner), owned=owned, owned_offsets=owned_offsets, owned_numel=total,
                         send_index=torch.cat(send) if send else empty, send_splits=send_splits,
                         recv_index=torch.cat(recv) if recv else empty, recv_splits=recv_splits)


def to_owners(u: torch.Tensor, plan: OwnerExchange, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """This rank's piece (size,) -> its owned parameters whole, end to end (owned_numel,)."""
    received = u.new_empty(sum(plan.recv_splits))
    dist.all_to_all_single(received, u[plan.send_index.to(u.device)].contiguous(), plan.recv_splits,
                           plan.send_splits, group=group)
    owned = u.new_zeros(plan.owned_numel)
    owned[plan.recv_index.to(u.device)] = received
    return owned


def from_owners(owned_update: torch.Tensor, plan: OwnerExchange, size: int,
                group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """The owners' updates (owned_numel,) -> this rank's piece of the update (size,), zero in the gaps."""
    received = owned_update.new_empty(sum(plan.send_splits))
    dist.all_to_all_single(received, owned_update[plan.recv_index.to(owned_update.device)].contiguous(),
                           plan.send_splits, plan.recv_splits, group=group)
    update = owned_update.new_zeros(size)
    update[plan.send_index.to(owned_update.device)] = received
    return update
