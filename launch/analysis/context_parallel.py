"""Context parallelism in the planner (Ulysses, Jacobs et al. 2023): the bytes of its
all-to-alls. The layout rules are the run's (launch/config/layout.py check_context_parallel), the
activation count at cp is memory_formulas.model_activation_bytes_per_layer's, the exact per-call
volumes comm_formulas'."""
from launch.analysis.engine_memory import ELEMENT_BYTES
from model.config import ModelConfig


def cp_bytes_per_step(model: ModelConfig, tp: int, cp: int, micro_batch: int, precision: str, recompute: str,
                      blocks: int, microbatches: int) -> int:
    """Bytes one rank hands to the context-parallel all-to-alls per step (comm_formulas'
    exact count: 4 per block per micro-batch forward, 4 backward, 4 more under full recompute)."""
    from launch.analysis.comm_formulas import cp_comm_per_rank_per_step  # imports the model: only when planning
    volumes = cp_comm_per_rank_per_step(model.resolved(), tp, cp, micro_batch, microbatches, blocks,
                                        ELEMENT_BYTES[precision], recompute)
    return sum(nbytes for _, _, nbytes in volumes.values())
