"""Muon in the planner (launch/optim/muon.py): its memory, its traffic and its
Newton-Schulz FLOPs per step, on the busiest rank of a pipeline stage.

- Memory: one fp32 momentum per element of a Muon matrix (AdamW keeps two moments: Muon saves
  4 bytes per such element), partitioned by ZeRO-1 like AdamW's moments, over the data axis
  (dp x cp ranks; an expert matrix over its expert-data-parallel group, dp x cp / ep).
- ZeRO-1: every matrix has an owner rank in its data group (launch/optim/muon_owners.py), chosen
  by `assign_owners`, and a finisher among the owner's TP peers (launch/optim/muon_tp_owners.py),
  chosen the same way. During the step a rank holds its owned matrices (as TP shards) and their
  update, the TP all-to-alls' send and receive buffers and its finished matrices whole with their
  updates: about 6 x 4 bytes per owned element. Traffic received: the two data-group all-to-alls,
  about 2 (D - 1) / D^2 of the local elements, and the two TP all-to-alls, 2 (t - 1) / t of the
  owned ones. FLOPs: the matrices it finishes, about 1 / (D t) of them.
- ZeRO-0: every TP group orthogonalises every matrix of its stage, each on one finisher: 2 (t - 1)
  / t of the local elements received, the same 6 buffers of the local elements, 1 / t of the FLOPs.
- Newton-Schulz FLOPs of a matrix (a rank's E/ep experts only): 5 steps of X X^T, A^2 and
  (b A + c A^2) X with m the smaller side: 5 (4 m^2 n + 2 m^3).
No torch here: only the model's config.
"""
import heapq
from dataclasses import dataclass
from typing import List, Sequence, Tuple

from launch.analysis.experts import is_moe_block
from model.config import ModelConfig

FP32 = 4
NS_STEPS = 5  # launch/optim/newton_schulz.py
Matrix = Tuple[int, int, int]  # (rows, cols, how many)
STEP_BUFFERS = 6  # the owned (or local) elements' copies during a step: U's, the update's, 2 per TP all-to-all


@dataclass(frozen=True)
class MuonCost:
    momentum_bytes: int  # per rank, after ZeRO-1's partition
    step_buffer_bytes: int  # transient, during the optimizer step
    gather_bytes: int  # received per rank per step
    newton_schulz_flops: int  # per rank per step


def assign_owners(costs: Sequence[int], ranks: int) -> List[int]:
    """Each matrix's owner among `ranks`: longest processing time first (the costliest matrix to the
    least-loaded rank; ties to the lower rank, then the earlier matrix), so that every rank computes
    the same assignment and the busiest rank carries at most the mean plus one matrix."""
    load = [(0, rank) for rank in range(ranks)]
    owner = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        busy, rank = heapq.heappop(load)
        owner[index] = rank
        heapq.heappush(load, (busy + costs[index], rank))
    return owner


def _busiest_share(flops: List[int], ranks: int) -> int:
    """The Newton-Schulz FLOPs of the busiest of `ranks` owners of matrices costing `flops`."""
    load = [0] * ranks
    for cost, rank in zip(flops, assign_owners(flops, ranks)):
        load[rank] += cost
    return max(load) if load else 0


def _busiest_finisher(flops: List[int], owners: int, tp: int) -> int:
    """The Newton-Schulz FLOPs of the busiest rank when `owners` data ranks own the matrices and each
    owner's TP peers split its matrices (launch/optim/muon_tp_owners.py)."""
    owner = assign_owners(flops, owners)
    return max((_busiest_share([f for f, o in zip(flops, owner) if o == rank], tp) for rank in range(owners)), default=0)


def newton_schulz_flops(rows: int, cols: int, steps: int = NS_STEPS) -> int:
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m ** 3)


def _swiglu(h: int, width: int, count: int = 1) -> List[Matrix]:
    return [(width, h, 2 * count), (h, width, count)]  # gate and up, down


def dense_matrices(m: ModelConfig, layer_index: int) -> List[Matrix]:
    """The logical matrices Muon orthogonalises in block `layer_index`, but its routed experts:
    Q, K, V, O, and the MLP's (c_fc and c_proj; gate, up and down), or an MoE block's shared experts."""
    h, d = m.n_embd, m.head_dim
    attention = [(m.n_head * d, h, 1), (m.n_kv_head * d, h, 2), (h, m.n_head * d, 1)]
    if is_moe_block(m, layer_index):
        shared = m.moe.shared_experts * m.expert_ffn_hidden_size
        return attention + (_swiglu(h, shared) if shared else [])
    if m.mlp == "swiglu":
        return attention + _swiglu(h, m.ffn_hidden_size)
    return attention + [(m.ffn_hidden_size, h, 1), (h, m.ffn_hidden_size, 1)]


def expert_matrices(m: ModelConfig, layer_index: int, ep: int = 1) -> List[Matrix]:
    """One rank's routed experts' logical matrices in block `layer_index` (E/ep experts)."""
    if not is_moe_block(m, layer_index):
        return []
    return _swiglu(m.n_embd, m.expert_ffn_hidden_size, m.moe.num_experts // ep)


def muon_stage_cost(m: ModelConfig, blocks: Sequence[int], tp: int, data_axis: int, ep: int = 1,
                    zero_stage: int = 1) -> MuonCost:
    """Muon's cost on one rank of the stage holding `blocks` (a resolved config; data_axis = dp x cp)."""
    dense = [x for i in blocks for x in dense_matrices(m, i)]
    experts = [x for i in blocks for x in expert_matrices(m, i, ep)]
    local_dense = sum(r * c * k for r, c, k in dense) // tp
    local_experts = sum(r * c * k for r, c, k in experts) // tp
    expert_axis = max(1, data_axis // ep)
    partitioned = zero_stage == 1
    dense_flops = [k * newton_schulz_flops(r, c) for r, c, k in dense]
    expert_flops = [k * newton_schulz_flops(r, c) for r, c, k in experts]
    if not partitioned:
        local = local_dense + local_experts
        return MuonCost(momentum_bytes=FP32 * local, step_buffer_bytes=STEP_BUFFERS * FP32 * local,
                        gather_bytes=round(FP32 * 2 * (tp - 1) / tp * local),
                        newton_schulz_flops=_busiest_share(dense_flops + expert_flops, tp))
    owned = local_dense / data_axis + local_experts / expert_axis  # elements of the matrices a rank owns
    exchanged = 2 * (local_dense * (data_axis - 1) / data_axis ** 2 + local_experts * (expert_axis - 1) / expert_axis ** 2)
    # the owners' unit is a listed group of matrices (k of one shape), as launch/optim/'s is a parameter
    flops = _busiest_finisher(dense_flops, data_axis, tp) + _busiest_finisher(expert_flops, expert_axis, tp)
    return MuonCost(momentum_bytes=FP32 * (local_dense // data_axis + local_experts // expert_axis),
                    step_buffer_bytes=round(STEP_BUFFERS * FP32 * owned),
                    gather_bytes=round(FP32 * (exchanged + 2 * (tp - 1) / tp * owned)), newton_schulz_flops=flops)
