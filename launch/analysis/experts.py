"""Mixture of experts in the planner: what an MoE block (model/transformer/moe.py) holds, computes,
keeps for backward and sends, for launch/analysis/formulas.py, memory_formulas.py, comm_formulas.py
and planner.py.

An MoE block (block i with model.moe.is_moe_block(i)) replaces the dense MLP by
  router          W_r (E, h), replicated over TP;
  routed experts  E SwiGLU MLPs of width f_e: gate_up (E, 2 f_e, h) and down (E, h, f_e), each split
                  over TP as a dense SwiGLU MLP, the E experts split over the ep ranks of an EP group;
  shared experts  one SwiGLU MLP of width s * f_e that every token passes through, split over TP as
                  the dense one.
Total parameters count all E experts, active ones (per token) the k a token is routed to: both
include the router and the shared experts. Every token reaches exactly k experts (dropless), so
the FLOPs per token are 2 per active matrix weight, whichever ranks hold the experts.
Symbols: E experts, k experts per token, f_e an expert's width, s shared experts, h hidden,
t tp, ep the expert-parallel degree, N = b * seq / cp the tokens one rank routes per micro-batch
(under TP every TP rank of a replica routes all of them, its shards of every expert).

No torch here: only the model's config.
"""
from typing import Dict, List, Optional, Sequence, Tuple

from model.config import ModelConfig
from model.gpt.layer_table import pipeline_layers

Key = Tuple[str, str, str]  # (purpose, role, op), as in launch/instruments/comm_counter.py
Volume = Tuple[int, int, int]  # (calls, elements, bytes)

EP_ALL_TO_ALL = "all_to_all_single"  # model/parallel/mappings.py: exchange_counts, all_to_all_to_experts and _from_experts
COUNT_BYTES = 8  # the counts exchanged before the rows are int64 (model/transformer/moe_losses.py: count_assignments)
INDEX_BYTES = 8  # int64 indices (the routing's sorts and gathers) kept for backward
FP32 = 4


# ---------------------------------------------------------------- parameters

def is_moe_block(m: ModelConfig, layer_index: Optional[int]) -> bool:
    """Block `layer_index` is an MoE block; None: a model's typical block, MoE when it has experts."""
    return m.moe.enabled and (layer_index is None or m.moe.is_moe_block(layer_index))


def moe_block_indices(m: ModelConfig, blocks: Optional[Sequence[int]] = None) -> List[int]:
    """The MoE blocks among `blocks` (default: all n_layer)."""
    return [i for i in (range(m.n_layer) if blocks is None else blocks) if is_moe_block(m, i)]


def attention_matmul_params(m: ModelConfig) -> int:
    """q and o (h x a*d each), k and v (h x kv*d each)."""
    return m.n_embd * (2 * m.n_head + 2 * m.n_kv_head) * m.head_dim


def dense_mlp_params(m: ModelConfig, width: Optional[int] = None) -> int:
    """A dense MLP's matrices: up and down (h x f each), plus gate with SwiGLU."""
    return (3 if m.mlp == "swiglu" else 2) * m.n_embd * (m.ffn_hidden_size if width is None else width)


def router_params(m: ModelConfig) -> int:
    return m.moe.num_experts * m.n_embd


def expert_params(m: ModelConfig) -> int:
    """One routed expert: gate, up (f_e x h each) and down (h x f_e)."""
    return 3 * m.n_embd * m.expert_ffn_hidden_size


def shared_expert_params(m: ModelConfig) -> int:
    """The shared experts' one SwiGLU MLP of width s * f_e (0 without shared experts)."""
    return dense_mlp_params(m, m.moe.shared_experts * m.expert_ffn_hidden_size) if m.moe.shared_experts else 0


def mlp_matmul_params(m: ModelConfig, layer_index: Optional[int] = None, active: bool = False) -> int:
    """The matrix weights of block `layer_index`'s MLP: the dense MLP, or in an MoE block the router,
    the routed experts (all E; `active`: the k a token uses) and the shared experts."""
    if not is_moe_block(m, layer_index):
        return dense_mlp_params(m)
    experts = m.moe.experts_per_token if active else m.moe.num_experts
    return router_params(m) + experts * expert_params(m) + shared_expert_params(m)


def mlp_params_per_rank(m: ModelConfig, layer_index: Optional[int], tp: int, ep: int = 1) -> Tuple[int, int, int]:
    """(split over TP, replicated, expert) matrix weights of block `layer_index`'s MLP on one rank:
    the dense MLP or the shared experts (split over t), the router (replicated) and this rank's
    E/ep experts, each 1/t of its MLP (3 h f_e / t; the layout needs f_e % t == 0)."""
    if not is_moe_block(m, layer_index):
        return dense_mlp_params(m), 0, 0
    local = m.moe.num_experts // ep * 3 * m.n_embd * (m.expert_ffn_hidden_size // tp)
    return shared_expert_params(m), router_params(m), local


