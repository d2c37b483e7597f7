"""The bytes one rank of a pipeline stage holds at its peak, as the planner counts them
(launch/analysis/planner.py: estimate_plan): the engine's model states for the ZeRO stage the run
builds (engine_memory.py), the activations of the micro-batches alive at the peak per recompute
mode, ZB-H1's stash of weight-gradient inputs, the last stage's logits and the loss's chunk, and
the optimizer step's temporaries (AdamW's foreach buffers, Muon's step buffers), which replace the
activations at the step; checked against a real engine's tensors in
tests/analysis/test_plan_engine.py and torch's allocations in tests/analysis/test_gpu_memory_terms.py."""
import dataclasses
from typing import Dict, List, Optional, Tuple

from launch.analysis import engine_memory, experts, formulas, memory_formulas
from launch.analysis.plan_setup import Setup
from model.config import ModelConfig


def stage_groups(model: ModelConfig, tp: int, pp: int, stage: int, parts: List[int], ep: int = 1) -> Tuple[int, int]:
    """(matrices, vectors) one rank of `stage` holds: the optimizer's two parameter groups
    (weight-decayed matrices and embeddings; biases and norms), each flattened apart by ZeRO-1.
    The matrices include this rank's E/ep experts per MoE block (experts.stage_expert_params_per_rank)."""
    from launch.analysis.comm_formulas import stage_vector_params_per_rank  # imports the model: only when planning
    params = formulas.model_stage_params_per_rank(model, tp, pp, stage, parts, ep)
    vectors = stage_vector_params_per_rank(model, tp, pp, stage, parts)
    return params - vectors, vectors


def params_with_bf16_grad(model: ModelConfig, setup: Setup, stage: int, blocks: int, vectors: int) -> Optional[int]:
    """The parameters of one rank of `stage` that still get a bf16 `.grad` under gradient-accumulation
    fusion (launch/optim/main_grad.py): the vectors (biases, norms), the learned positions, and
    Llama's fused q/k/v weight where TP ranks share key/value heads (the GEMM uses a weight built
    from the gathered heads, not the parameter). None: every parameter has one (no fusion)."""
    if not (setup.grad_accum_fusion and engine_memory.uses_bf16_optimizer(setup.precision, setup.zero)):
        return None
    from model.transformer.llama import kv_replicas  # imports the model: only when planning
    positions = model.seq_len * model.n_embd if model.position == "learned" and stage == 0 else 0
    shared_kv_heads = model.llama_layout and kv_replicas(model.n_kv_head, setup.tp) > 1
    qkv = (model.n_head + 2 * model.n_kv_head) * model.head_dim * model.n_embd // setup.tp if shared_kv_heads else 0
    return vectors + positions + blocks * qkv


def activation_bytes_per_block(model: ModelConfig, setup: Setup, recompute: str, layer_index: Optional[int] = None
                               ) -> float:
    """What one block keeps for backward on a GPU, per micro-batch and TP rank: elements in the
    run's precision, fused (flash) attention with no s x s scores, dropout masks (1 byte) only
    with dropout, the norms' fp32 statistics, sequence parallelism as the recipe sets it; an MoE
    block (block `layer_index`, None: MoE when the model has experts) its routed rows instead of the MLP's."""
    return memory_formulas.model_activation_bytes_per_layer(
        model, model.seq_len, setup.micro_batch, setup.tp, recompute=recompute == "full",
        sequence_parallel=model.sequence_parallel and setup.tp > 1, selective=recompute == "selective",
        element_bytes=engine_memory.ELEMENT_BYTES[setup.precision], mask_bytes=1 if model.dropout > 0 else 0,
        layernorm_stat_bytes=4, fused_attention=True, cp=setup.cp, layer_index=layer_index, ep=setup.ep)


