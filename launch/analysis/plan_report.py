"""What launch/plan.py prints: the plan (or the search's ranking) of the model and layout that
plan_args.py resolves from its flags and recipe, as text or JSON, its warnings, and the device-grid /
1F1B chart."""
import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from launch.analysis import formulas
from launch.analysis.device_profile import DeviceProfile, Shape
from launch.analysis.memory_formulas import checkpoint_snapshot_bytes
from launch.analysis.plan_args import resolve
from launch.analysis.plan_setup import GIB, Hardware, Setup, check_precision
from launch.analysis.planner import (MODEL_ERROR, block_case, estimate_plan, gemm_shapes, pick_first, search,
                                     valid_candidates, why)
from model.config import ModelConfig
from launch.config.recipe import RECOMPUTE_MODES
from launch.errors import ConfigError


def _edge_layers(model: ModelConfig) -> str:
    """The non-block layers of the first and the last stage, from the model's layer table."""
    kinds = formulas.layer_kinds(model.resolved())
    names = {"embed": "wte", "wpe": "wpe", "ln_f": "ln_f", "head": "tied head", "lm_head": "lm_head"}
    first = [names[k] for k in kinds[:kinds.index("block")]]
    last = [names[k] for k in kinds[len(kinds) - kinds[::-1].index("block"):]]
    return f"{', '.join(first)} on the first stage; {', '.join(last)} on the last"


Measure = Callable[[Set[Shape], str, int, ModelConfig, Set[Tuple[int, int, int, int]]], DeviceProfile]