def stage_block_indices(m: ModelConfig, parts: Sequence[int], stage: int) -> List[int]:
    """The block indices stage `stage` holds in the cut `parts` (model/gpt/layer_table.py's order)."""
    return [i for kind, i in pipeline_layers(m)[parts[stage]:parts[stage + 1]] if kind == "block"]


def stage_expert_params_per_rank(m: ModelConfig, tp: int, ep: int, parts: Sequence[int], stage: int) -> int:
    """Routed-expert weights one rank of `stage` holds: (E/ep) x 3 h f_e / t per MoE block. ZeRO-1
    partitions their optimizer state over the expert-data-parallel group (dp x cp / ep ranks)."""
    return sum(mlp_params_per_rank(m, i, tp, ep)[2] for i in moe_block_indices(m, stage_block_indices(m, parts, stage)))


# ---------------------------------------------------------------- activations

def moe_mlp_activation_bytes(m: ModelConfig, tokens: float, tp: int, sequence_parallel: bool,
                             element_bytes: int, ep: int = 1) -> float:
    """What an MoE block's MLP keeps for backward on one rank per micro-batch (model/transformer/moe.py), for
    `tokens` = b * seq / cp tokens routed per rank (every TP rank routes all of them: these terms do
    not fall under sequence parallelism; the router's do, it runs on the rank's chunk). Per token:
      routed rows   in the activation dtype: the k rows each token sends into its experts' gate_up
                    (k h), the SwiGLU's gate and up, silu(gate) and product (4 k f_e / t), the k
                    expert outputs the combine weighs (k h) and the combine weights (k); with
                    ep > 1 an EP rank's experts take the rows it receives, N*k on average (balanced
                    routing: the mean over the EP group);
      indices       int64: the sort by expert and its inverse (2 k; 2 k more after the exchange at
                    ep > 1), and the router's sort of all E logits (E: the chosen k are a view of it);
      router        fp32: the softmax probabilities (E); with the router losses (aux or z coefficient
                    > 0) the logits' copy the logsumexp keeps (E) and its output (1); the chosen
                    probabilities and their sum when renormalised (k + 1); topk_softmax instead the
                    logits' copy its gather keeps and its softmax over the k (E + k; with fp32
                    logits, an fp32 run's or router_dtype fp32's, the first is the logsumexp's, no
                    copy, and in an fp32 run the second is the combine's);
      shared experts  their SwiGLU's four tensors of width s f_e / t, as a dense MLP's;
    and per block the losses' E shares and their 2E + 2 totals (fp32). The MLP's input is the
    block's, counted with the norm outputs (memory_formulas). tests/analysis/test_moe_plan.py holds this to
    what autograd saves for an MoE block (tp = ep = 1)."""
    moe = m.moe
    h, t, k, E = m.n_embd, tp, moe.experts_per_token, moe.num_experts
    f, shared = m.expert_ffn_hidden_size, moe.shared_experts * m.expert_ffn_hidden_size
    losses = moe.aux_loss_coef > 0 or moe.z_loss_coef > 0
    routed = element_bytes * (2 * k * h + 4 * k * f / t + k) + INDEX_BYTES * (k * (4 if ep > 1 else 2) + E)
    if moe.router == "topk_softmax":  # fp32: .float() and .to() copy nothing, the storages are shared
        fp32_logits = element_bytes == FP32 or moe.router_dtype == "fp32"
        chosen = (0 if losses and fp32_logits else E) + (0 if element_bytes == FP32 else k)
    else:
        chosen = k + 1 if moe.norm_topk_prob else 0
    router = FP32 * (E + (E + 1 if losses else 0) + chosen)
    sp = t if sequence_parallel else 1
    per_block = FP32 * (3 * E + 2) if losses else 0
    return tokens * (routed + router / sp + element_bytes * 4 * shared / t) + per_block


def moe_weight_grad_stash_bytes(m: ModelConfig, tokens: float, tp: int, sequence_parallel: bool,
                                element_bytes: int) -> float:
    """ZB-H1's stash of an MoE block's MLP per micro-batch (the linears' inputs and output gradients
    from the B pass to the W pass, model/parallel/weight_grad.py): the router's input (this rank's chunk
    under SP) and logits' gradient (E, fp32 with router_dtype fp32); per routed row the gate_up input
    h and output gradient 2 f_e / t, the down input f_e / t and output gradient h; the shared experts
    as a dense MLP."""
    h, t, k, E = m.n_embd, tp, m.moe.experts_per_token, m.moe.num_experts
    f, shared = m.expert_ffn_hidden_size, m.moe.shared_experts * m.expert_ffn_hidden_size
    h_in = h / t if sequence_parallel else h
    routed = k * (h + 2 * f / t + f / t + h)
    shared_mlp = (h_in + shared / t + 2 * shared / t + h) if shared else 0
    logits_grad = FP32 if m.moe.router_dtype == "fp32" else element_bytes
    return element_bytes * tokens * (h_in + routed + shared_mlp) + logits_grad * tokens * E


# ---------------------------------------------------------------- expert-parallel all-to-alls

