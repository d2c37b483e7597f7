"""The 3D layout of one run: (pipe, data, model) ranks, sizes and process groups.

Built once from DeepSpeed's `PipeModelDataParallelTopology` and passed down explicitly; the
same topology object goes to `PipelineModule(topology=...)`, so our TP groups and DeepSpeed's
pipeline / data-parallel groups can never disagree (docs/design.md contract 1).
Axis order is (pipe, data, model): the TP ranks of one stage are adjacent global ranks.
"""
from dataclasses import dataclass
from typing import List, Optional

import torch.distributed as dist
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology


@dataclass(frozen=True, kw_only=True)
class ParallelState:
    """This rank's coordinate in the (pipe, data, model) grid, the sizes and its TP group."""
    topology: PipeModelDataParallelTopology
    global_rank: int
    tp_size: int
    pp_size: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: Optional[dist.ProcessGroup]  # None when tp_size == 1: collectives bypass

    @property
    def tp_groups(self) -> List[List[int]]:
        """Global ranks of every TP group (one per (pipe, data) coordinate)."""
        return self.topology.get_axis_comm_lists("model")

    @property
    def pipelines(self) -> List[List[int]]:
        """Global ranks of every pipeline, first stage first."""
        return self.topology.get_axis_comm_lists("pipe")

    @property
    def dp_groups(self) -> List[List[int]]:
        """Global ranks of every data-parallel group (one per (pipe, model) coordinate)."""
        return self.topology.get_axis_comm_lists("data")


def build_topology(tp_size: int, pp_size: int, dp_size: int) -> PipeModelDataParallelTopology:
    return PipeModelDataParallelTopology(num_pp=pp_size, num_mp=tp_size, num_dp=dp_size)


def single_process_state() -> ParallelState:
    """A (1, 1, 1) layout without process groups: the dense reference model in tests."""
    return ParallelState(topology=build_topology(1, 1, 1), global_rank=0, tp_size=1, pp_size=1, dp_size=1,
                         tp_rank=0, pp_rank=0, dp_rank=0, tp_group=None)


def init_parallel_state(tp_size: int, pp_size: int) -> ParallelState:
    """Derive dp = world / (tp * pp) and create the TP groups; needs torch.distributed up.

    Every rank must call this in the same order: `new_group` is collective over the world.
    """
    world_size = dist.get_world_size()
    assert world_size % (tp_size * pp_size) == 0, "validated by launch/config/layout.py"
    dp_size = world_size // (tp_size * pp_size)
    topology = build_topology(tp_size, pp_size, dp_size)
    rank = dist.get_rank()
    coord = topology.get_coord(rank)

    tp_group = None
    if tp_size > 1:
        for ranks in topology.get_axis_comm_lists("model"):
            group = dist.new_group(ranks=ranks)
            if rank in ranks:
                tp_group = group
    return ParallelState(topology=topology, global_rank=rank, tp_size=tp_size, pp_size=pp_size, dp_size=dp_size,
                         tp_rank=coord.model, pp_rank=coord.pipe, dp_rank=coord.data,
                         tp_group=tp_group)
