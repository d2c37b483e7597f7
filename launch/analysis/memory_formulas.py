"""Memory formulas of 3D-parallel GPT training: model states per device under ZeRO and the
activations a block and a pipeline stage keep for backward.

Pure functions of the model dimensions and the layout, used by the planner (launch/plan.py),
bench/memory/activation_memory.py and the tests that check them against measured memory. Sources and
symbols as in launch/analysis/formulas.py: [K22] Korthikanti et al. 2022, [R20] Rajbhandari et
al. 2020 (ZeRO), [N21] Narayanan et al. 2021, [J23] Jacobs et al. 2023 (DeepSpeed-Ulysses);
s sequence, b micro-batch, h hidden, a heads, t tp, cp the context-parallel degree.
"""
from typing import Dict, Optional

from launch.analysis.experts import is_moe_block, moe_mlp_activation_bytes, moe_weight_grad_stash_bytes
from launch.analysis.formulas import ACTIVATION_BYTES, GRAD_BYTES, OPTIMIZER_BYTES, WEIGHT_BYTES
from model.config import ModelConfig, padded_vocab_size


def model_state_bytes(params: float, dp: int, zero_stage: int) -> Dict[str, float]:
    """Weights, gradients and optimizer states per device for `params` local parameters [R20
    sec. 3.1 and 5, fig. 1]: 2 + 2 + K bytes/param with K = 12, i.e. 16 without ZeRO (stage 0);
    stage 1 splits the optimizer over d (4 + 12/d); stage 2 also the gradients (2 + 14/d);
    stage 3 also the weights (16/d). The paper's count: what DeepSpeed's engine allocates on top
    (the bf16 path's fp32 gradient buffer, ZeRO-1's padding and bucket) is
    launch/analysis/engine_memory.py's."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage} must be 0, 1, 2 or 3")
    split = lambda stage: dp if zero_stage >= stage else 1  # noqa: E731
    return {"weights": params * WEIGHT_BYTES / split(3),
            "gradients": params * GRAD_BYTES / split(2),
            "optimizer": params * OPTIMIZER_BYTES / split(1)}


def checkpoint_snapshot_bytes(params: float, dp: int, zero_stage: int, weight_bytes: int) -> float:
    """Host memory of train.async_save's snapshot (launch/checkpoints/async_save.py) on the rank that
    writes the most, data rank 0 of its stage: the layer files of its `params` local parameters at
    `weight_bytes` each, and its share of the fp32 master weights and Adam moments (OPTIMIZER_BYTES
    per parameter, split over dp from ZeRO-1 on [R20]). One snapshot at a time; an upper bound (fp32
    weights under ZeRO-0 keep no separate master copy)."""
    return params * weight_bytes + params * OPTIMIZER_BYTES / (dp if zero_stage >= 1 else 1)


def activation_bytes_per_layer(seq_len: int, micro_batch: int, hidden: int, heads: int,
                               tp: int = 1, recompute: bool = False, sequence_parallel: bool = False,
                               selective: bool = False, element_bytes: int = ACTIVATION_BYTES,
                               mask_bytes: int = 1, layernorm_stat_bytes: int = 0,
                               fused_attention: bool = False) -> float:
    """Activations one block stores for backward, per micro-batch, per TP rank [K22 sec. 4-5,
    table 2]. With the defaults (fp16/bf16: 2 bytes per element, 1 per dropout-mask element):
      no parallelism                 s*b*h*(34 + 5*a*s/h)
      tensor parallel (t)            s*b*h*(10 + 24/t + 5*a*s/(h*t))
      tensor + sequence parallel     s*b*h*(34/t + 5*a*s/(h*t))
      selective recompute            the same without the 5*a*s/h terms
      full recompute                 2*s*b*h, the block input; with sequence parallelism the
                                     stored input is a (s/t, b, h) chunk: 2*s*b*h/t (K22's
                                     table 2 lists 2sbh, without SP).
    K22's tensor-by-tensor count, per s*b*h, with E = element_bytes and M = mask_bytes:
      replicated over TP, split by SP:  LayerNorm inputs 2E, inputs of the QKV and first MLP
                                        linears 2E, two dropout masks 2M          (10 in fp16)
      split by TP:                      Q and K 2E, V E, attention-output projection input E,
                                        GELU input 4E and output 4E               (24)
      attention core, per a*s/h:        softmax output E, its dropout mask M and output E (5)
    `layernorm_stat_bytes` adds what K22 leaves out: each LayerNorm's mean and 1/std per token
    (4 bytes each in fp32). The core assumes the s x s scores are stored (SDPA's math path);
    `fused_attention` (flash) keeps none, only an fp32 logsumexp per row and head: 4*a/h
    (model_activation_bytes_per_layer)."""
    s, b, h, a, t = seq_len, micro_batch, hidden, heads, tp
    E, M = element_bytes, mask_bytes
    sp = t if sequence_parallel else 1
    if recompute:
        return E * s * b * h / sp
    replicated = 4 * E + 2 * M
    split = 12 * E
    core = 0 if selective else 4 * a / h if fused_attention else (2 * E + M) * a * s / h
    stats = 2 * 2 * layernorm_stat_bytes * s * b  # two LayerNorms, mean and 1/std per token
    return s * b * h * (replicated / sp + split / t + core / t) + stats / sp


def inflight_microbatches(pp: int, microbatches: int, stage: int = 0) -> int:
    """Micro-batches whose activations stage `stage` holds at the peak of 1F1B: min(p - stage, m);
    the first stage holds the most, min(p, m) [N21 sec. 2.2.1; K22 sec. 4]."""
    return min(pp - stage, microbatches)


def activation_bytes_per_stage(seq_len: int, micro_batch: int, hidden: int, heads: int, tp: int,
                               layers: int, inflight: int, recompute: bool = False) -> float:
    """Peak activation memory of one stage: per-layer activations x layers x in-flight
    micro-batches. Excludes the embedding and output-layer activations."""
    per_layer = activation_bytes_per_layer(seq_len, micro_batch, hidden, heads, tp, recompute)
    return per_layer * layers * inflight


def model_activation_bytes_per_layer(m: ModelConfig, seq_len: int, micro_batch: int, tp: int = 1,
                                     recompute: bool = False, sequence_parallel: bool = False,
                                     selective: bool = False, element_bytes: int = ACTIVATION_BYTES,
                                     mask_bytes: int = 1, layernorm_stat_bytes: int = 0,
                                     fused_attention: bool = False, cp: int = 1,
                                     layer_index: Optional[int] = None, ep: int = 1) -> float:
    """`activation_bytes_per_layer` (K22's tensor-by-tensor count) for any architecture; equal to
    it for GPT-2. Per s*b*h, E = element_bytes, M = mask_bytes:
      replicated over TP, split by SP: norm inputs 2E, inputs of the q/k/v and first MLP
        projections 2E, two dropout masks 2M; RMSNorm (model/transformer/norms.py, transformers' formula)
        keeps its input in fp32 (2*4 for the two norms, whatever E: in bf16 that is a copy) and
        its normalised output before the weight, 2E;
      split by TP: Q E*a*d/h, K and V E*kv*d/h each (SDPA's math path, CPU with dropout, expands
        them to all a heads before saving: count kv = a there), the o_proj input E*a*d/h; the MLP
        keeps 2 tensors of width f (GELU: its input and output) or 4 (SwiGLU: gate, up, silu(gate)
        and their product), E*f/h each;
      attention core, per a*s/h: (2E + M), as K22: SDPA's math path, which stores the s x s
        scores (CPU with dropout). `fused_attention` (flash SDPA: the GPU path, and CPU's without
        dropout) stores no scores, only an fp32 logsumexp per row and head, 4*a/h: its output,
        laid out (b, s, a, d), is the o_proj input already counted (the transpose before o_proj
        copies nothing). Selective recompute (model/transformer/attention.py checkpoints the whole core, its
        inputs q, k, v already counted) stores neither;
    Per token: `layernorm_stat_bytes` for each LayerNorm's mean and 1/std, or each RMSNorm's 1/rms.
    RoPE adds its cos and sin tables, 2*s*d*E per block (independent of b).
    Context parallelism (`cp`, Ulysses [J23]): a rank holds n = s/cp tokens of every
    sequence, so every per-token term above counts n tokens; the attention core runs after the
    all-to-all on the whole sequence for a/(t*cp) heads, so its inputs and logsumexp are the same
    1/cp, but the math path's scores are (a/(t*cp)) x s x s (the core's s stays s), the fused
    path keeps its output apart from the o_proj input (E*a*d/h more), K and V hold
    `cp_kv_heads_per_rank` heads of s tokens (at least one: replicated where t*cp > kv), and RoPE's
    tables cover the whole sequence's positions.
    Mixture of experts: an MoE block (block `layer_index`; None: MoE when the model has
    experts) keeps its router's, routed rows' and shared experts' tensors instead of the MLP's
    (experts.moe_mlp_activation_bytes: the n*b tokens every TP rank routes, E/ep experts per rank)."""
    s, b, h, a, t = seq_len, micro_batch, m.n_embd, m.n_head, tp
    n = s / cp  # this CP rank's tokens (all of them at cp = 1)
    E, M = element_bytes, mask_bytes
    sp = t if sequence_parallel else 1
    if recompute:
        return E * n * b * h / sp
    rms = m.norm == "rmsnorm"
    # RMSNorm (model/transformer/norms.py) keeps its input as an fp32 copy, 4 bytes whatever E, and its
    # normalised output before the weight, E.
    norm_inputs = 2 * 4 if rms else 2 * E
    replicated = norm_inputs + 2 * E + 2 * M + (2 * E if rms else 0)
    d, kv, f = m.head_dim, m.n_kv_head, m.ffn_hidden_size
    queries_and_output = E * 2 * a * d / h
    # K and V, (b, heads, s, d) each after the exchange; at cp = 1 TP's count, kv*d/t per token.
    kv_per_rank = kv / t if cp == 1 else cp_kv_heads_per_rank(kv, t, cp)
    keys_and_values = 2 * E * kv_per_rank * d * s * b
    moe = is_moe_block(m, layer_index)
    mlp = 0 if moe else (4 if m.mlp == "swiglu" else 2) * E * f / h
    if selective:
        core = 0
    elif fused_attention:
        core = 4 * a / h  # the logsumexp, (b, a, s) fp32, kept for the fused backward
        if cp > 1:  # the core's own output (on the whole sequence, a/(t*cp) heads) is no longer
            core += E * a * d / h  # the o_proj input: the return all-to-all made that a new tensor
    else:
        core = (2 * E + M) * a * s / h  # the scores of each local query row over all s keys
    stats = 2 * (1 if rms else 2) * layernorm_stat_bytes * n * b  # two norms per block
    rope = 2 * s * d * E if m.position == "rope" else 0
    routed = moe_mlp_activation_bytes(m, n * b, t, sp > 1, E, ep) if moe else 0
    return n * b * h * (replicated / sp + (queries_and_output + mlp) / t + core / t) + keys_and_values \
        + stats / sp + rope + routed


def cp_kv_heads_per_rank(n_kv_head: int, tp: int, cp: int) -> int:
    """Key/value heads one rank attends with after the Ulysses exchange: its
    n_head/(t*cp) query heads use n_kv_head/(t*cp) of them when that divides, else the one their
    group shares (replicated over the t*cp/n_kv_head ranks that use it; launch/analysis/planner.py
    checks that one of the two divides)."""
    return max(n_kv_head // (tp * cp), 1)


def weight_grad_stash_bytes_per_layer(m: ModelConfig, seq_len: int, micro_batch: int, tp: int = 1,
                                      sequence_parallel: bool = False, element_bytes: int = ACTIVATION_BYTES,
                                      layer_index: Optional[int] = None) -> float:
    """What ZB-H1 keeps of one block per micro-batch from its B pass to its W pass
    (model/parallel/weight_grad.py): each deferred linear's input and output gradient, per TP rank.
    Per token, with d the head size, f the MLP width and h_in = h/t under sequence parallelism
    (each rank keeps its sequence chunk of a column-parallel input), else h:
      inputs:  attention input h_in, MLP input h_in, o_proj input a*d/t, down-projection input f/t;
      output gradients: q, k, v (a*d + 2*kv*d)/t, o_proj h (the row-parallel output gradient is
               whole on every rank), the first MLP projection(s) f/t (two with SwiGLU), down h.
    When tp > n_kv_head the fused q/k/v weight is built from its gathered key/value rows, not the
    parameter itself: its gradient is computed at once (model/transformer/llama.py).
    An MoE block stashes its router's, experts' and shared experts' instead of the MLP's
    (experts.moe_weight_grad_stash_bytes)."""
    s, b, h, a, t = seq_len, micro_batch, m.n_embd, m.n_head, tp
    d, kv, f = m.head_dim, m.n_kv_head, m.ffn_hidden_size
    h_in = h / t if sequence_parallel else h
    qkv_input, qkv_grads = h_in, (a * d + 2 * kv * d) / t
    if t > kv:
        qkv_input, qkv_grads = 0, 0
    if is_moe_block(m, layer_index):
        attention = qkv_input + a * d / t + qkv_grads + h
        return element_bytes * s * b * attention + moe_weight_grad_stash_bytes(m, s * b, t, sequence_parallel,
                                                                               element_bytes)
    inputs = qkv_input + h_in + a * d / t + f / t
    grads = qkv_grads + h + (2 if m.mlp == "swiglu" else 1) * f / t + h
    return element_bytes * s * b * (inputs + grads)


def head_weight_grad_stash_bytes(m: ModelConfig, seq_len: int, micro_batch: int, tp: int = 1,
                                 element_bytes: int = ACTIVATION_BYTES) -> float:
    """ZB-H1's stash of the output layer per micro-batch, on the last stage: its (b, s, h) input,
    whole on every rank (gathered under sequence parallelism), and the (b, s, V_pad/t) gradient
    of the logits, the largest tensor of the model."""
    vocab = padded_vocab_size(m.vocab_size, tp, m.vocab_pad_multiple) // tp
    return element_bytes * seq_len * micro_batch * (m.n_embd + vocab)


# ---------------------------------------------------------------- what a GPU run holds beyond the above

FP32 = 4


def logits_bytes(m: ModelConfig, seq_len: int, micro_batch: int, tp: int, element_bytes: int) -> int:
    """The last stage's (b, s, V_pad/t) logits in the compute dtype: the head's output, which the loss
    keeps from its forward to its backward and then overwrites with its own gradient
    (model/parallel/cross_entropy.py, consume_logits: no second buffer; model/gpt/pipe.py frees them
    after). One micro-batch's: the last stage runs each micro-batch's backward right after its forward."""
    vocab = padded_vocab_size(m.vocab_size, tp, m.vocab_pad_multiple) // tp
    return element_bytes * seq_len * micro_batch * vocab


def loss_temporary_bytes(m: ModelConfig, seq_len: int, micro_batch: int, tp: int) -> int:
    """What the chunked vocab-parallel loss allocates on top of the logits: one fp32 (chunk, V_pad/t)
    temporary at a time (the shifted exponentials in forward, the softmax in backward; chunk =
    CHUNK_BYTES / (4 V_pad/t) tokens, at most the micro-batch's), and per token the max, sum of
    exponentials and target logit (fp32), the local target (int64) and two masks (bool) it keeps."""
    from model.parallel.cross_entropy import CHUNK_BYTES  # imports torch: only when planning
    vocab = padded_vocab_size(m.vocab_size, tp, m.vocab_pad_multiple) // tp
    tokens = seq_len * micro_batch
    chunk = min(tokens, max(1, CHUNK_BYTES // (FP32 * vocab)))
    return FP32 * chunk * vocab + tokens * (3 * FP32 + 8 + 2)


# Per process, outside torch's allocator statistics (not measured here: no GPU in the tests; stated
# so that a device's usable memory can be computed, launch/analysis/device_profile.py):
CUDA_CONTEXT_BYTES = 512 * 2 ** 20  # the CUDA context and its loaded kernels: ~0.3-0.6 GiB under
#                                     CUDA_MODULE_LOADING=LAZY (CUDA 11.7+), more without; an estimate
CUBLAS_WORKSPACE_BYTES = 2 * 32 * 2 ** 20  # cuBLAS docs (cublasSetWorkspace): 32 MiB recommended on
#                                            Hopper (4 MiB before); torch keeps one per handle and
#                                            stream, and a cuBLASLt one of the same size
NCCL_BUFFSIZE = 4 * 2 ** 20  # NCCL docs, environment variables: NCCL_BUFFSIZE default 4 MiB
NCCL_CHANNELS = 32  # NCCL's upper bound on channels (NCCL_MAX_NCHANNELS); fewer on most topologies


def process_fixed_bytes(communicators: int) -> int:
    """Memory one GPU process holds whatever the model: the CUDA context, cuBLAS's workspaces and,
    per NCCL communicator (one per process group a rank belongs to), a send and a receive buffer of
    NCCL_BUFFSIZE per channel. An upper estimate from the documented defaults, not a measurement."""
    return CUDA_CONTEXT_BYTES + CUBLAS_WORKSPACE_BYTES + communicators * 2 * NCCL_BUFFSIZE * NCCL_CHANNELS
