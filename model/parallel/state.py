"""The layout of one run: (pipe, data, model) ranks, sizes and process groups, with context
parallelism (cp) inside DeepSpeed's data axis.

Built once from DeepSpeed's `PipeModelDataParallelTopology` and passed down explicitly; the
same topology object goes to `PipelineModule(topology=...)`, so our TP and CP groups and
DeepSpeed's pipeline / data-parallel groups can never disagree (docs/design.md contract 1).
Axis order is (pipe, data, model): the TP ranks of one stage are adjacent global ranks.

DeepSpeed's engine knows three axes only. Its "data" axis holds dp x cp ranks, cp fastest
(data index = dp_rank * cp + cp_rank): the CP ranks of one replica are adjacent after TP, and
DeepSpeed's gradient all-reduce and ZeRO-1 partition run over dp x cp, which is what CP needs,
since the weights are replicated over CP and their gradients summed over it.

Expert parallelism (ep) is carved out of the same data axis: consecutive runs of ep
data indices form an expert-parallel (EP) group, whose ranks hold different experts of each MoE
block and exchange tokens by all-to-all; the ranks at the same place of every run form the
expert-data-parallel group, over which the replicas of those experts sum their gradients.
"""
from dataclasses import dataclass
from typing import List, Optional

import torch.distributed as dist
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology


@dataclass(frozen=True, kw_only=True)
class ParallelState:
    """This rank's coordinate in the (pipe, data, model) grid, the sizes and its TP and CP groups.
    dp_rank / dp_size count data replicas (which samples a rank trains on), not DeepSpeed's
    data index (dp_rank * cp_size + cp_rank)."""
    topology: PipeModelDataParallelTopology
    global_rank: int
    tp_size: int
    pp_size: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: Optional[dist.ProcessGroup]  # None when tp_size == 1: collectives bypass
    cp_size: int = 1
    cp_rank: int = 0
    cp_group: Optional[dist.ProcessGroup] = None  # None when cp_size == 1, as tp_group
    ep_size: int = 1
    ep_rank: int = 0
    ep_group: Optional[dist.ProcessGroup] = None  # None when ep_size == 1: the dispatch bypasses
    expert_dp_group: Optional[dist.ProcessGroup] = None
    """The ranks holding the same experts as this one (dp x cp / ep of them): their gradients' sum."""

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
        """Global ranks of every group DeepSpeed all-reduces gradients over (one per (pipe, model)
        coordinate): the dp x cp ranks of its data axis."""
        return self.topology.get_axis_comm_lists("data")

    @property
    def cp_groups(self) -> List[List[int]]:
        """Global ranks of every CP group: the cp ranks of one replica at one (pipe, model) coordinate."""
        return context_parallel_groups(self.topology, self.cp_size)

    @property
    def ep_groups(self) -> List[List[int]]:
        """Global ranks of every EP group: runs of ep_size ranks of one data axis."""
        return expert_parallel_groups(self.topology, self.ep_size)


def build_topology(tp_size: int, pp_size: int, dp_size: int, cp_size: int = 1) -> PipeModelDataParallelTopology:
    """DeepSpeed's topology with dp x cp ranks on its data axis (module docstring)."""
    return PipeModelDataParallelTopology(num_pp=pp_size, num_mp=tp_size, num_dp=dp_size * cp_size)


def context_parallel_groups(topology: PipeModelDataParallelTopology, cp_size: int) -> List[List[int]]:
    """Each data-axis list (ordered by data index) cut into runs of cp_size: data indices
    [d * cp, (d + 1) * cp) are replica d's CP ranks."""
    return [ranks[start:start + cp_size] for ranks in topology.get_axis_comm_lists("data")
            for start in range(0, len(ranks), cp_size)]


def expert_parallel_groups(topology: PipeModelDataParallelTopology, ep_size: int) -> List[List[int]]:
    """Each data-axis list (ordered by data index) cut into runs of ep_size: one EP group per run."""
    return [ranks[start:start + ep_size] for ranks in topology.get_axis_comm_lists("data")
            for start in range(0, len(ranks), ep_size)]


def expert_data_parallel_groups(topology: PipeModelDataParallelTopology, ep_size: int) -> List[List[int]]:
    """Each data-axis list taken every ep_size-th rank: the ranks at the same place of every EP
    group, which hold the same experts."""
    return [ranks[offset::ep_size] for ranks in topology.get_axis_comm_lists("data") for offset in range(ep_size)]


def single_process_state() -> ParallelState:
    """A (1, 1, 1) layout without process groups: the dense reference model in tests."""
    return ParallelState(topology=build_topology(1, 1, 1), global_rank=0, tp_size=1, pp_size=1, dp_size=1,
                         tp_rank=0, pp_rank=0, dp_rank=0, tp_group=None)


def _own_group(rank_lists: List[List[int]], rank: int) -> Optional[dist.ProcessGroup]:
    """One process group per list (`new_group` is collective over the world: every rank makes
    all of them, in the same order); this rank's."""
    own = None
    for ranks in rank_lists:
        group = dist.new_group(ranks=ranks)
        if rank in ranks:
            own = group
    return own


def init_parallel_state(tp_size: int, pp_size: int, cp_size: int = 1, ep_size: int = 1,
                        experts: bool = False) -> ParallelState:
    """Derive dp = world / (tp * cp * pp) and create the TP, CP and, for a model with `experts`, the
    EP and expert-data-parallel groups; needs torch.distributed up.

    Every rank must call this in the same order: `new_group` is collective over the world.
    """
    world_size = dist.get_world_size()
    assert world_size % (tp_size * cp_size * pp_size) == 0, "validated by launch/config/layout.py"
    dp_size = world_size // (tp_size * cp_size * pp_size)
    topology = build_topology(tp_size, pp_size, dp_size, cp_size)
    rank = dist.get_rank()
    coord = topology.get_coord(rank)
    tp_group = _own_group(topology.get_axis_comm_lists("model"), rank) if tp_size > 1 else None
    cp_group = _own_group(context_parallel_groups(topology, cp_size), rank) if cp_size > 1 else None
    ep_group = _own_group(expert_parallel_groups(topology, ep_size), rank) if ep_size > 1 else None
    # At ep = 1 too: DeepSpeed reduces expert gradients over it (then the whole data axis).
    expert_dp_group = _own_group(expert_data_parallel_groups(topology, ep_size), rank) if experts else None
    return ParallelState(topology=topology, global_rank=rank, tp_size=tp_size, pp_size=pp_size, dp_size=dp_size,
                         tp_rank=coord.model, pp_rank=coord.pipe, dp_rank=coord.data // cp_size,
                         tp_group=tp_group, cp_size=cp_size, cp_rank=coord.data % cp_size, cp_group=cp_group,
                         ep_size=ep_size, ep_rank=coord.data % ep_size, ep_group=ep_group,
                         expert_dp_group=expert_dp_group)
