"""Context parallelism in the planner (issue 25; Ulysses, Jacobs et al. 2023): the layout rules
the exchange needs and the bytes of its all-to-alls. The activation count at cp is
memory_formulas.model_activation_bytes_per_layer's, the exact per-call volumes comm_formulas'."""
from launch.analysis.engine_memory import ELEMENT_BYTES
from launch.errors import ConfigError
from model.config import ModelConfig


def check_context_split(model: ModelConfig, tp: int, cp: int) -> None:
    """What Ulysses' exchange needs (issue 25): each of the tp*cp ranks of a stage attends with
    n_head/(tp*cp) whole heads over the whole sequence, from its s/cp tokens (s/(cp*tp) under SP)."""
    if cp == 1:
        return
    full, split = model.resolved(), tp * cp
    if full.n_head % split:
        raise ConfigError(f"model.n_head={full.n_head} is not divisible by tp*cp = {tp}*{cp} = {split}: each rank "
                          f"attends with n_head/(tp*cp) whole heads; choose a cp that divides {full.n_head // tp}")
    kv = full.n_kv_head
    if kv % split and split % kv:
        raise ConfigError(f"model.n_kv_head={kv} with tp*cp = {tp}*{cp} = {split}: tp*cp must divide n_kv_head or "
                          f"n_kv_head must divide tp*cp (ranks then share a replicated key/value head); choose "
                          f"a cp with tp*cp among the divisors or multiples of {kv}")
    tokens = cp * tp if model.sequence_parallel and tp > 1 else cp
    if model.seq_len % tokens:
        under = f"cp*tp = {cp}*{tp} = {tokens} (sequence parallelism splits each shard again)" if tokens != cp \
            else f"--cp {cp}"
        raise ConfigError(f"model.seq_len={model.seq_len} is not divisible by {under}: each rank holds an equal "
                          f"shard of every sequence; choose a seq_len that is a multiple of {tokens}")


def cp_bytes_per_step(model: ModelConfig, tp: int, cp: int, micro_batch: int, precision: str, recompute: str,
                      blocks: int, microbatches: int) -> int:
    """Bytes one rank hands to the context-parallel all-to-alls per step (comm_formulas'
    exact count: 4 per block per micro-batch forward, 4 backward, 4 more under full recompute)."""
    from launch.analysis.comm_formulas import cp_comm_per_rank_per_step  # imports the model: only when planning
    volumes = cp_comm_per_rank_per_step(model.resolved(), tp, cp, micro_batch, microbatches, blocks,
                                        ELEMENT_BYTES[precision], recompute)
    return sum(nbytes for _, _, nbytes in volumes.values())
