"""Tell Muon (launch/optim/muon.py) where DeepSpeed put its matrices.

DeepSpeed's ZeRO-1 optimizer (fp32, fp16) and its BF16 optimizer (bf16 with fp32 gradient
accumulation, docs/design.md contract 8) both lay each param group's parameters end to end in one
flat buffer, cut it into dp equal pieces, and hand the wrapped optimizer only this rank's piece as
an fp32 tensor (its `.grad` the reduced, clipped fp32 gradient of the same elements; with
`train.grad_accum_fusion` the linears add into that very buffer: launch/optim/main_grad.py).
The buffer's order and offsets are the wrapper's:
- ZeRO-1 (deepspeed/runtime/zero/stage_1_and_2.py): `round_robin_bit16_groups[i]` at
  `round_robin_bit16_offsets[i]` (alignment padding between parameters);
- BF16 (deepspeed/runtime/bf16_optimizer.py): `bf16_groups[i]`, packed without gaps;
the data-parallel group of a param group (an expert group's is its expert-data-parallel group) is
`real_dp_process_group[i]` in both. fp32 ZeRO-0 hands the parameters themselves: nothing to bind.
"""
from itertools import accumulate

import torch.distributed as dist

from launch.optim.muon import FlatPartition, Muon


def bind_muon_partitions(optimizer) -> None:
    """`optimizer`: the engine's (Muon itself, or DeepSpeed's wrapper around it). Call once, after
    deepspeed.initialize."""
    if isinstance(optimizer, Muon):
        return
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        groups, offsets = optimizer.round_robin_bit16_groups, optimizer.round_robin_bit16_offsets
    elif isinstance(optimizer, BF16_Optimizer):
        groups = optimizer.bf16_groups
        offsets = [[0] + list(accumulate(p.numel() for p in group))[:-1] for group in groups]
    else:  # recipe validation refuses the combinations that get another wrapper
        raise TypeError(f"Muon under DeepSpeed's {type(optimizer).__name__}: no flat-partition layout known")
    muon = optimizer.optimizer
    for i, group in enumerate(muon.param_groups):  # Muon's groups and AdamW's (which decays per element)
        (flat,) = group["params"]
        if group["muon"] and any(not hasattr(p, "muon_layout") for p in groups[i]):
            raise RuntimeError(f"param group {i}: DeepSpeed's flat buffer holds parameters Muon did not lay out")
        dp_group = optimizer.real_dp_process_group[i]
        muon.bind(flat, FlatPartition(params=list(groups[i]), offsets=list(offsets[i]), dp_group=dp_group,
                                      dp_size=dist.get_world_size(dp_group), dp_rank=dist.get_rank(dp_group)))