def ep_all_to_all_elements(m: ModelConfig, cp: int, micro_batch: int) -> Tuple[int, int]:
    """(counts, rows): the elements one rank hands to the count exchange (its E int64 counts, one
    row of E/ep per EP rank) and to each row all-to-all (its N*k routed rows of h, N = b*seq/cp
    tokens) of one MoE block per micro-batch."""
    tokens = micro_batch * (m.seq_len // cp)
    return m.moe.num_experts, tokens * m.moe.experts_per_token * m.n_embd


def ep_comm_by_pass(m: ModelConfig, ep: int, cp: int, micro_batch: int, microbatches: int, moe_blocks: int,
                    element_bytes: int, recompute: str = "none") -> Dict[Tuple[str, str], Volume]:
    """{(pass, purpose): (calls, elements, bytes)} of one rank's expert-parallel all-to-alls in one
    step, pass "forward" or "backward". Per MoE block per micro-batch, forward: the counts
    (`ep-counts`, E int64), the rows to the experts' ranks (`ep-dispatch`, N*k*h) and the experts'
    outputs back (`ep-combine`, N*k*h); backward: the combine's and the dispatch's gradients
    (N*k*h each, no counts). Full recompute runs the forward's three again; nothing at ep = 1.
    Rows in the activation dtype (`element_bytes`). Exact per rank for the counts, the forward
    dispatch and the backward combine (this rank's own N*k rows); the forward combine and the
    backward dispatch hand back the rows this rank received, N*k on the mean over its EP group
    (their sum over the group is exact; per rank it follows the routing)."""
    if ep == 1 or not moe_blocks:
        return {}
    counts, rows = ep_all_to_all_elements(m, cp, micro_batch)
    per_pass = microbatches * moe_blocks
    forwards = per_pass * (2 if recompute == "full" else 1)
    out = {("forward", "ep-counts"): (forwards, forwards * counts, forwards * counts * COUNT_BYTES)}
    for purpose in ("ep-dispatch", "ep-combine"):
        out[("forward", purpose)] = (forwards, forwards * rows, forwards * rows * element_bytes)
        out[("backward", purpose)] = (per_pass, per_pass * rows, per_pass * rows * element_bytes)
    return out


def ep_comm_per_rank_per_step(m: ModelConfig, ep: int, cp: int, micro_batch: int, microbatches: int,
                              moe_blocks: int, element_bytes: int, recompute: str = "none") -> Dict[Key, Volume]:
    """`ep_comm_by_pass` summed over the passes, under the keys --comm-counts records them with:
    (purpose, "ep", "all_to_all_single")."""
    out: Dict[Key, Volume] = {}
    for (_, purpose), volume in ep_comm_by_pass(m, ep, cp, micro_batch, microbatches, moe_blocks, element_bytes,
                                                recompute).items():
        key = (purpose, "ep", EP_ALL_TO_ALL)
        out[key] = tuple(a + b for a, b in zip(out.get(key, (0, 0, 0)), volume))
    return out


def ep_bytes_per_step(m: ModelConfig, ep: int, cp: int, micro_batch: int, microbatches: int, moe_blocks: int,
                      element_bytes: int, recompute: str = "none") -> int:
    """Bytes one rank hands to the expert-parallel all-to-alls per step."""
    return sum(nbytes for _, _, nbytes in ep_comm_per_rank_per_step(m, ep, cp, micro_batch, microbatches,
                                                                    moe_blocks, element_bytes, recompute).values())


# ---------------------------------------------------------------- imbalance across the EP ranks

def busiest_rank_load(expert_load: float, ep: int) -> float:
    """The busiest EP rank's routed rows over the mean rank's: `expert_load` (the max over the mean
    of the tokens each expert-parallel rank receives) at ep > 1, and 1 at
    ep = 1: a rank holding every expert computes and receives all N*k rows whatever the routing,
    so nothing straggles there."""
    return expert_load if ep > 1 else 1.0


def ep_busiest_rank_bytes_per_block(m: ModelConfig, ep: int, cp: int, micro_batch: int, element_bytes: int,
                                    recompute: str = "none", expert_load: float = 1.0) -> float:
    """Bytes the busiest EP rank moves off itself in one MoE block's all-to-alls per micro-batch (the
    time of an all-to-all is its busiest rank's): the counts (E int64) as ep_comm_by_pass has them,
    and every row exchange at load x the mean rank's N*k rows (the dispatch and the backward
    combine deliver its load x N*k rows to it, the forward combine and the backward dispatch hand
    them back); 1/ep of them stay on the rank. Nothing at ep = 1."""
    if ep == 1:
        return 0.0
    load = busiest_rank_load(expert_load, ep)
    counts = rows = 0
    for (_, purpose), (_, _, nbytes) in ep_comm_by_pass(m, ep, cp, micro_batch, 1, 1, element_bytes, recompute).items():
        if purpose == "ep-counts":
            counts += nbytes
        else:
            rows += nbytes
    return (counts + load * rows) * (ep - 1) / ep
