"""Formulas of 3D-parallel GPT training: parameters, FLOPs, bubble, communication (memory:
launch/analysis/memory_formulas.py).

Pure functions of the model dimensions and the layout, shared by the planner
(launch/plan.py) and the training metrics. Sources, cited per function:
  [N21] Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
        Clusters Using Megatron-LM" (SC'21).
  [K22] Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
        Models".
  [R20] Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
        Parameter Models" (SC'20).
Symbols: l layers, h hidden, a heads, s sequence, V vocabulary, b micro-batch, B global batch,
t tp, p pp, d dp, m micro-batches per pipeline per step. Bytes assume bf16/fp16 mixed precision.
"""
from typing import Dict, List, Optional, Sequence, Tuple

from launch.analysis import experts
from model.config import ModelConfig, padded_vocab_size
from model.gpt.layer_table import pipeline_layers

# Dense bf16 peak FLOP/s per GPU (vendor datasheets, without sparsity).
PEAK_FLOPS_BF16: Dict[str, float] = {"H100": 989e12, "H200": 989e12, "A100": 312e12}

# Mixed-precision model states [R20 sec. 3.1]: 2+2 bytes of bf16/fp16 weights and gradients,
# K = 12 bytes of fp32 optimizer states (master weights, Adam momentum and variance).
WEIGHT_BYTES, GRAD_BYTES, OPTIMIZER_BYTES = 2, 2, 12
ACTIVATION_BYTES = 2  # one bf16/fp16 element on the wire


# ---------------------------------------------------------------- parameters

def params_formula(n_layer: int, hidden: int, vocab: int, seq_len: int) -> float:
    """P = 12*l*h^2 * (1 + 13/(12h) + (V+s)/(12*l*h))  [N21 sec. 5.1].

    Counts the blocks (12h^2 + 13h each), the token and position embeddings; the output layer
    is tied to the token embedding. Omits the final LayerNorm (2h)."""
    l, h = n_layer, hidden
    return 12 * l * h ** 2 * (1 + 13 / (12 * h) + (vocab + seq_len) / (12 * l * h))


def block_params(hidden: int) -> int:
    """One GPT-2 block: ln_1, ln_2 (2h each), c_attn (3h^2 + 3h), attn c_proj (h^2 + h),
    c_fc (4h^2 + 4h), mlp c_proj (4h^2 + h) = 12h^2 + 13h."""
    return 12 * hidden ** 2 + 13 * hidden


def params_exact(n_layer: int, hidden: int, vocab: int, seq_len: int) -> int:
    """Our GPT-2 exactly (unpadded, one copy of the tied wte): V*h + s*h + l*(12h^2+13h) + 2h."""
    return vocab * hidden + seq_len * hidden + n_layer * block_params(hidden) + 2 * hidden


def block_params_per_rank(hidden: int, tp: int) -> int:
    """A block on one TP rank: the column/row-parallel weights and column-parallel biases
    (12h^2 + 7h) split over t; both LayerNorms and the two row-parallel biases (6h) replicated."""
    return (12 * hidden ** 2 + 7 * hidden) // tp + 6 * hidden


def embedding_params_per_rank(vocab: int, hidden: int, tp: int, pad_multiple: int = 1) -> int:
    """wte on one TP rank: V padded to a multiple of pad_multiple*t, rows split over t."""
    return padded_vocab_size(vocab, tp, pad_multiple) // tp * hidden


def layer_kinds(model: ModelConfig) -> List[str]:
    """The kind of each layer of a resolved config, from the layer table (model/gpt/layer_table.py):
    [embed, wpe, block..., ln_f, head] for GPT-2, [embed, block..., ln_f, lm_head] for Llama."""
    return [kind for kind, _ in pipeline_layers(model)]


def _gpt2_layers(n_layer: int) -> ModelConfig:
    """GPT-2 of n_layer blocks (learned positions, tied head): the layers the closed forms count."""
    return ModelConfig(n_layer=n_layer).resolved()


