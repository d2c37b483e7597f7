"""Muon in the planner (issue 38; launch/runtime/muon.py): its memory, its traffic and its
Newton-Schulz FLOPs per step, on the busiest rank of a pipeline stage.

- Memory: one fp32 momentum per element of a Muon matrix (AdamW keeps two moments: Muon saves
  4 bytes per such element), partitioned by ZeRO-1 like AdamW's moments, over the data axis
  (dp x cp ranks; an expert matrix over its expert-data-parallel group, dp x cp / ep).
- ZeRO-1: every matrix has an owner rank in its data group (launch/runtime/muon_owners.py), chosen
  by `assign_owners`. During the step a rank holds its owned matrices whole (as TP shards) and
  their update, and one all-to-all's send and receive buffers: about 4 x 4 bytes per local element
  over D. Traffic received: the two all-to-alls, about 2 (D - 1) / D^2 of the local elements, and
  the TP shards of the owned matrices ((t - 1) / D of them). FLOPs: the owned matrices' only.
- ZeRO-0: every rank orthogonalises every matrix of its stage, gathering its TP shards ((t - 1) x
  the local elements received), holding the direction and the update (8 bytes per local element).
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
NS_STEPS = 5  # launch/runtime/newton_schulz.py
Matrix = Tuple[int, int, int]  # (rows, cols, how many)


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
    if not partitioned:
        flops = sum(k * newton_schulz_flops(r, c) for r, c, k in dense + experts)
        return MuonCost(momentum_bytes=FP32 * (local_dense + local_experts),
                        step_buffer_bytes=2 * FP32 * (local_dense + local_experts),
                        gather_bytes=FP32 * (tp - 1) * (local_dense + local_experts), newton_schulz_flops=flops)
    owned = local_dense / data_axis + local_experts / expert_axis  # elements of the matrices a rank owns
    exchanged = 2 * (local_dense * (data_axis - 1) / data_axis ** 2 + local_experts * (expert_axis - 1) / expert_axis ** 2)
    # the owners' unit is a listed group of matrices (k of one shape), as the runtime's is a parameter
    flops = (_busiest_share([k * newton_schulz_flops(r, c) for r, c, k in dense], data_axis)
             + _busiest_share([k * newton_schulz_flops(r, c) for r, c, k in experts], expert_axis))
    return MuonCost(momentum_bytes=FP32 * (local_dense // data_axis + local_experts // expert_axis),
                    step_buffer_bytes=round(4 * FP32 * owned), gather_bytes=round(FP32 * (exchanged + (tp - 1) * owned)),
                    newton_schulz_flops=flops)
