"""Each whole matrix's Newton-Schulz on one rank of its TP group, not on all of them.

A TP-sharded Muon matrix must be orthogonalised whole (launch/optim/muon_matrices.py). The TP
peers hold shards of the same matrices in the same order (their parameters have the same shapes,
and ZeRO-1's owner ranks give peers the same matrices), so gathering every shard on every peer
(an all-gather) would make each peer run the same Newton-Schulz: tp times the FLOPs. Here each
matrix has a finisher among the peers, chosen by the longest-processing-time rule over its FLOPs
(launch/analysis/muon_cost.py: assign_owners; the same on every peer), and two all-to-alls over TP
move the shards:
- to the finishers: each peer sends every matrix's shard to that matrix's finisher, which assembles
  the whole logical matrices (`assemble`) and computes their updates;
- back: the finisher cuts each peer's shard of the update (`local_part`) and returns it.
Per rank that is 1/tp of the FLOPs, and about 2 (tp - 1)/tp of the local elements received instead
of the all-gather's (tp - 1). The numbers are the same: one whole matrix, one Newton-Schulz.

Shapes: `shards[i]` is this rank's local tensor of matrix i (its MatrixLayout's partition of the
whole); the returned updates have the same shapes.
"""
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from launch.analysis.muon_cost import assign_owners
from launch.optim.muon_matrices import MatrixLayout, assemble, local_part
from launch.optim.muon_owners import matrix_cost


def finished_updates(shards: List[torch.Tensor], layouts: List[MatrixLayout], update: Callable[[torch.Tensor], torch.Tensor],
                     tp_group: Optional[dist.ProcessGroup], tp_rank: int) -> List[torch.Tensor]:
    """This rank's shard of `update(part)` for every logical part of every matrix (collective over
    `tp_group`; every peer passes its shards of the same matrices, in the same order)."""
    tp = layouts[0].tp_size if layouts else 1
    if tp == 1:
        return [local_part([update(part) for part in assemble([s], layout)], layout, 0) for s, layout in zip(shards, layouts)]
    finisher = assign_owners([matrix_cost(tuple(s.shape), layout) for s, layout in zip(shards, layouts)], tp)
    by_finisher = [[i for i in range(len(shards)) if finisher[i] == rank] for rank in range(tp)]
    mine = by_finisher[tp_rank]
    send_splits = [sum(shards[i].numel() for i in ids) for ids in by_finisher]
    recv_splits = [sum(shards[i].numel() for i in mine)] * tp  # every peer's shard of each of mine
    empty = shards[0].new_empty(0)
    sent = torch.cat([shards[i].reshape(-1) for ids in by_finisher for i in ids] or [empty])
    received = sent.new_empty(sum(recv_splits))
    dist.all_to_all_single(received, sent, recv_splits, send_splits, group=tp_group)
    from_peer = [chunk.split([shards[i].numel() for i in mine]) for chunk in received.split(recv_splits)]
    back: List[List[torch.Tensor]] = [[] for _ in range(tp)]  # per peer: its shard of each of mine's update
    for k, i in enumerate(mine):
        parts = assemble([from_peer[peer][k].view(shards[i].shape) for peer in range(tp)], layouts[i])
        updates = [update(part) for part in parts]
        for peer in range(tp):
            back[peer].append(local_part(updates, layouts[i], peer).reshape(-1))
    returned = sent.new_empty(sum(send_splits))
    dist.all_to_all_single(returned, torch.cat([t for peer in back for t in peer] or [empty]), send_splits, recv_splits,
                           group=tp_group)
    result: List[Optional[torch.Tensor]] = [None] * len(shards)
    for ids, chunk in zip(by_finisher, returned.split(send_splits)):
        for i, flat in zip(ids, chunk.split([shards[i].numel() for i in ids])):
            result[i] = flat.view(shards[i].shape)
    return result