def stage_params_per_rank(n_layer: int, hidden: int, vocab: int, seq_len: int, tp: int, pp: int,
                          stage: int, pad_multiple: int = 1, *, parts: Sequence[int]) -> int:
    """Parameters one rank of pipeline stage `stage` holds in a (tp, pp) layout cut at `parts`
    (launch/analysis/partition.py's `stage_partition`, which uses this module's FLOPs).

    The first stage holds wte, the last stage a tied copy of it (DeepSpeed TiedLayerSpec);
    at pp=1 both are one module. wpe and ln_f are replicated over TP."""
    assert len(parts) == pp + 1, f"{pp} stages need {pp + 1} boundaries, got {parts}"
    names = layer_kinds(_gpt2_layers(n_layer))
    held = names[parts[stage]:parts[stage + 1]]
    embed = embedding_params_per_rank(vocab, hidden, tp, pad_multiple)
    count = held.count("block") * block_params_per_rank(hidden, tp)
    count += embed if ("embed" in held or "head" in held) else 0
    count += seq_len * hidden if "wpe" in held else 0
    count += 2 * hidden if "ln_f" in held else 0
    return count


# ---------------------------------------------------------------- any architecture (model/config.py)
# The functions above are GPT-2's closed forms; these count the same things for any preset and
# switches, from a resolved ModelConfig (`ModelConfig.resolved()`, vocab_size set). For GPT-2
# they return exactly what the closed forms do (tests/analysis/test_llama_formulas.py).

def block_matmul_params(m: ModelConfig, layer_index: Optional[int] = None, active: bool = False) -> int:
    """Weights of one block's matrices: q and o (h x a*d each), k and v (h x kv*d each), and the
    MLP's up and down (h x f each) plus gate with SwiGLU; in an MoE block the router, the
    routed experts (all E, or with `active` the k a token uses) and the shared experts instead of
    the MLP (launch/analysis/experts.py). `layer_index` None: the model's typical block, MoE when
    it has experts. GPT-2: 4h^2 + 8h^2 = 12h^2."""
    return experts.attention_matmul_params(m) + experts.mlp_matmul_params(m, layer_index, active)


def block_vector_params(m: ModelConfig) -> Tuple[int, int]:
    """(split over TP, replicated) vectors of one block: column-parallel biases (q, k, v, gate,
    up) and OLMoE's q/k norms over the whole projections (split over TP as their rows); row-parallel
    biases (o, down), the two norms (2h each for LayerNorm, h for RMSNorm) and Qwen3's per-head q/k
    norms (d each, shared by the heads)."""
    h, f = m.n_embd, m.ffn_hidden_size
    column = (m.n_head + 2 * m.n_kv_head) * m.head_dim + (2 if m.mlp == "swiglu" else 1) * f if m.bias else 0
    row = 2 * h if m.bias else 0
    qk_column = (m.n_head + m.n_kv_head) * m.head_dim if m.qk_norm == "projection" else 0
    qk_replicated = 2 * m.head_dim if m.qk_norm == "head" else 0
    return column + qk_column, row + 2 * norm_params(m) + qk_replicated


def norm_params(m: ModelConfig) -> int:
    return 2 * m.n_embd if m.norm == "layernorm" else m.n_embd


def _embedding_and_edge_params(m: ModelConfig) -> int:
    """The token embedding, a separate head, the position table and the final norm."""
    embeddings = m.vocab_size * m.n_embd * (1 if m.tie_embeddings else 2)
    positions = m.seq_len * m.n_embd if m.position == "learned" else 0
    return embeddings + positions + norm_params(m)


def model_params(m: ModelConfig, active: bool = False) -> int:
    """Every parameter of the model (unpadded vocabulary, a tied head counted once): the token
    embedding, a separate head, the position table, the blocks and the final norm. With experts
    every expert counts; `active`: the parameters one token uses, the k routed experts
    of each MoE block (plus its router and shared experts) instead of all E."""
    column, replicated = block_vector_params(m)
    if not m.moe.enabled:  # every block the same
        return _embedding_and_edge_params(m) + m.n_layer * (block_matmul_params(m) + column + replicated)
    return _embedding_and_edge_params(m) + sum(block_matmul_params(m, i, active) + column + replicated
                                               for i in range(m.n_layer))


def model_params_active(m: ModelConfig) -> int:
    """The parameters one token passes through: `model_params` with k routed experts per MoE block."""
    return model_params(m, active=True)


