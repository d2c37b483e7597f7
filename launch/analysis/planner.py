"""Evaluate one 3D layout (every number launch/plan.py prints) and rank layouts by a stated cost
model. The formulas live in launch/analysis/formulas.py and memory_formulas.py; the layout rules
are launch/config/layout.py's, checked on a candidate (`Setup`, `Hardware`) in plan_setup.py.

Cost model of one optimizer step (`estimate_step_time`), per device: each stage's time per
micro-batch (its FLOPs at the device profile's GEMM rate for the rank's shapes, or the weight and
gradient traffic at its memory bandwidth when that is slower, launch/analysis/device_profile.py;
plus the profile's engine cost per micro-batch, fixed and per parameter tensor of the rank; its TP all-reduces and one activation and
one gradient over the PP link, at the intra-node bandwidth when the group sits in one node), the
schedule (1F1B or ZB-H1) simulated over the engine's own instruction streams with those times
(interleaved 1F1B at v > 1: Megatron's order with v equal chunk passes per slot, v times the PP
transfers, launch/analysis/interleaved_schedule.py), then the DP gradient all-reduce, not overlapped. Context parallelism (cp) splits every
micro-batch's tokens over cp ranks: each rank computes 1/(tp*cp) of a stage's FLOPs, its TP and
PP traffic is its s/cp tokens', its attention adds the Ulysses all-to-alls, and the gradient
all-reduce runs over DeepSpeed's data axis, dp x cp ranks. Expert parallelism (ep) splits
each MoE block's experts over ep ranks of that axis: a rank computes the same share of the FLOPs
(its experts receive, on average, as many rows as it routes), adds the all-to-alls that carry the
rows to their experts and back, and reduces its experts' gradients over the dp x cp / ep ranks that
hold the same experts. Each collective pays the profile's latency, an MoE block its host sync,
and the experts' GEMMs the busiest expert's load. After the all-reduce the optimizer updates the
rank's ZeRO-1 share (Muon adds its Newton-Schulz and gathers), and the engine's cost per step
(fixed, and per parameter tensor of the fullest stage) is added. A calibration on one machine's processes replaces each block's and the head's
modelled compute (and their TP and EP collectives) by their measured times. Overlap is ignored
(docs/planner-and-metrics.md, "--search and the cost model")."""
import dataclasses
from typing import Any, Dict, Iterator, List, Optional, Tuple

from launch.analysis import engine_memory, experts, formulas, interleaved_schedule
from launch.analysis import partition as partition_rules
from launch.analysis.context_parallel import cp_bytes_per_step
from launch.analysis.device_profile import Shape, bytes_per_weight
from launch.analysis.parameter_tensors import parameter_tensors_per_stage
from launch.analysis.plan_setup import GIB, Hardware, Setup, check_setup, rank_groups, within_node
from launch.analysis.stage_memory import stage_groups, stage_memory
from launch.errors import ConfigError
from model.config import ModelConfig