def stage_memory(model: ModelConfig, setup: Setup, dp: int, m: int, stage: int, indices: List[int],
                  groups: Tuple[int, int], expert_params: int = 0) -> Dict[str, int]:
    """Bytes one rank of `stage` (blocks `indices`) holds at its peak. `groups`: its (matrices,
    vectors); `expert_params` of those matrices are its routed experts, whose ZeRO-1
    group is partitioned over the dp / ep ranks that hold the same experts, the rest over dp."""
    arch = model.resolved()
    blocks = len(indices)

    def states(zero: int) -> Tuple[Dict[str, int], Dict[str, int]]:
        """(the dense parameters' states, the experts')"""
        with_grad = params_with_bf16_grad(arch, dataclasses.replace(setup, zero=zero), stage, blocks, groups[1])
        dense = engine_memory.model_state_bytes_per_rank(
            setup.precision, zero, dp, groups[0] - expert_params, groups[1],
            reduce_bucket_elements=setup.reduce_bucket_elements, params_with_grad=with_grad)
        if not expert_params:
            return dense, {key: 0 for key in dense}
        # The experts' own flat group: no vectors, no second reduce bucket; fused into the fp32 buffer as matrices.
        routed = engine_memory.model_state_bytes_per_rank(
            setup.precision, zero, dp // setup.ep, expert_params, 0, reduce_bucket_elements=0,
            params_with_grad=None if with_grad is None else 0)
        return dense, routed

    dense_states, expert_states = states(setup.zero)
    chosen = {key: dense_states[key] + expert_states[key] for key in dense_states}
    inflight = memory_formulas.inflight_microbatches(setup.pp, m, stage)  # micro-batches alive at the peak
    if setup.virtual_stages > 1:
        # Interleaved 1F1B's deeper warm-up: rank r holds min(2 (p-r-1) + (v-1) p + 1, v m) chunks'
        # activations, each 1/v of the stage's (Narayanan et al. 2021, sec. 2.2.2).
        from launch.analysis.interleaved_schedule import activations_in_flight
        inflight = activations_in_flight(stage, setup.pp, setup.virtual_stages, m)
    b, s, t = setup.micro_batch, model.seq_len // setup.cp, setup.tp  # this rank's tokens
    element = engine_memory.ELEMENT_BYTES[setup.precision]
    moe_blocks = len(experts.moe_block_indices(arch, indices))
    kinds = [(blocks - moe_blocks, next((i for i in indices if not experts.is_moe_block(arch, i)), None)),
             (moe_blocks, next((i for i in indices if experts.is_moe_block(arch, i)), None))]
    # ZB-H1: each stage keeps some micro-batches' weight-gradient inputs between their B and W
    # passes (launch/analysis/zero_bubble_schedule.py), the last stage the output layer's too.
    from launch.analysis.zero_bubble_schedule import deferred_microbatches  # imports DeepSpeed
    from launch.config.layout import runs_zero_bubble
    stash, deferred = 0.0, 0
    if runs_zero_bubble(setup.schedule, setup.pp):
        deferred = deferred_microbatches(stage, m)
        stash = sum(n * memory_formulas.weight_grad_stash_bytes_per_layer(arch, s, b, t, element_bytes=element,
                                                                          layer_index=i) for n, i in kinds if n)
        stash += memory_formulas.head_weight_grad_stash_bytes(arch, s, b, t, element) if stage == setup.pp - 1 else 0
        stash *= deferred
    activations = {mode: sum(n * activation_bytes_per_block(arch, setup, mode, i) for n, i in kinds if n) * inflight
                   for mode in ("none", "selective", "full")}
    zero1 = states(1)
    out = {**chosen, "optimizer_zero1": zero1[0]["optimizer"] + zero1[1]["optimizer"],
           "expert_states": sum(expert_states.values()),
           **{f"expert_{key}": expert_states[key] for key in ("weights", "gradients", "optimizer")},
           "activations": activations[setup.recompute], "activations_no_recompute": activations["none"],
           "activations_selective": activations["selective"], "activations_recompute": activations["full"],
           "weight_grad_stash": stash, "weight_grad_stash_microbatches": deferred}
    # The last stage's logits and the loss's fp32 chunk: alive with that micro-batch's activations.
    last = stage == setup.pp - 1
    out["logits"] = memory_formulas.logits_bytes(arch, s, b, t, element) if last else 0
    out["loss_temporaries"] = memory_formulas.loss_temporary_bytes(arch, s, b, t) if last else 0
    forward_peak = out["activations"] + stash + out["logits"] + out["loss_temporaries"]
    # The optimizer step runs after the last backward, when activations are freed: its temporaries.
    out["optimizer_step_temporaries"] = engine_memory.adamw_step_temporary_bytes(
        setup.zero, [(groups[0] - expert_params, dp), (groups[1], dp), (expert_params, max(1, dp // setup.ep))])
    out["total"] = sum(chosen.values()) + max(forward_peak, out["optimizer_step_temporaries"])
    if setup.optimizer == "muon":  # one fp32 momentum where AdamW keeps two moments; its step's buffers
        from launch.analysis.muon_cost import muon_stage_cost
        muon = muon_stage_cost(arch, indices, setup.tp, dp, setup.ep, setup.zero)
        out["optimizer"] -= muon.momentum_bytes
        out["muon_step_buffers"] = muon.step_buffer_bytes  # held during the step, when activations are freed
        out["optimizer_step_temporaries"] = muon.step_buffer_bytes  # its AdamW group steps tensor by tensor
        out["total"] = sum(chosen.values()) - muon.momentum_bytes + max(forward_peak, muon.step_buffer_bytes)
    return {k: round(v) for k, v in out.items()}