def model_block_params_per_rank(m: ModelConfig, tp: int, layer_index: Optional[int] = None, ep: int = 1) -> int:
    """A block on one TP rank: matrices and column-parallel biases split over t (k and v too
    when tp > n_kv_head: each rank holds its share of a key/value head's rows); row-parallel
    biases and norms replicated. An MoE block: the shared experts split over t as a dense MLP, the
    router replicated, this rank's E/ep experts each split over t."""
    column, replicated = block_vector_params(m)
    split, router, local_experts = experts.mlp_params_per_rank(m, layer_index, tp, ep)
    return (experts.attention_matmul_params(m) + split + column) // tp + replicated + router + local_experts


def model_stage_params_per_rank(m: ModelConfig, tp: int, pp: int, stage: int, parts: Sequence[int],
                                ep: int = 1) -> int:
    """`stage_params_per_rank` for any architecture: the stage's layers from the model's table;
    with experts, each block by its index (MoE or dense) and E/ep experts per rank."""
    assert len(parts) == pp + 1, f"{pp} stages need {pp + 1} boundaries, got {parts}"
    names = layer_kinds(m)
    held = names[parts[stage]:parts[stage + 1]]
    vocab = embedding_params_per_rank(m.vocab_size, m.n_embd, tp, m.vocab_pad_multiple)
    if m.moe.enabled:
        count = sum(model_block_params_per_rank(m, tp, i, ep) for i in experts.stage_block_indices(m, parts, stage))
    else:
        count = held.count("block") * model_block_params_per_rank(m, tp)
    count += vocab * (("embed" in held or "head" in held) + ("lm_head" in held))
    count += m.seq_len * m.n_embd if "wpe" in held else 0
    count += norm_params(m) if "ln_f" in held else 0
    return count


def model_flops_per_step_of(m: ModelConfig, global_batch: int, seq_len: int, recompute: bool = False) -> float:
    """`model_flops_per_step` for any architecture: 2 FLOPs per matrix weight per token (q, k, v,
    o, gate, up, down: GQA and SwiGLU change these counts), 4*s*a*d per token for QK^T and @V
    (all query heads, whatever n_kv_head), 2hV for the head; backward twice the forward. In the
    closed form's shape, so GPT-2 (block matrices 12h^2) gives its float exactly. With experts
    the active weights: each MoE block's router, k routed experts and shared experts."""
    B, s, l, h, V = global_batch, seq_len, m.n_layer, m.n_embd, m.vocab_size
    if m.moe.enabled:  # the blocks' mean active matrices (MoE and dense blocks differ when moe_every > 1)
        blocks = sum(block_matmul_params(m, i, active=True) for i in range(l)) / (l * 12 * h ** 2)
    else:
        blocks = block_matmul_params(m) / (12 * h ** 2)
    core = s / (6 * h) * (m.n_head * m.head_dim / h)  # s/(6h) when a*d = h, as in every preset
    if recompute:
        return 96 * B * s * l * h ** 2 * (blocks + core + V / (16 * l * h))
    return 72 * B * s * l * h ** 2 * (blocks + core + V / (12 * l * h))


def model_layer_flops_per_microbatch(m: ModelConfig, micro_batch: int, seq_len: int, recompute: bool = False,
                                     layer_index: Optional[int] = None) -> int:
    """`layer_flops_per_microbatch` for any architecture: 3 x (2 b s W + 4 b s^2 a d), W the
    block's matrix weights (an MoE block's active ones: router, k experts, shared experts); 4 x
    with full recompute. GPT-2: 72bsh^2 + 12bs^2h."""
    b, s = micro_batch, seq_len
    forward = 2 * b * s * block_matmul_params(m, layer_index, active=True) + 4 * b * s * s * m.n_head * m.head_dim
    return (4 if recompute else 3) * forward


# ---------------------------------------------------------------- compute and schedule

def model_flops_per_step(global_batch: int, seq_len: int, n_layer: int, hidden: int, vocab: int,
                         recompute: bool = False) -> float:
    """72*B*s*l*h^2 * (1 + s/(6h) + V/(12*l*h)): forward + backward (3x forward) [N21 sec. 5.1].

    With full recompute the forward runs twice (4x forward):
    96*B*s*l*h^2 * (1 + s/(6h) + V/(16*l*h)), the count [N21] reports. MFU uses the first."""
    B, s, l, h, V = global_batch, seq_len, n_layer, hidden, vocab
    if recompute:
        return 96 * B * s * l * h ** 2 * (1 + s / (6 * h) + V / (16 * l * h))
    return 72 * B * s * l * h ** 2 * (1 + s / (6 * h) + V / (12 * l * h))


