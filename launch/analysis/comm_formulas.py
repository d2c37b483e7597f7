"""Exact communication of this implementation: every collective one rank calls in one training
step, with its calls, elements and bytes, as launch/instruments/comm_counter.py measures it, so a
measurement can be checked to the byte. Any ModelConfig the repository builds (parameter counts
from launch/analysis/formulas.py), with or without sequence parallelism, at any context-parallel
degree (the Ulysses all-to-alls, Jacobs et al. 2023 [J23]), with experts at any expert-parallel
degree (the token all-to-alls of model/transformer/moe.py: launch/analysis/experts.py).

Payload = what this rank hands to the call (all-gather: its own shard). Each term beyond the
leading ones of docs/design.md (Formulas), and what is not counted: docs/planner-and-metrics.md,
Communication counts.
"""
from typing import Dict, List, Optional, Sequence, Tuple

from launch.analysis import experts, formulas
from launch.analysis.memory_formulas import cp_kv_heads_per_rank
from launch.analysis.partition import blocks_per_stage, stage_partition
from launch.config.layout import Layout
from model.config import GPTConfig
from model.config import ModelConfig
from model.transformer.llama import kv_replicas

Key = Tuple[str, str, str]  # (purpose, role, op), as in launch/instruments/comm_counter.py
Volume = Tuple[int, int, int]  # (calls, elements, bytes)

SHAPE_HEADER_ELEMENTS, SHAPE_HEADER_BYTES = 256, 4  # DeepSpeed TENSOR_META_SIZE, int32
PARTITION_HEADER_BYTES = 8  # int64: PartitionedTensor.to_meta()
ZERO_ALIGNMENT = 2  # DeepSpeed nccl_start_alignment_factor: groups padded to a multiple of 2*d
LOSS_BYTES = 4  # the cross-entropy reduces in fp32 whatever the precision
CP_ALL_TO_ALL = "all_to_all_single"  # torch's call under DeepSpeed-Ulysses' exchange (and model/parallel/mappings.py's)


def partition_header_elements(tp: int) -> int:
    """PartitionedTensor.to_meta() of a (b, s, h) tensor: ndims, 3 sizes, num_parts, rank and
    the t+1 partition offsets."""
    return 1 + 3 + 2 + (tp + 1)