def gemm_shapes(model: ModelConfig, setup: Setup) -> Dict[str, Shape]:
    """The GEMM that stands for each kind of a rank's compute, (rows, inner, columns): "dense" the
    MLP's up projection (b s/cp rows, h, f/tp), which every other matrix of the block shares its
    rows with; "expert", with experts, one routed expert's (its average rows: the ep ranks' b s/cp
    tokens x k routed over E experts, h, f_e/tp)."""
    arch = model.resolved()
    rows = setup.micro_batch * model.seq_len // setup.cp
    shapes = {"dense": (rows, arch.n_embd, max(1, arch.ffn_hidden_size // setup.tp))}
    if arch.moe.enabled:
        routed = setup.ep * rows * arch.moe.experts_per_token / arch.moe.num_experts
        shapes["expert"] = (max(1, round(routed)), arch.n_embd, max(1, arch.expert_ffn_hidden_size // setup.tp))
    return shapes


def block_case(model: ModelConfig, setup: Setup) -> Tuple[int, int, int, int]:
    """(tp, ep, micro-batch, tokens of a sequence on the rank): what a measured block's time
    depends on (launch/autotune/calibrate_blocks.py)."""
    return setup.tp, setup.ep, setup.micro_batch, model.seq_len // setup.cp


def optimizer_seconds(profile, params: int) -> float:
    """The optimizer's update of `params` weights (a rank's ZeRO-1 share): measured per parameter,
    else AdamW's traffic at the memory bandwidth, else nothing."""
    from launch.analysis.device_profile import OPTIMIZER_BYTES_PER_PARAM
    if profile.optimizer_s_per_param is not None:
        return params * profile.optimizer_s_per_param
    return params * OPTIMIZER_BYTES_PER_PARAM / profile.memory_bw if profile.memory_bw else 0.0


def expert_flops_per_block(model: ModelConfig, micro_batch: int, full_recompute: bool) -> int:
    """Forward and backward FLOPs of one MoE block's routed experts for one micro-batch, all ranks:
    2 per weight per routed row, k rows a token, 3x (4x with full recompute) the forward."""
    arch = model.resolved()
    forward = 2 * micro_batch * model.seq_len * arch.moe.experts_per_token * experts.expert_params(arch)
    return (4 if full_recompute else 3) * forward


def estimate_step_time(model: ModelConfig, setup: Setup, hw: Hardware, blocks: List[int],
                       flops: List[Tuple[int, int]], weight_flops: List[int], dp: int, m: int,
                       dp_bytes: int, bandwidth: Dict[str, float], moe_blocks: Optional[List[int]] = None,
                       expert_dp_bytes: int = 0, params: Optional[List[int]] = None,
                       stage_blocks: Optional[List[List[int]]] = None, tensors: Optional[List[int]] = None
                       ) -> Tuple[Dict[str, float], Dict[str, List[float]]]:
    """(seconds per step and its parts, per-stage forward, backward and weight-gradient seconds of
    one micro-batch) by the cost model of the module docstring; `flops`: each stage's (forward,
    backward) FLOPs, `weight_flops` the weight-gradient part of the backward, `dp_bytes` what the
    fullest stage's rank hands to the DP gradient all-reduce; `moe_blocks` each stage's MoE blocks,
    `expert_dp_bytes` what it hands to its experts' gradient all-reduce (dp x cp / ep ranks);
    `params` each stage's parameters per rank (the bandwidth floor; None: no floor); `stage_blocks`
    each stage's block indices (Muon's Newton-Schulz and gathers); `tensors` each stage's parameter
    tensors per rank (the engine's per-tensor costs; None: none charged)."""
    from launch.analysis.schedule_sim import idle_fraction, simulate_schedule
    b, s, h, t, p, c = setup.micro_batch, model.seq_len // setup.cp, model.n_embd, setup.tp, setup.pp, setup.cp
    v = setup.virtual_stages
    tp_bytes_per_block = formulas.tp_allreduce_bytes_per_step(b, s, h, 1, 1, setup.full_recompute) * formulas.ring_allreduce_factor(t)
    # Interleaved, each of a rank's v chunks receives and sends an activation and a gradient per
    # micro-batch: v times 1F1B's point-to-point traffic (Narayanan et al. 2021, sec. 2.2.2).
    pp_comm = 2 * v * formulas.pp_p2p_bytes_per_step(b, s, h, 1) / bandwidth["pp"] if p > 1 else 0.0
    # An all-to-all keeps 1/cp of what each rank hands it and sends the rest.
    cp_bytes_per_block = cp_bytes_per_step(model, setup.tp, c, b, setup.precision, setup.recompute, 1, 1) * (c - 1) / c
    moe_blocks = moe_blocks or [0] * p
    arch = model.resolved()
    # An MoE block's shared experts add a dense MLP's two all-reduces (three with full recompute): half the block's.
    shared_tp_bytes = tp_bytes_per_block / 2 if arch.moe.enabled and arch.moe.shared_experts else 0.0
    # The busiest EP rank's all-to-all bytes (its load x the mean rows) and experts' rows; none at ep 1.
    load = experts.busiest_rank_load(setup.expert_load, setup.ep)
    ep_bytes_per_block = experts.ep_busiest_rank_bytes_per_block(arch, setup.ep, c, b, engine_memory.ELEMENT_BYTES[
        setup.precision], setup.recompute, setup.expert_load)
    profile, shapes = hw.device_profile(), gemm_shapes(model, setup)
    rate = {kind: profile.gemm_rate(*shape) for kind, shape in shapes.items()}
    routed = [n * expert_flops_per_block(model, b, setup.full_recompute) for n in moe_blocks]
    # A block's experts finish with the busiest rank's: its share of the rows is load x the mean.
    gemm = [((forward + backward - e) / rate["dense"] + (e * load / rate["expert"] if e else 0.0)) / (t * c)
            for (forward, backward), e in zip(flops, routed)]
    # Every micro-batch reads each of the rank's weights and adds into its gradient: at least
    # that traffic's time at the memory bandwidth (a small micro-batch is bound by it).
    weight_bytes = bytes_per_weight(engine_memory.ELEMENT_BYTES[setup.precision], setup.full_recompute)
    floor = [n * weight_bytes / profile.memory_bw if params and profile.memory_bw else 0.0
             for n in (params or [0] * p)]
    # The engine's own work per micro-batch: fixed, and per parameter tensor (ZeRO's gradient hooks).
    engine = [profile.per_microbatch_s + (profile.per_tensor_microbatch_s or 0.0) * n for n in (tensors or [0] * p)]
    compute = [max(g, f) + engine[k] for k, (g, f) in enumerate(zip(gemm, floor))]
    tp_comm = [(n * tp_bytes_per_block + n_moe * shared_tp_bytes) / bandwidth["tp"]
               for n, n_moe in zip(blocks, moe_blocks)]
    cp_comm = [n * cp_bytes_per_block / bandwidth["cp"] for n in blocks]
    ep_comm = [n * ep_bytes_per_block / bandwidth["ep"] for n in moe_blocks]
    # The pieces measured as this layout runs them (calibrated on one machine's processes): their
    # time holds the TP and EP collectives, so those are not added again.
    measured = profile.block_seconds(model, *block_case(model, setup))
    if measured is not None:
        again = 1 if setup.full_recompute else 0  # full recompute reruns each block's forward
        piece = {kind: measured[kind] + again * measured[kind + ".forward"] for kind in ("dense", "moe") if kind in measured}
        # Measured with random routing (about balanced): the busiest expert's extra rows added.
        imbalance = [(load - 1.0) * e / rate["expert"] / (t * c) if e else 0.0 for e in routed]
        compute = [(n - n_moe) * piece.get("dense", 0.0) + n_moe * piece.get("moe", 0.0) + imbalance[k]
                   + (measured["head"] if k == p - 1 else 0.0) + engine[k]
                   for k, (n, n_moe) in enumerate(zip(blocks, moe_blocks))]
        floor = [0.0] * p
        tp_comm, ep_comm = [0.0] * p, [0.0] * p
    # Each collective's latency (measured links; 0 on a datasheet): a block's TP all-reduces, CP
    # all-to-alls (4 forward, 4 backward), an MoE block's EP all-to-alls, the two PP transfers.
    calls = [(n * (6 if setup.full_recompute else 4) if t > 1 and measured is None else 0) + (n * 8 if c > 1 else 0)
             + (n_moe * (8 if setup.full_recompute else 5) if setup.ep > 1 and measured is None else 0)
             + (2 * v if p > 1 else 0)
             for n, n_moe in zip(blocks, moe_blocks)]
    # An MoE block waits once on the host for its split sizes (model/transformer/moe.py), again
    # when full recompute reruns its forward; a measured block holds its own.
    syncs = [0 if measured is not None else n_moe * (2 if setup.full_recompute else 1) for n_moe in moe_blocks]
    latency = [n * profile.link_latency_s + k * profile.host_sync_s for n, k in zip(calls, syncs)]
    slot = [compute[k] + tp_comm[k] + cp_comm[k] + ep_comm[k] + pp_comm + latency[k] for k in range(p)]
    forward = [slot[k] * flops[k][0] / sum(flops[k]) for k in range(p)]
    weight = [slot[k] * weight_flops[k] / sum(flops[k]) for k in range(p)]
    stages = {"forward_s": forward, "backward_s": [slot[k] - forward[k] for k in range(p)], "weight_s": weight,
              "slot_s": slot, "memory_bound": [f > g for g, f in zip(gemm, floor)],
              "measured_blocks": measured is not None}
    if v > 1:
        # Megatron's interleaved order played with each chunk a 1/v share of its rank's slot (the
        # chunks of a rank are equal: the search proposes v only where pp x v divides the layers).
        chunk_events = interleaved_schedule.simulate_interleaved(
            p, v, m, [f / v for f in forward], [(slot[k] - forward[k]) / v for k in range(p)])
        span = max(e[5] for e in chunk_events)
        stages["bubble_fraction"] = interleaved_schedule.idle_fraction(chunk_events)
    else:
        events = simulate_schedule(setup.schedule, p, m, forward, [stages["backward_s"][k] - weight[k] for k in range(p)],
                                   weight)
        span = max(e[4] for e in events)
        stages["bubble_fraction"] = idle_fraction(events) if p > 1 else 0.0
    slowest = max(range(p), key=lambda k: slot[k])
    dp_comm = formulas.ring_allreduce_factor(setup.data_axis) * dp_bytes / bandwidth["data"]
    dp_comm += formulas.ring_allreduce_factor(setup.expert_data_axis) * expert_dp_bytes / bandwidth["expert_data"]
    # The slowest stage works m slots; the rest of the simulated span it waits: the bubble.
    # The optimizer updates each rank's ZeRO-1 share (its whole stage without ZeRO) after the
    # reduction; the fullest stage's rank is the last to finish.
    shards = setup.data_axis if setup.zero >= 1 else 1
    update = optimizer_seconds(profile, max(params or [0]) // shards)
    if setup.optimizer == "muon" and stage_blocks is not None:  # Newton-Schulz on every matrix, and its gathers
        from launch.analysis.muon_cost import muon_stage_cost
        cost = max((muon_stage_cost(arch, blocks_k, t, setup.data_axis, setup.ep, setup.zero) for blocks_k in stage_blocks),
                   key=lambda x: x.newton_schulz_flops)
        update += cost.newton_schulz_flops / rate["dense"] + cost.gather_bytes / bandwidth["data"]
    parts = {"compute": m * compute[slowest], "tp": m * tp_comm[slowest], "cp": m * cp_comm[slowest],
             "ep": m * ep_comm[slowest], "pp": m * pp_comm, "latency": m * latency[slowest],
             "bubble": max(span - m * slot[slowest], 0.0), "dp": dp_comm, "optimizer": update,
             "per_step": profile.per_step_s + (profile.per_tensor_step_s or 0.0) * max(tensors or [0])}
    return dict(parts, step=sum(parts.values())), stages


def estimate_plan(model: ModelConfig, setup: Setup, hw: Hardware) -> Dict[str, Any]:
    """Every number of one layout; raises ConfigError when the layout is invalid."""
    layout = check_setup(model, setup)
    # The stage the run builds: ZeRO-0 for a dense fp32 model on one data rank, whatever --zero says.
    setup = dataclasses.replace(setup, zero=engine_memory.built_zero_stage(
        setup.zero, setup.precision, setup.data_axis, model.moe.enabled))
    arch = model.resolved()  # every architecture switch set (GQA, SwiGLU, untied head, RoPE change the counts)
    l, h, s, V = model.n_layer, model.n_embd, model.seq_len, model.vocab_size
    t, p, d, m, b, c, e = setup.tp, setup.pp, layout.dp, layout.grad_accum_steps, setup.micro_batch, setup.cp, setup.ep
    v = setup.virtual_stages
    # Cut as the run cuts (partition.with_stage_boundaries): only full recompute changes the FLOPs.
    parts = partition_rules.stage_partition(arch, p, setup.partition, s, setup.full_recompute)
    blocks = partition_rules.blocks_per_stage(arch, parts)
    stage_flops = partition_rules.stage_flops(arch, parts, b, s, setup.full_recompute)
    params = [formulas.model_stage_params_per_rank(arch, t, p, k, parts, e) for k in range(p)]
    tensors = parameter_tensors_per_stage(arch, parts)
    groups_of = [stage_groups(arch, t, p, k, parts, e) for k in range(p)]
    indices = [experts.stage_block_indices(arch, parts, k) for k in range(p)]
    moe_blocks = [len(experts.moe_block_indices(arch, i)) for i in indices]
    # Each rank's routed experts: their ZeRO-1 group and gradient all-reduce span dp x cp / ep ranks.
    expert_params = [experts.stage_expert_params_per_rank(arch, t, e, parts, k) for k in range(p)]
    # ZeRO-1 and the gradient all-reduce span DeepSpeed's data axis: dp x cp ranks.
    memory = [stage_memory(model, setup, d * c, m, k, indices[k], groups_of[k], expert_params[k]) for k in range(p)]
    reduced = lambda ranks, matrices, vectors: engine_memory.dp_allreduce_bytes(  # noqa: E731
        setup.precision, setup.zero, ranks, matrices, vectors, setup.communication_data_type)
    dense_dp = [reduced(d * c, g[0] - x, g[1]) for g, x in zip(groups_of, expert_params)]
    expert_dp = [reduced(d * c // e, x, 0) if x else 0 for x in expert_params]
    dp_stage = max(range(p), key=lambda k: dense_dp[k] + expert_dp[k])
    dp_bytes, expert_dp_bytes = dense_dp[dp_stage], expert_dp[dp_stage]
    fullest = max(range(p), key=lambda k: memory[k]["total"])
    groups = rank_groups(t, p, d, c, e)
    intra = {dim: within_node(groups[dim], hw.gpus_per_node) for dim in groups}
    # Measured links (one machine's processes) win, at each group's size where the calibration
    # measured it: all-to-alls for CP and EP, point-to-point for PP, all-reduces for the rest.
    profile = hw.device_profile()

    def measured_bw(dim: str) -> Optional[float]:
        if dim == "pp":
            return profile.p2p_bw or profile.link_bw
        return profile.collective_bw("all_to_all" if dim in ("cp", "ep") else "all_reduce", len(groups[dim][0]))
    bandwidth = {dim: (measured_bw(dim) or hw.intra_node_bw) if intra[dim] else hw.inter_node_bw for dim in groups}
    weight_flops = partition_rules.stage_weight_grad_flops(arch, parts, b, s)
    time, stages = estimate_step_time(model, setup, hw, blocks, stage_flops, weight_flops, d, m, dp_bytes, bandwidth,
                                      moe_blocks, expert_dp_bytes, params, indices, tensors)
    flops = formulas.model_flops_per_step_of(arch, setup.global_batch, s)
    element = engine_memory.ELEMENT_BYTES[setup.precision]
    return {
        "gpus": setup.gpus, "tp": t, "cp": c, "pp": p, "dp": d, "ep": e, "micro_batch": b,
        "global_batch": setup.global_batch,
        "zero": setup.zero, "recompute": setup.recompute, "precision": setup.precision, "optimizer": setup.optimizer,
        "padded_vocab": formulas.padded_vocab_size(V, t, model.vocab_pad_multiple),
        # The closed form [N21] is GPT-2's: for another architecture it is a reference point only.
        "params_total": formulas.model_params(arch), "params_formula": formulas.params_formula(l, h, V, s),
        # Per token: each MoE block's router, k routed experts and shared experts (the FLOPs' weights).
        "params_active": formulas.model_params_active(arch),
        "moe_blocks_per_stage": moe_blocks, "expert_params_per_stage": expert_params,
        "partition": setup.partition if isinstance(setup.partition, str) else list(setup.partition),
        "stage_parts": parts, "blocks_per_stage": blocks, "parameter_tensors_per_stage": tensors, "layers_per_stage": max(blocks),
        "stage_flops_per_microbatch": [forward + backward for forward, backward in stage_flops],
        "schedule": setup.schedule, "virtual_stages": v,
        "stage_forward_s": stages["forward_s"], "stage_backward_s": stages["backward_s"],
        "stage_weight_grad_s": stages["weight_s"],
        "stage_time_s": stages["slot_s"],
        "microbatches_per_pipeline": m, "grad_accum_steps": m,
        # The idle share of the simulated schedule; for 1F1B (p-1)/(m+p-1) only when the stages are
        # equal, interleaved (p-1)/(v m + p-1).
        "bubble_fraction": stages["bubble_fraction"],
        "bubble_fraction_equal_stages": formulas.interleaved_bubble_fraction(p, m, v),
        "params_per_stage": params, "params_per_device": max(params),
        "memory_per_stage_bytes": memory, "memory_fullest_stage": fullest,
        "memory_per_device_bytes": memory[fullest]["total"],
        "model_flops_per_step": flops,
        "model_flops_per_step_recompute": formulas.model_flops_per_step_of(arch, setup.global_batch, s, True),
        "comm_bytes_per_step": {  # this rank's s/cp tokens under context parallelism
            "tp": (formulas.tp_allreduce_bytes_per_step(b, s // c, h, max(blocks), m, setup.full_recompute)
                   + formulas.kv_gather_bytes_per_step(arch, t, max(blocks), m, setup.full_recompute)) if t > 1 else 0,
            "cp": cp_bytes_per_step(model, t, c, b, setup.precision, setup.recompute, max(blocks), m),
            "ep": experts.ep_bytes_per_step(arch, e, c, b, m, max(moe_blocks), element, setup.recompute),
            "pp": v * formulas.pp_p2p_bytes_per_step(b, s // c, h, m) if p > 1 else 0,  # rank 0: v chunks send
            "dp": (dp_bytes if d * c > 1 else 0) + (expert_dp_bytes if d * c // e > 1 else 0)},
        # Activation sends per step over the whole pipeline (as many gradients back): m (p v - 1).
        "pp_messages_per_step": interleaved_schedule.p2p_messages_per_step(p, v, m) if p > 1 else 0,
        "dp_allreduce_dtype": setup.communication_data_type or engine_memory.reduce_dtype(setup.precision),
        "groups": groups, "groups_within_node": intra,
        "step_time_s": time["step"], "step_time_parts_s": time,
        "memory_bound_stages": [k for k, bound in enumerate(stages["memory_bound"]) if bound],
        "gemm_shapes": gemm_shapes(model, setup), "cost_model": hw.device_profile().source,
        "measured_blocks": stages["measured_blocks"],
        "mfu_estimate": formulas.mfu(flops, time["step"], hw.peak_flops, setup.gpus),
    }


def divisors(n: int) -> List[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


VIRTUAL_STAGES = (1, 2, 4)
"""The chunks per pipeline rank --search and --layout auto try (interleaved 1F1B)."""


def virtual_stage_choices(n_layer: int, pp: int, microbatches: int, choices: Tuple[int, ...]) -> List[int]:
    """Of `choices`, the v whose pp x v chunks divide the layers equally and whose interleaved order
    exists (m a multiple of pp); v = 1 alone without pipeline stages."""
    if pp == 1:
        return [1]
    return [v for v in choices if v == 1 or (n_layer % (pp * v) == 0 and microbatches % pp == 0)]


def candidates(model: ModelConfig, setup: Setup, recomputes: Optional[List[str]] = None,
               schedules: Optional[List[str]] = None, virtual_stages: Optional[Tuple[int, ...]] = None
               ) -> Iterator[Setup]:
    """Every (tp, cp, pp, dp, micro-batch) for setup's GPUs and global batch, and for a model with
    experts every ep among the divisors of dp x cp that divide E, the rest of `setup`
    kept; with `recomputes`, `schedules` and `virtual_stages`, each of them too (a schedule only at
    pp > 1, where it differs; a v only where virtual_stage_choices allows it, else setup's at
    pp > 1, 1 at pp = 1); not yet checked against the layout rules (check_virtual_stages's refusals
    among them)."""
    experts_count = model.resolved().moe.num_experts
    gpus, global_batch = setup.gpus, setup.global_batch
    for tp in divisors(gpus):
        for cp in divisors(gpus // tp):
            for pp in divisors(gpus // (tp * cp)):
                dp = gpus // (tp * cp * pp)
                if global_batch % dp != 0:
                    continue
                eps = [ep for ep in divisors(dp * cp) if experts_count % ep == 0] if experts_count else [1]
                for b in divisors(global_batch // dp):
                    for ep in eps:
                        for recompute in recomputes or [setup.recompute]:
                            for schedule in (schedules or [setup.schedule]) if pp > 1 else [setup.schedule]:
                                m = global_batch // (dp * b)
                                vs = (virtual_stage_choices(model.n_layer, pp, m, virtual_stages)
                                      if virtual_stages else [setup.virtual_stages if pp > 1 else 1])
                                for v in vs:
                                    yield dataclasses.replace(setup, tp=tp, cp=cp, pp=pp, ep=ep, micro_batch=b,
                                                              recompute=recompute, schedule=schedule,
                                                              virtual_stages=v)


def valid_candidates(model: ModelConfig, setup: Setup) -> Iterator[Setup]:
    """`candidates` that pass the layout rules (heads and layers divisible, ...): those a
    calibration can build."""
    for candidate in candidates(model, setup):
        try:
            check_setup(model, candidate)
        except ConfigError:
            continue
        yield candidate


def search(model: ModelConfig, setup: Setup, hw: Hardware) -> List[Dict[str, Any]]:
    """Every valid candidate (`candidates`, v among VIRTUAL_STAGES), fastest first; `fits` says
    whether it fits hw.memory_bytes."""
    found = []
    for candidate in candidates(model, setup, virtual_stages=VIRTUAL_STAGES):
        try:
            plan = estimate_plan(model, candidate, hw)
        except ConfigError:  # heads not divisible by tp*cp, fewer layers than stages, ...
            continue
        plan["fits"] = hw.memory_bytes is None or plan["memory_per_device_bytes"] <= hw.memory_bytes
        found.append(plan)
    found.sort(key=ranking_key)
    return found


RECOMPUTE_COST_ORDER = {"none": 0, "selective": 1, "full": 2}


def ranking_key(plan: Dict[str, Any]) -> Tuple:
    """Fastest first. Equal times (micro-batch sizes tie when the profile is flat and nothing else
    changes; selective recompute's attention core is not in the FLOPs): fewer, larger micro-batches
    first, as each one costs the engine a dispatch the model may not see, then less recomputation,
    then less memory."""
    return (plan["step_time_s"], -plan["micro_batch"], RECOMPUTE_COST_ORDER[plan["recompute"]],
            plan["memory_per_device_bytes"])


MODEL_ERROR = 0.20
"""The cost model's median relative error against measured step times (docs/planner-and-metrics.md,
"--search and the cost model": 20% over the sweep's 15 layouts). Predictions closer than this
cannot be told apart."""


def parallel_axes(plan: Dict[str, Any]) -> int:
    """How many of tp, cp, pp and ep the layout uses (data parallelism alone: 0)."""
    return sum(plan[axis] > 1 for axis in ("tp", "cp", "pp", "ep"))


def conventional_key(plan: Dict[str, Any]) -> Tuple:
    """The layout practice starts from: TP inside a node, then fewer parallel axes, then no
    interleaving (v = 1: fewer, larger point-to-point messages and a shallower warm-up)."""
    return (not plan["groups_within_node"]["tp"], parallel_axes(plan), plan.get("virtual_stages", 1) > 1)


def pick_first(plans: List[Dict[str, Any]], tolerance: float = MODEL_ERROR
               ) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """(`plans` fastest first by `ranking_key`, except that the pick leads: among those predicted
    within `tolerance` of the fastest, the most conventional (`conventional_key`), then the fastest
    of those; the others within `tolerance`, fastest first: what the model cannot separate from it).
    launch/plan.py --search and --layout auto both order by this."""
    ranked = sorted(plans, key=ranking_key)
    if not ranked:
        return ranked, []
    near = [plan for plan in ranked if plan["step_time_s"] <= ranked[0]["step_time_s"] * (1 + tolerance)]
    pick = min(near, key=lambda plan: (conventional_key(plan), ranking_key(plan)))
    return [pick] + [plan for plan in ranked if plan is not pick], [plan for plan in near if plan is not pick]


def why(plan: Dict[str, Any]) -> str:
    """The step-time shares besides compute, largest first, and the memory: why it ranks there."""
    parts = plan["step_time_parts_s"]
    shares = sorted(((parts[k] / parts["step"], k) for k in ("bubble", "latency", "optimizer", "tp", "cp", "ep", "pp", "dp")
                     if parts[k] >= 0.005 * parts["step"]),
                    reverse=True)
    where = {k: "in node" if plan["groups_within_node"][g] else "across nodes"
             for k, g in (("tp", "tp"), ("cp", "cp"), ("ep", "ep"), ("pp", "pp"), ("dp", "data"))}
    text = [f"{k} {share:.0%}" + ("" if k in ("bubble", "latency", "optimizer") else f" {where[k]}") for share, k in shares]
    if plan.get("memory_bound_stages"):
        text.append("weights' traffic bounds compute")
    text.append(f"{plan['memory_per_device_bytes'] / GIB:.0f} GiB")
    return ", ".join(text) if shares else "no bubble or communication, " + text[-1]