def layer_flops_per_microbatch(micro_batch: int, seq_len: int, hidden: int,
                               recompute: bool = False) -> float:
    """One block, forward + backward, one micro-batch: 72bsh^2 + 12bs^2h (96 and 16 with
    recompute): the per-layer share of `model_flops_per_step`."""
    b, s, h = micro_batch, seq_len, hidden
    return (96 * b * s * h ** 2 + 16 * b * s ** 2 * h) if recompute else (72 * b * s * h ** 2 + 12 * b * s ** 2 * h)


def logits_flops_per_microbatch(micro_batch: int, seq_len: int, hidden: int, vocab: int) -> float:
    """Output layer, forward + backward: 6bshV (the V term of `model_flops_per_step`)."""
    return 6 * micro_batch * seq_len * hidden * vocab


def bubble_fraction(pp: int, microbatches: int) -> float:
    """1F1B pipeline bubble as a fraction of the step: (p-1)/(m+p-1).

    [N21 sec. 2.2.1] states it relative to the ideal time, (p-1)/m; the same bubble."""
    return (pp - 1) / (microbatches + pp - 1)


def interleaved_bubble_fraction(pp: int, microbatches: int, virtual_stages: int) -> float:
    """Interleaved 1F1B's bubble (v chunks per rank) as a fraction of the step: (p-1)/(v m + p-1),
    (p-1)/(v m) of the ideal time [N21 sec. 2.2.2]; 1F1B's at v = 1
    (launch/analysis/interleaved_schedule.py)."""
    return (pp - 1) / (virtual_stages * microbatches + pp - 1)


def mfu(model_flops: float, step_time_s: float, peak_flops: float, num_gpus: int) -> float:
    """Model FLOPs utilisation: model FLOPs / (time * peak * G) (no recompute FLOPs counted)."""
    return model_flops / (step_time_s * peak_flops * num_gpus)


# ---------------------------------------------------------------- communication

def tp_allreduce_bytes_per_step(micro_batch: int, seq_len: int, hidden: int, layers: int,
                                microbatches: int, recompute: bool = False) -> int:
    """Data all-reduced by one TP rank per step: 4 all-reduces of b*s*h elements per layer per
    micro-batch, 2 forward and 2 backward [N21 sec. 2.3]; 6 when recompute repeats the forward.
    Ignores the embedding's and the logits' all-reduces (one each per micro-batch)."""
    count = 6 if recompute else 4
    return count * micro_batch * seq_len * hidden * ACTIVATION_BYTES * layers * microbatches


def kv_gather_bytes_per_step(m: ModelConfig, tp: int, layers: int, microbatches: int,
                              recompute: bool = False) -> int:
    """What GQA adds to one TP rank's traffic when tp > n_kv_head (model/transformer/llama.py): per block
    per micro-batch, the K and V rows of the fused qkv_proj all-gathered in forward (again with
    recompute) and their gradients reduce-scattered in backward: the gathered size is 2*kv*d*h
    (+ 2*kv*d with biases) elements. Zero when n_kv_head divides by tp (each rank holds its own heads)."""
    if tp <= m.n_kv_head:
        return 0
    weights = m.n_kv_head * m.head_dim * (m.n_embd + (1 if m.bias else 0))
    return (3 if recompute else 2) * 2 * weights * ACTIVATION_BYTES * layers * microbatches


def pp_p2p_bytes_per_step(micro_batch: int, seq_len: int, hidden: int, microbatches: int) -> int:
    """Sent over one stage boundary per step, each way: b*s*h elements per micro-batch
    (activations forward, their gradients backward) [N21 sec. 3]."""
    return micro_batch * seq_len * hidden * ACTIVATION_BYTES * microbatches


def dp_allreduce_bytes_per_step(params_per_device: int) -> int:
    """Gradient all-reduce per step across the dp replicas: the local gradient, params/(t*p)
    on average [N21 sec. 3], in bf16/fp16: the leading term. DeepSpeed reduces in the model dtype
    even when it accumulates in fp32; the planner's exact count, per precision and with ZeRO-1's
    padding, is launch/analysis/engine_memory.py's dp_allreduce_bytes."""
    return params_per_device * GRAD_BYTES


def ring_allreduce_factor(group: int) -> float:
    """A ring all-reduce sends and receives 2*(n-1)/n times the data per rank."""
    return 2 * (group - 1) / group