def warnings(plan: Dict[str, Any], model: ModelConfig, setup: Setup, hw: Hardware) -> List[str]:
    """Each problem with its fix."""
    out = []
    p, m, d, b, B = plan["pp"], plan["microbatches_per_pipeline"], plan["dp"], setup.micro_batch, setup.global_batch
    if p > 1 and m < 4 * p:
        fix = f"raise --global-batch to {4 * p * b * d}"
        smaller = [k for k in range(b - 1, 0, -1) if (B // d) % k == 0 and B // (d * k) >= 4 * p]
        if smaller:
            fix += f" or lower --micro-batch to {smaller[0]}"
        out.append(f"only {m} micro-batches per pipeline for {p} stages: the bubble is "
                   f"{plan['bubble_fraction']:.0%} of the step; aim for m >= 4*p = {4 * p}: {fix}")
    if not plan["groups_within_node"]["tp"]:
        out.append(f"TP groups of {setup.tp} span nodes of {hw.gpus_per_node} GPUs: 4 all-reduces per block "
                   f"per micro-batch cross the inter-node network; use a tp that divides {hw.gpus_per_node} "
                   f"and raise --pp instead")
    if setup.cp > 1 and not plan["groups_within_node"]["cp"]:
        out.append(f"CP groups of {setup.cp} (strided by tp {setup.tp}) span nodes of {hw.gpus_per_node} GPUs: "
                   f"8 all-to-alls per block per micro-batch cross the inter-node network; keep tp*cp <= "
                   f"{hw.gpus_per_node} and raise --pp instead")
    if setup.ep > 1 and not plan["groups_within_node"]["ep"]:
        out.append(f"EP groups of {setup.ep} (ranks tp {setup.tp} apart) span nodes of {hw.gpus_per_node} GPUs: the "
                   f"routed tokens' all-to-alls (3 forward, 2 backward per MoE block per micro-batch) cross the "
                   f"inter-node network; tp*ep <= {hw.gpus_per_node} keeps them in a node (--search weighs both)")
    kv = model.resolved().n_kv_head
    if setup.cp > 1 and setup.tp * setup.cp > kv:
        out.append(f"tp*cp = {setup.tp}*{setup.cp} = {setup.tp * setup.cp} exceeds the {kv} key/value heads: "
                   f"each is replicated over {setup.tp * setup.cp // kv} ranks, so the keys' and values' memory and "
                   f"all-to-all volume no longer fall with cp (the queries' do); a tp*cp <= {kv} splits them")
    mem = plan["memory_per_device_bytes"]
    if hw.memory_bytes is not None and mem > hw.memory_bytes:
        stronger = RECOMPUTE_MODES[RECOMPUTE_MODES.index(setup.recompute) + 1:]  # none < selective < full
        recompute = [{"recompute": mode} for mode in stronger]
        changes = recompute + ([{"zero": 1}] if setup.zero == 0 else [])
        if setup.zero == 0 and recompute:
            changes.append({"recompute": "full", "zero": 1})
        fixes = []
        for change in changes:
            alt = estimate_plan(model, dataclasses.replace(setup, **change), hw)["memory_per_device_bytes"]
            if alt > 0.99 * mem:  # selective recompute under fused attention saves a logsumexp: no fix
                continue
            flags = " ".join(f"--recompute {v}" if k == "recompute" else "--zero 1" for k, v in change.items())
            fixes.append(f"{flags} gives {alt / GIB:.1f} GiB")
        fixes.append("or raise --tp/--cp/--pp, lower --micro-batch (--search lists layouts that fit)")
        out.append(f"predicted {mem / GIB:.1f} GiB per device (stage {plan['memory_fullest_stage']}) exceeds "
                   f"--gpu-memory {hw.memory_bytes / GIB:g} GiB: " + "; ".join(fixes))
    return out


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,.0f}"


def _groups(groups: List[List[int]]) -> str:
    """'32 x 4 ranks: [0, 1, 2, 3], [4, 5, 6, 7], ..., [124, 125, 126, 127]', long lists cut."""
    short = lambda g: str(g) if len(g) <= 6 else f"[{g[0]}, {g[1]}, {g[2]}, ..., {g[-1]}]"  # noqa: E731
    shown = [short(g) for g in groups] if len(groups) <= 3 else [short(groups[0]), short(groups[1]), "...",
                                                                 short(groups[-1])]
    return f"{len(groups)} x {len(groups[0])} ranks: " + ", ".join(shown)


def _seconds(x: float) -> str:
    return f"{x:.3g} s" if x >= 1 else f"{x * 1e3:.3g} ms" if x >= 1e-3 else f"{x * 1e6:.3g} us"


def _stage_lines(plan: Dict[str, Any]) -> List[str]:
    """Each stage's blocks and predicted compute per micro-batch (the first and last 4 when there are more)."""
    p, flops, seconds = plan["pp"], plan["stage_flops_per_microbatch"], plan["stage_time_s"]
    shown = list(range(p)) if p <= 8 else [*range(4), None, *range(p - 4, p)]
    cut = plan["partition"] if isinstance(plan["partition"], str) else ", ".join(map(str, plan["partition"]))
    lines = [f"stages ({cut} partition), per micro-batch: FLOPs of the stage (all its TP ranks), seconds "
             f"with its communication"]
    for k in shown:
        lines.append("  ..." if k is None else
                     f"  stage {k}: {plan['blocks_per_stage'][k]} block{'s' * (plan['blocks_per_stage'][k] != 1)}"
                     + (" + head" if k == p - 1 else "") + f"  {flops[k]:.3e} FLOPs  {_seconds(seconds[k])}"
                     + f"  ({flops[k] / sum(flops):.0%} of the compute)")
    return lines


def _moe_lines(plan: Dict[str, Any], model: ModelConfig, where: Dict[str, str]) -> Dict[str, List[str]]:
    """The report's lines about the experts, by place: none for a dense model."""
    moe = model.resolved().moe
    if not moe.enabled:
        return {"model": [], "roles": [], "memory": []}
    e, E, k, n = plan["ep"], moe.num_experts, moe.experts_per_token, sum(plan["moe_blocks_per_stage"])
    mem = plan["memory_per_stage_bytes"][plan["memory_fullest_stage"]]
    shared = f", {moe.shared_experts} shared" if moe.shared_experts else ""
    return {"model": [f"Experts: {E} per MoE block ({n} of {model.n_layer} blocks), top-{k}, width "
                      f"{model.resolved().expert_ffn_hidden_size}{shared}: {_count(plan['params_active'])} parameters "
                      f"active per token; ep {e}: {E // e} expert{'s' * (E // e > 1)} per rank"],
            "roles": [f"{'EP':<5}{e:>5}  {f'the {E} experts of each MoE block':<44}"
                      f"{plan['comm_bytes_per_step']['ep'] / 1e9:.1f} GB all-to-all (counts, then b*s*k*h/cp routed "
                      f"rows out and back: 3 forward, 2 backward per MoE block per micro-batch), {where['ep']}",
                      f"{'':12}groups: {_groups(plan['groups']['ep'])}"],
            "memory": [f"  {'of which routed-expert states':<32}{mem['expert_states'] / GIB:7.1f} GiB   "
                       f"({E // e} of {E} per MoE block, 1/{plan['tp']} of each; ZeRO-1 over dp x cp / ep = "
                       f"{plan['dp'] * plan['cp'] // e})"]}


def report(plan: Dict[str, Any], model: ModelConfig, hw: Hardware, notes: List[str]) -> str:
    t, c, p, d = plan["tp"], plan["cp"], plan["pp"], plan["dp"]
    m, b = plan["microbatches_per_pipeline"], plan["micro_batch"]
    comm, where = plan["comm_bytes_per_step"], {k: "in node" if v else "across nodes"
                                                 for k, v in plan["groups_within_node"].items()}
    blocks = plan["blocks_per_stage"]
    v = plan["virtual_stages"]
    pp_split = f"the {model.n_layer} blocks into {p} stages" + (f" of {v} chunks" if v > 1 else "")
    k = plan["memory_fullest_stage"]
    mem = plan["memory_per_stage_bytes"][k]
    deferred = mem["weight_grad_stash_microbatches"]  # ZB-H1's, 0 under 1F1B
    time = plan["step_time_parts_s"]
    gib = lambda x: f"{x / GIB:7.1f} GiB"  # noqa: E731
    total_label = f"total (zero {plan['zero']}, recompute {plan['recompute']})"
    precision = plan["precision"]
    moe = _moe_lines(plan, model, where)
    gradients_label = ("gradients (fp32 + bf16 .grad)" if precision == "bf16" and plan["zero"] == 1
                       else f"gradients ({precision})")
    lines = [
        f"Model: {model.n_layer} layers, hidden {model.n_embd}, {model.n_head} heads, seq {model.seq_len}, "
        f"vocab {model.vocab_size} (padded {plan['padded_vocab']}): {_count(plan['params_total'])} parameters "
        + (f"(formula {_count(plan['params_formula'])})" if model.arch == "gpt2"
           else f"({model.arch}: GPT-2's closed form would say {_count(plan['params_formula'])})"),
        *moe["model"],
        f"Layout: {plan['gpus']} GPUs = tp {t} x cp {c} x pp {p} x dp {d}; {t * c * p} GPUs per replica, "
        f"{hw.gpus_per_node} per node",
        "",
        f"{'role':<5}{'size':>5}  {'splits':<44}communication per step per device",
        f"{'TP':<5}{t:>5}  {'each weight matrix of a block, the vocab':<44}"
        f"{comm['tp'] / 1e9:.1f} GB all-reduced ({6 if plan['recompute'] == 'full' else 4} x b*s*h per block "
        f"per micro-batch), {where['tp']}",
        f"{'':12}groups: {_groups(plan['groups']['tp'])}",
        f"{'CP':<5}{c:>5}  {'tokens of each sequence; attention: heads':<44}"
        f"{comm['cp'] / 1e9:.1f} GB all-to-all (8 per block per micro-batch, b*s*h/(tp*cp) each "
        f"with all heads), {where['cp']}",
        f"{'':12}groups: {_groups(plan['groups']['cp'])}",
        *moe["roles"],
        f"{'PP':<5}{p:>5}  {pp_split:<44}"
        f"{comm['pp'] / 1e9:.1f} GB each way per boundary (b*s*h per micro-batch"
        + (f" and chunk: v = {plan['virtual_stages']}, {plan['pp_messages_per_step']} = m (p v - 1) sends a step in "
           f"all" if plan["virtual_stages"] > 1 else "") + f"), {where['pp']}",
        f"{'':12}groups: {_groups(plan['groups']['pp'])}",
        f"{'DP':<5}{d:>5}  {f'the batch into {d} replicas':<44}"
        f"{comm['dp'] / 1e9:.1f} GB all-reduced (the local gradients, {plan['dp_allreduce_dtype']}"
        + (f", over dp x cp = {d * c} ranks" if c > 1 else "")
        + (f"; the experts' over dp x cp / ep = {d * c // plan['ep']}" if moe["roles"] else "") + f"), {where['data']}",
        f"{'':12}groups: {_groups(plan['groups']['dp'])}",
        "",
        f"dp = {plan['gpus']} / (tp {t} * " + (f"cp {c} * " if c > 1 else "") + f"pp {p}) = {d}",
        f"layers per stage: {plan['layers_per_stage']} blocks"
        + ("" if len(set(blocks)) == 1 else f" at most ({blocks})")
        + (f" (+ {_edge_layers(model)})" if p > 1 else ""),
        f"micro-batches per pipeline: m = {plan['global_batch']} / (micro {b} * dp {d}) = {m} "
        f"= gradient accumulation steps",
        _bubble_line(plan),
        *_stage_lines(plan),
        f"parameters per device: {_count(plan['params_per_device'])} "
        f"(stages: {', '.join(_count(x) for x in plan['params_per_stage'][:8])}{', ...' if p > 8 else ''})",
        "",
        f"memory per device, stage {k} (the fullest):",
        f"  {f'weights ({precision})':<32}{gib(mem['weights'])}",
        f"  {gradients_label:<32}{gib(mem['gradients'])}",
        f"  {'optimizer (fp32 master, Adam)':<32}{gib(mem['optimizer'])}"
        + ("   (ZeRO-0: one data rank, nothing to split)" if plan['zero'] == 0 and d * c == 1 else
           f"   with ZeRO-1 over dp {d * c}: {gib(mem['optimizer_zero1'])}" if plan['zero'] == 0 else
           f"   (ZeRO-1: split over dp {d}" + (f" x cp {c}" if c > 1 else "") + ")"),
        *([f"  {'DeepSpeed ZeRO-1 reduce bucket':<32}{gib(mem['buffers'])}   (zero_optimization.reduce_bucket_size "
           f"elements, during backward)"] if mem["buffers"] else []),
        f"  {'activations (recompute ' + plan['recompute'] + ')':<32}{gib(mem['activations'])}   none "
        f"{gib(mem['activations_no_recompute']).strip()}, selective {gib(mem['activations_selective']).strip()}, "
        f"full {gib(mem['activations_recompute']).strip()}",
        *([f"  {'ZB-H1 weight-gradient stash':<32}{gib(mem['weight_grad_stash'])}   (up to {deferred} "
           f"micro-batch{'es' * (deferred > 1)} of linear inputs and output gradients)"] if deferred else []),
        f"  {total_label:<32}{gib(plan['memory_per_device_bytes'])}"
        + (f" of {hw.memory_bytes / GIB:g} GiB" if hw.memory_bytes else ""),
        *moe["memory"],
        f"  {'host, with train.async_save':<32}"
        f"{gib(checkpoint_snapshot_bytes(max(plan['params_per_stage']), d, plan['zero'], 4 if precision == 'fp32' else 2))}"
        f"   (one checkpoint snapshot: the fullest stage's weights and its share of the optimizer state)",
        "",
        f"model FLOPs per step: {plan['model_flops_per_step']:.3e} "
        f"(executed with full recompute: {plan['model_flops_per_step_recompute']:.3e})",
        f"estimated step: {time['step']:.2f} s (compute {time['compute']:.2f}, bubble {time['bubble']:.2f}, "
        f"tp {time['tp']:.2f}, cp {time['cp']:.2f}, " + (f"ep {time['ep']:.2f}, " if moe["roles"] else "")
        + f"pp {time['pp']:.2f}, dp {time['dp']:.2f}" + (f", latency {time['latency']:.2f}" if time["latency"] else "")
        + f"), MFU {plan['mfu_estimate']:.0%}; "
        + cost_model(hw),
    ]
    lines += [f"note: {n}" for n in hw.notes]
    lines += [""] + [f"warning: {w}" for w in notes] if notes else []
    return "\n".join(lines)


def _bubble_line(plan: Dict[str, Any]) -> str:
    """The equal-stages formula of the plan's schedule, and the simulated idle share."""
    p, m, v = plan["pp"], plan["microbatches_per_pipeline"], plan["virtual_stages"]
    if v > 1:
        return (f"interleaved 1F1B bubble, v = {v} chunks per rank: (p-1)/(v m+p-1) = {p - 1}/{v * m + p - 1} = "
                f"{plan['bubble_fraction_equal_stages']:.4f} of the step with equal stages ((p-1)/(v m) of the "
                f"ideal); Megatron's order simulated with the stages below: {plan['bubble_fraction']:.4f}")
    return (f"1F1B bubble: (p-1)/(m+p-1) = {p - 1}/{m + p - 1} = {plan['bubble_fraction_equal_stages']:.4f} of the "
            f"step with equal stages; {plan['schedule']} simulated with the stages below: {plan['bubble_fraction']:.4f}")


def cost_model(hw: Hardware) -> str:
    """Where the predicted times come from: a calibration (device, shapes) or the datasheet."""
    profile = hw.device_profile()
    bandwidth = f", memory {profile.memory_bw / 1e9:.0f} GB/s" if profile.memory_bw else ""
    if profile.link_bw:
        bandwidth += f", links {profile.link_bw / 1e9:.2g} GB/s and {profile.link_latency_s * 1e3:.2g} ms a call"
    if profile.source == "calibrated":
        return f"cost model: calibrated on {profile.device} ({len(profile.gemm)} GEMM shapes{bandwidth})"
    shape = "at most, on the roofline" if profile.roofline else "at every shape"
    return f"cost model: datasheet, {hw.efficiency:.0%} of {hw.peak_flops / 1e12:.0f} TFLOP/s {shape}{bandwidth}"


def links(hw: Hardware) -> str:
    """The link bandwidths the communication parts used: measured, or the GPU's datasheet."""
    if hw.device_profile().link_bw:
        return "measured links in node"
    return f"{hw.intra_node_bw / 1e9:.0f} GB/s in node, {hw.inter_node_bw / 1e9:.0f} GB/s across"


def short(plan: Dict[str, Any]) -> str:
    return (f"tp {plan['tp']} cp {plan['cp']} pp {plan['pp']} ep {plan['ep']} micro-batch {plan['micro_batch']} "
            f"recompute {plan['recompute']}" + (f" {plan['schedule']}" if plan["pp"] > 1 else "")
            + (f" v {plan['virtual_stages']}" if plan.get("virtual_stages", 1) > 1 else "")
            + f" ({plan['step_time_s']:.4g} s)")


def ties_line(pick: Dict[str, Any], ties: List[Dict[str, Any]], tolerance: float = MODEL_ERROR) -> str:
    """One line: the candidates predicted within the model's measured error of the fastest, which
    the pick (the conventional one among them) could not be told apart from; '' when none."""
    axes = lambda plan: tuple(plan[k] for k in ("tp", "cp", "pp", "ep"))  # noqa: E731
    others = {}
    for plan in ties:  # the fastest of each other (tp, cp, pp, ep) the model could not separate
        if axes(plan) != axes(pick):
            others.setdefault(axes(plan), plan)
    if not ties:
        return ""
    shown = list(others.values())
    listed = (", ".join(short(plan) for plan in shown[:3]) + (f" and {len(shown) - 3} more" if len(shown) > 3 else "")
              if shown else "only its own micro-batch and recompute variants")
    return (f"near-tie: {len(ties) + 1} candidates ({len(shown) + 1} parallel layouts) are predicted within "
            f"{tolerance:.0%} of the fastest, the cost model's measured median error; the pick is the conventional "
            f"one (TP in a node, fewest parallel axes): {short(pick)}; not separated from {listed}")


def search_report(plans: List[Dict[str, Any]], valid: int, top: int, setup: Setup, hw: Hardware,
                  ties: Optional[List[Dict[str, Any]]] = None) -> str:
    budget = f"{hw.memory_bytes / GIB:g} GiB" if hw.memory_bytes else "none"
    moe = any(sum(r["moe_blocks_per_stage"]) for r in plans[:1])  # an ep column for a model with experts
    ep_column = lambda r: f"{r['ep']:>3} " if moe else ""  # noqa: E731
    lines = [f"{len(plans)} of {valid} valid layouts fit for {setup.gpus} GPUs, global batch {setup.global_batch}, "
             f"{setup.precision}, zero {setup.zero}, recompute {setup.recompute}, memory budget {budget}; "
             f"{cost_model(hw)}; {links(hw)}",
             f"{'#':>3} {'tp':>3} {'cp':>3} {'pp':>3} {'v':>2} {'dp':>4} {ep_column({'ep': 'ep'})}{'micro':>5} {'m':>4} "
             f"{'bubble':>7} {'GiB':>6} {'step s':>8} {'MFU':>4}  why (share of step time)"]
    for i, r in enumerate(plans[:top], 1):
        lines.append(f"{i:>3} {r['tp']:>3} {r['cp']:>3} {r['pp']:>3} {r['virtual_stages']:>2} {r['dp']:>4} "
                     f"{ep_column(r)}{r['micro_batch']:>5} "
                     f"{r['microbatches_per_pipeline']:>4} {r['bubble_fraction']:>7.1%} "
                     f"{r['memory_per_device_bytes'] / GIB:>6.1f} {r['step_time_s']:>8.2f} "
                     f"{r['mfu_estimate']:>4.0%}  {why(r)}")
    tie = ties_line(plans[0], ties or []) if plans else ""
    return "\n".join(lines + [f"note: {n}" for n in hw.notes] + ([tie] if tie else []))


def plot(path: Path, plan: Dict[str, Any]) -> None:
    """Device grid + the schedule simulated with each stage's forward, backward and W times."""
    from launch.analysis.pipeline_chart import draw_plan  # matplotlib: only when drawing
    from launch.analysis.schedule_sim import simulate_schedule
    m, p, weight = plan["microbatches_per_pipeline"], plan["pp"], plan["stage_weight_grad_s"]
    v = plan["virtual_stages"]
    if v > 1:  # Megatron's interleaved order, each pass one chunk's (labelled chunk:micro-batch)
        from launch.analysis.interleaved_schedule import simulate_interleaved
        chunks = simulate_interleaved(p, v, m, [f / v for f in plan["stage_forward_s"]],
                                      [b / v for b in plan["stage_backward_s"]])
        events = [(rank, kind, f"{chunk}:{mb}", start, end) for rank, kind, chunk, mb, start, end in chunks]
        name, formula = f"interleaved 1F1B, v={v}", f"(p-1)/(v m+p-1) = {plan['bubble_fraction_equal_stages']:.1%}"
    else:
        events = simulate_schedule(plan["schedule"], p, m, plan["stage_forward_s"],
                                   [b - w for b, w in zip(plan["stage_backward_s"], weight)], weight)
        name = {"1f1b": "1F1B", "zb-h1": "ZB-H1"}[plan["schedule"]]
        formula = f"(p-1)/(m+p-1) = {plan['bubble_fraction_equal_stages']:.1%}"
    # The grid's columns are DeepSpeed's data axis, dp x cp ranks (CP fastest): its rank numbers.
    draw_plan(str(path), plan["tp"], p, plan["dp"] * plan["cp"], events,
              f"{name}, p={p}, m={m} (tp {plan['tp']}, cp {plan['cp']}, dp {plan['dp']}, micro {plan['micro_batch']}, blocks per stage "
              f"{plan['blocks_per_stage']}): simulated bubble {plan['bubble_fraction']:.1%} ({formula})")


def plan_output(args: argparse.Namespace, measure: Optional[Measure] = None,
                this_device: Optional[Callable] = None) -> Tuple[str, Dict[str, Any]]:
    """(the text or JSON to print, the plan to draw) for launch/plan.py's arguments; `measure`
    (launch/autotune/calibrate.py: calibrated_profile, for --calibrate) makes this machine's profile
    from the GEMM shapes the plan needs, the dtype and the processes of a node; `this_device`
    (launch/autotune/step_prediction.py: this_device_hardware) resolves `--gpu this`."""
    model, setup, hw = resolve(args, this_device)
    check_precision(setup)  # before --search, which skips the layouts that fail their checks
    if measure is not None:
        planned = list(valid_candidates(model, setup)) if args.search else [setup]
        shapes = {shape for candidate in planned for shape in gemm_shapes(model, candidate).values()}
        hw = dataclasses.replace(hw, profile=measure(shapes, setup.precision, min(setup.gpus, hw.gpus_per_node),
                                                     model, {block_case(model, c) for c in planned}))
    if args.search:
        valid = search(model, setup, hw)
        plans = [plan for plan in valid if plan["fits"]]
        if not valid:
            raise ConfigError(f"no valid (tp, cp, pp, micro-batch) for {setup.gpus} GPUs, global batch "
                              f"{setup.global_batch}, {model.n_head} heads and {model.n_layer} layers; "
                              f"choose a --global-batch divisible by more dp sizes, or other --gpus")
        if not plans:
            raise ConfigError(f"none of the {len(valid)} valid layouts for {setup.gpus} GPUs and global batch "
                              f"{setup.global_batch} fits {hw.memory_bytes / GIB:g} GiB per device; "
                              f"try --recompute selective or full, --zero 1, more --gpus or a larger --gpu-memory")
        plans, ties = pick_first(plans)
        chosen, output = plans[0], search_report(plans, len(valid), args.top, setup, hw, ties)
        if args.json:
            output = json.dumps({"search": plans[:args.top], "valid_layouts": len(valid),
                                 "fitting_layouts": len(plans), "not_separated": len(ties),
                                 "memory_budget_bytes": hw.memory_bytes, "device_notes": list(hw.notes)})
    else:
        chosen = estimate_plan(model, setup, hw)
        notes = warnings(chosen, model, setup, hw)
        output = (json.dumps(dict(chosen, warnings=notes, model=dataclasses.asdict(model.resolved())))
                  if args.json else report(chosen, model, hw, notes))
    return output, chosen
