"""Muon in the planner (issue 38; launch/runtime/muon.py): its memory, its gathers and its
Newton-Schulz FLOPs per step, on one rank of a pipeline stage.

- Memory: one fp32 momentum per element of a Muon matrix (AdamW keeps two moments: Muon saves
  4 bytes per such element), partitioned by ZeRO-1 like AdamW's moments, over the data axis
  (dp x cp ranks; an expert matrix over its expert-data-parallel group, dp x cp / ep). During the
  step each rank also holds its stage's Muon matrices whole-flat twice (the gathered direction and
  the update: 8 bytes per local element).
- Traffic, received per rank per step: the all-gather of the flat Muon groups over the data axis
  ((D - 1) / D of the local elements, 4 bytes each) and of every matrix's TP shards ((t - 1) x the
  local elements).
- FLOPs: Newton-Schulz on every logical matrix of the stage (a rank's E/ep experts only), 5 steps of
  X X^T, A^2 and (b A + c A^2) X with m the smaller side: 5 (4 m^2 n + 2 m^3). Every rank of a
  TP x data group computes all of them (no owner ranks yet): the same on each.
No torch here: only the model's config.
"""
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
    momentum = FP32 * (local_dense // (data_axis if partitioned else 1) + local_experts // (expert_axis if partitioned else 1))
    gathered = (local_dense * (data_axis - 1) // data_axis + local_experts * (expert_axis - 1) // expert_axis) \
        if partitioned else 0
    gather = FP32 * (gathered + (tp - 1) * (local_dense + local_experts))
    flops = sum(k * newton_schulz_flops(r, c) for r, c, k in dense + experts)
    return MuonCost(momentum_bytes=momentum, step_buffer_bytes=2 * FP32 * (local_dense + local_experts),
                    gather_bytes=gather, newton_schulz_flops=flops)