def stage_vector_params_per_rank(config: ModelConfig, tp: int, pp: int, stage: int,
                                 parts: Optional[Sequence[int]] = None) -> int:
    """The vectors (biases, norms: launch/engine/engine.py's no-weight-decay group) one rank of `stage`
    holds: per block the column-parallel biases split over t and the replicated rest, the final
    norm on the last stage. GPT-2: 7h/t + 6h per block and 2h; Llama: 2h per block and h."""
    column, replicated = formulas.block_vector_params(config)
    blocks = _blocks(config, pp, parts)[stage]
    return blocks * (column // tp + replicated) + (formulas.norm_params(config) if stage == pp - 1 else 0)


def _blocks(config: ModelConfig, pp: int, parts: Optional[Sequence[int]]) -> List[int]:
    """Blocks per stage of the cut `parts` (None: counting blocks, DeepSpeed's type:Block)."""
    return blocks_per_stage(config, parts if parts is not None else stage_partition(config, pp, "blocks"))


def zero1_gather_elements(group_params: int, dp: int) -> int:
    """This rank's partition of one ZeRO-1 parameter group: padded to 2*d, split over d."""
    alignment = ZERO_ALIGNMENT * dp
    return -(-group_params // alignment) * alignment // dp


def sequence_parallel_params(config: ModelConfig, blocks: int, first: bool, last: bool) -> Tuple[int, int]:
    """(parameters, elements) of a stage's replicated parameters that see one sequence chunk under
    SP: per block the norms' weights (and LayerNorm biases, Qwen3's q/k norms) and the row-parallel biases, ln_f on
    the last stage, learned positions on the first; each is all-reduced once per step."""
    per_norm = 2 if config.norm == "layernorm" else 1
    qk_norms = 2 if config.qk_norm == "head" else 0  # Qwen3's q/k norm weights, replicated (model/transformer/llama.py)
    calls = blocks * (2 * per_norm + (2 if config.bias else 0) + qk_norms) + (per_norm if last else 0)
    elements = blocks * formulas.block_vector_params(config)[1] + (formulas.norm_params(config) if last else 0)
    if first and config.position == "learned":
        calls, elements = calls + 1, elements + config.seq_len * config.n_embd
    return calls, elements


def kv_gathered_elements(config: ModelConfig, tp: int) -> Tuple[int, int]:
    """(calls, elements of the whole tensors) gathered per block per micro-batch when TP ranks share
    a key/value head (model/transformer/llama.py `kv_replicas` > 1): the K and V rows of the fused qkv_proj
    weight, 2*n_kv_head*d of them, in one call, and of its bias if any in another; (0, 0) when
    every rank holds whole heads of its own."""
    if kv_replicas(config.n_kv_head, tp) == 1:
        return 0, 0
    rows = 2 * config.n_kv_head * config.head_dim
    return (2 if config.bias else 1), rows * (config.n_embd + (1 if config.bias else 0))


def cp_all_to_all_elements(config: ModelConfig, tp: int, cp: int, micro_batch: int) -> Tuple[int, int, int]:
    """(queries, keys, values): the elements one rank hands to each all-to-all of a block's
    attention per micro-batch (Ulysses [J23]). Sequence to heads takes this rank's
    (b, heads, s/cp, d) and returns (b, heads/cp, s, d): the queries' a/t heads, the keys' and
    values' cp * cp_kv_heads_per_rank heads (replicated before the exchange where t*cp > kv).
    The attention output goes back, heads to sequence, with the queries' size; in backward each
    exchange runs once the other way on its gradient, the same elements."""
    s, d = config.seq_len, config.head_dim
    queries = micro_batch * (config.n_head // tp) * (s // cp) * d
    keys = micro_batch * cp * cp_kv_heads_per_rank(config.n_kv_head, tp, cp) * (s // cp) * d
    return queries, keys, keys


def cp_comm_per_rank_per_step(config: ModelConfig, tp: int, cp: int, micro_batch: int, microbatches: int,
                              blocks: int, element_bytes: int, recompute: str = "none") -> Dict[Key, Volume]:
    """The context-parallel all-to-alls of one rank in one step: per block per micro-batch 4 in
    forward (q, k, v to heads, the output back) and 4 in backward (their gradients), 4 more under
    full recompute (the forward again); selective recompute repeats the attention core only,
    inside the exchange. Nothing at cp = 1. The key --comm-counts records them under."""
    if cp == 1:
        return {}
    queries, keys, values = cp_all_to_all_elements(config, tp, cp, micro_batch)
    per_block = queries + keys + values + queries  # the output returns with the queries' shape
    forwards = 2 if recompute == "full" else 1
    out = {}
    for purpose, passes in (("cp-forward", forwards), ("cp-backward", 1)):
        calls, elements = passes * microbatches * blocks * 4, passes * microbatches * blocks * per_block
        out[(purpose, "cp", CP_ALL_TO_ALL)] = (calls, elements, elements * element_bytes)
    return out


def comm_per_rank_per_step(config: GPTConfig, layout: Layout, stage: int, first_step: bool = False,
                           element_bytes: int = 4, cp: int = 1, gradient_reduce: bool = True) -> Dict[Key, Volume]:
    """{(purpose, role, op): (calls, elements, bytes)} of one rank of pipeline stage `stage` in one
    training step. element_bytes: activations and gradients (4 for fp32; 2 for bf16 activations).
    cp: the context-parallel degree; layout.dp the replicas, DeepSpeed's data axis dp * cp ranks:
    every sequence tensor is this rank's s/cp tokens, ZeRO-1 splits over dp * cp.
    gradient_reduce: False where the engine skips the gradient reduction (engine_memory.reduces_gradients)."""
    t, p, m = layout.tp, layout.pp, layout.grad_accum_steps
    d = layout.dp * cp  # DeepSpeed's data axis: the gradient all-reduce and ZeRO-1's partitions
    b, s, h = layout.micro_batch_size, config.seq_len // cp, config.n_embd
    first, last = stage == 0, stage == p - 1
    # The run's stage boundaries (launch/analysis/partition.py: with_stage_boundaries), else DeepSpeed's type:Block.
    cut = list(layout.parts) or stage_partition(config, p, "blocks")
    blocks = _blocks(config, p, cut)[stage]
    moe_blocks = len(experts.moe_block_indices(config, experts.stage_block_indices(config, cut, stage)))
    # An MoE block's MLP (model/transformer/moe.py) reduces once after the combine, as a dense MLP's row-parallel
    # linear; its shared experts' MLP adds a dense MLP's collectives; its combine weights (b, s, k)
    # cross TP as the tokens do (copied in, their partial gradients summed).
    shared = moe_blocks if config.moe.enabled and config.moe.shared_experts else 0
    weights = b * s * config.moe.experts_per_token  # one (b, s, k) tensor of combine weights
    activation = b * s * h  # one (b, s, h) stage tensor
    out: Dict[Key, Volume] = {}

    def add(purpose: str, role: str, op: str, calls: int, elements: int, nbytes: int) -> None:
        if calls:
            out[(purpose, role, op)] = (calls, elements, nbytes)

    sp = config.sequence_parallel and t > 1
    if sp:
        # A dense MLP gathers 3 times and scatters twice; an MoE MLP gathers its tokens and its output's
        # gradient, scatters the reverse, and gathers its combine weights (scattering their gradient)
        # and its chosen experts (int64, no gradient): the shared experts add a dense MLP's.
        gathers = m * (6 * blocks - moe_blocks + 3 * shared + first + last)
        scatters = m * (4 * blocks + 2 * shared + first + last)
        routing = m * moe_blocks * weights // t  # each rank's chunk of the (b, s, k) weights or experts
        add("sp-gather", "tp", "all_gather_single", gathers + 2 * m * moe_blocks,
            gathers * activation // t + 2 * routing,
            (gathers * activation // t + routing) * element_bytes + routing * experts.INDEX_BYTES)
        add("sp-scatter", "tp", "reduce_scatter_single", scatters + m * moe_blocks,
            scatters * activation + m * moe_blocks * weights,
            (scatters * activation + m * moe_blocks * weights) * element_bytes)
        if last:
            add("tp-loss", "tp", "all_reduce", 3 * m, 3 * m * b * s, 3 * m * b * s * LOSS_BYTES)
        calls, elements = sequence_parallel_params(config, blocks, first, last)
        # The router (E x h) of each MoE block sees this rank's chunk too.
        calls, elements = calls + moe_blocks, elements + moe_blocks * experts.router_params(config)
        add("tied-grads", "tp", "all_reduce", calls, elements, elements * element_bytes)
    elif t > 1:
        forward = m * (2 * blocks + shared + first)  # row-parallel outputs per block (+ shared experts'); the embedding
        backward = m * (2 * blocks + shared + last)  # column-parallel inputs' grads per block; the head's input grad
        routing = m * moe_blocks  # the combine weights' gradient, (b, s, k), per MoE block
        add("tp-forward", "tp", "all_reduce", forward, forward * activation, forward * activation * element_bytes)
        add("tp-backward", "tp", "all_reduce", backward + routing, backward * activation + routing * weights,
            (backward * activation + routing * weights) * element_bytes)
        if last:
            add("tp-loss", "tp", "all_reduce", 3 * m, 3 * m * b * s, 3 * m * b * s * LOSS_BYTES)
        if config.qk_norm == "head":  # Qwen3's q/k norm weights: replicated, each rank's heads' gradient summed once
            qk = 2 * blocks * config.head_dim
            add("tied-grads", "tp", "all_reduce", 2 * blocks, qk, qk * element_bytes)
    if t > 1:
        # Shared key/value heads: the gather hands this rank's 1/t shard, the reduce-scatter the whole gradient.
        per_block, gathered = kv_gathered_elements(config, t)
        calls, elements = m * blocks * per_block, m * blocks * gathered
        add("tp-kv-gather", "tp", "all_gather_single", calls, elements // t, elements // t * element_bytes)
        add("tp-kv-grads", "tp", "reduce_scatter_single", calls, elements, elements * element_bytes)

    if p > 1:
        shard = activation // t  # each TP rank's part of a stage tensor (all of it at t = 1)
        partitioned = t > 1 and not sp  # DeepSpeed's pipe_partitioned (model/gpt/pipe.py: pipeline_config)
        header = partition_header_elements(t) if partitioned else 0
        calls = m * (2 if partitioned else 1)  # header + shard, or the tensor (SP: this rank's chunk)
        message = (calls, m * (shard + header), m * (shard * element_bytes + header * PARTITION_HEADER_BYTES))
        if not last:
            add("pp-activations", "pp-p2p", "send", *message)
            add("pp-grads", "pp-p2p", "recv", *message)
        if not first:
            add("pp-activations", "pp-p2p", "recv", *message)
            add("pp-grads", "pp-p2p", "send", *message)
        if partitioned:  # re-assemble: received activations; own output and received grads
            gathers = m * ((not first) + 2 * (not last))
            add("pp-tp-gather", "tp", "all_gather_into_tensor", gathers, gathers * shard,
                gathers * shard * element_bytes)
        if first_step:  # the shape header goes once per engine, before the first activations
            header_volume = (1, SHAPE_HEADER_ELEMENTS, SHAPE_HEADER_ELEMENTS * SHAPE_HEADER_BYTES)
            if not last:
                add("pp-shape", "pp-p2p", "send", *header_volume)
            if not first:
                add("pp-shape", "pp-p2p", "recv", *header_volume)
        if config.tie_embeddings and (first or last):
            wte = formulas.embedding_params_per_rank(config.vocab_size, h, t, config.vocab_pad_multiple)
            add("tied-grads", "pp", "all_reduce", 1, wte, wte * element_bytes)

    if t > 1 and config.qk_norm == "projection":  # OLMoE's q/k norm: the sum of squares over TP, each way
        rows = m * blocks * 2 * b * s  # (b, s, 1) fp32 per norm, two norms per block
        add("tp-qk-norm", "tp", "all_reduce", 2 * m * blocks * 2, 2 * rows, 2 * rows * LOSS_BYTES)

    ep = layout.ep
    local = formulas.model_stage_params_per_rank(config, t, p, stage, cut, ep)
    routed = experts.stage_expert_params_per_rank(config, t, ep, cut, stage)  # reduced over dp x cp / ep ranks
    d_expert = d // ep
    add("dp-grads", "dp" if d > 1 else "self", "all_reduce", int(gradient_reduce), local - routed,
        (local - routed) * element_bytes)
    if routed and gradient_reduce:  # the experts' gradients: a reduction of their own (merged with the other where both span the same role)
        key = ("dp-grads", "dp" if d_expert > 1 else "self", "all_reduce")
        calls, elements, nbytes = out.get(key, (0, 0, 0))
        out[key] = (calls + 1, elements + routed, nbytes + routed * element_bytes)
    if d > 1:
        vectors = stage_vector_params_per_rank(config, t, p, stage, cut)
        groups = [zero1_gather_elements(n, d) for n in (local - routed - vectors, vectors) if n]
        if routed and d_expert > 1:
            groups.append(zero1_gather_elements(routed, d_expert))
        add("dp-params", "dp", "all_gather_into_tensor", len(groups), sum(groups), sum(groups) * element_bytes)
    out.update(cp_comm_per_rank_per_step(config, t, cp, b, m, blocks, element_bytes))
    out.update(experts.ep_comm_per_rank_per_step(config, ep, cp, b, m, moe_blocks, element_bytes))
    return out
