"""`--layout auto`: the planner chooses tp, pp, cp, ep, the micro-batch, recompute,
schedule and virtual stages for this job's processes, and the run trains its pick.

Rank 0 decides and the others read its decision (data/job_listing.py: once_per_job), so every
rank builds the same layout even if their machines would measure differently. The profile is
this machine's cached calibration, else a known GPU's datasheet; a CPU without a calibration is
calibrated first (rank 0 measures the candidates' GEMM shapes with as many processes as the node
runs, while the other ranks wait). Each candidate must pass the run's own layout rules
(launch/config/layout.py, CPU rules included) and fit the device's memory (a GPU's total less a
headroom, plan_setup.usable_memory_bytes; a CPU's is not checked). Axes given on the command line (--tp, --pp, --cp, --ep, and recompute, schedule
and virtual stages given with --set) are kept; otherwise recompute, schedule and train.virtual_stages
(1, 2 or 4 chunks per rank where they divide the layers; never one check_virtual_stages refuses)
are chosen too (with --auto-sweep each trial runs its candidate's). Precision and ZeRO
stay the recipe's. The candidates are ranked by predicted step time, equal times by fewer, larger
micro-batches, then less recomputation (launch/analysis/planner.py: ranking_key); among those
predicted within the model's measured error of the fastest, the conventional layout is picked
(planner.pick_first), as launch/plan.py --search --gpu this orders them. With --auto-sweep K the
K first are measured for a few steps each and the fastest measured is trained
(launch/autotune/auto_sweep.py)."""
import argparse
import dataclasses
import os
from typing import Any, Dict, List, Optional, Tuple

from launch.autotune.auto_sweep import describe, fastest_measured, run_trials
from launch.config.recipe import Recipe
from launch.errors import ConfigError

SHOWN = 5  # candidates printed with their predictions


@dataclasses.dataclass(frozen=True)
class AutoChoice:
    tp: int
    pp: int
    cp: int
    ep: int
    micro_batch: int
    predicted_step_time_s: float
    ranked: int
    """Valid candidates that fit, of which this is the first."""
    cost_model: str
    recompute: str = "none"
    schedule: str = "1f1b"
    virtual_stages: int = 1
    """train.virtual_stages: chunks per pipeline rank (interleaved 1F1B)."""
    measured_step_time_s: Optional[float] = None
    """--auto-sweep: this layout's trial (median step time after warm-up); None without a sweep."""
    swept: int = 0
    """--auto-sweep: the planner's first K candidates measured (0: none)."""

    def overrides(self) -> List[str]:
        return [f"train.cp={self.cp}", f"train.ep={self.ep}", f"train.micro_batch_size={self.micro_batch}",
                f"train.recompute={self.recompute}", f"train.schedule={self.schedule}",
                f"train.virtual_stages={self.virtual_stages}"]

    def line(self) -> str:
        which = (f"the fastest measured of the {self.swept} fastest predicted ({self.measured_step_time_s:.4g} s "
                 f"measured) of {self.ranked} valid layouts" if self.swept else
                 f"the fastest of {self.ranked} valid layouts")
        return (f"layout auto: tp {self.tp}, pp {self.pp}, cp {self.cp}, ep {self.ep}, micro-batch {self.micro_batch}, "
                f"recompute {self.recompute}, schedule {self.schedule}"
                + (f", virtual stages {self.virtual_stages}" if self.virtual_stages > 1 else "") + ": "
                f"predicted {self.predicted_step_time_s:.4g} s a step, {which} ({self.cost_model})")


FREE_SETTINGS = {"recompute": "train.recompute", "schedule": "train.schedule",
                 "virtual_stages": "train.virtual_stages"}
"""The recipe's settings the planner also chooses, unless given with --set on the command line."""


def _fixed_axes(args) -> Dict[str, Any]:
    """The axes given with --tp, --pp, --cp, --ep, and recompute and schedule given with --set."""
    fixed: Dict[str, Any] = {axis: getattr(args, axis) for axis in ("tp", "pp", "cp", "ep")
                             if getattr(args, axis) is not None}
    for setting, key in FREE_SETTINGS.items():
        given = [o.split("=", 1)[1] for o in args.overrides if o.split("=", 1)[0].strip() == key]
        if given:
            fixed[setting] = given[-1].strip()
    if "virtual_stages" in fixed:  # compared with the candidates' integers
        try:
            fixed["virtual_stages"] = int(fixed["virtual_stages"])
        except ValueError:
            raise ConfigError(f"--set train.virtual_stages={fixed['virtual_stages']}: not an integer") from None
    return fixed


def _hardware(recipe: Recipe, model, setup, local: int):
    """This machine's profile as Hardware: cached calibration, known GPU, or a calibration now
    (step_prediction.this_device_hardware, as launch/plan.py --gpu this takes it)."""
    from launch.analysis.planner import block_case, gemm_shapes, valid_candidates
    from launch.autotune.calibrate import calibrated_profile
    from launch.autotune.step_prediction import this_device_hardware
    hardware, _ = this_device_hardware(recipe.train.precision, local)
    if hardware is None:
        planned = list(valid_candidates(model, setup))
        cases = {block_case(model, c) for c in planned}
        shapes = {shape for c in planned for shape in gemm_shapes(model, c).values()}
        print(f"layout auto: measuring this machine in {recipe.train.precision} with {local} processes: "
              f"{len(shapes)} GEMM shapes, the model's pieces at {len(cases)} cases (cached)", flush=True)
        calibrated_profile(shapes, recipe.train.precision, local, model, cases)
        hardware, _ = this_device_hardware(recipe.train.precision, local)
    return hardware


def rank_layouts(recipe: Recipe, world: int, fixed: Dict[str, int], vocab_size: int, local: int,
                 on_cpu: bool) -> Tuple[List[Dict[str, Any]], str, List[str]]:
    """(every candidate that passes the run's rules and fits, in launch/plan.py --search's order
    (planner.pick_first); the cost model; the lines to print about the device and near-ties)."""
    from launch.analysis.plan_report import cost_model, ties_line
    from launch.analysis.planner import VIRTUAL_STAGES, candidates, estimate_plan, pick_first, ranking_key
    from launch.autotune.step_prediction import planner_inputs
    from launch.config.layout import check_and_derive_layout
    base = dataclasses.replace(recipe.train, cp=1, ep=1)
    model, setup = planner_inputs(dataclasses.replace(recipe, train=base), _one_rank_layout(world, recipe),
                                  vocab_size)
    setup = dataclasses.replace(setup, partition=recipe.train.partition if isinstance(recipe.train.partition, str)
                                else tuple(recipe.train.partition))
    hardware = _hardware(recipe, model, setup, local)
    from launch.config.recipe import RECOMPUTE_MODES, SCHEDULES
    ranked = []
    # v among VIRTUAL_STAGES; the run's refusals of v > 1 (check_virtual_stages: ZB-H1, compiled blocks, ...)
    # apply through check_and_derive_layout below, so a refused v is never a candidate.
    for candidate in candidates(model, setup, list(RECOMPUTE_MODES), list(SCHEDULES), VIRTUAL_STAGES):
        if any(getattr(candidate, axis) != value for axis, value in fixed.items()):
            continue
        trial = dataclasses.replace(recipe, train=dataclasses.replace(
            recipe.train, cp=candidate.cp, ep=candidate.ep, micro_batch_size=candidate.micro_batch,
            recompute=candidate.recompute, schedule=candidate.schedule, virtual_stages=candidate.virtual_stages))
        try:
            check_and_derive_layout(trial, world, candidate.tp, candidate.pp, on_cpu)
            plan = estimate_plan(model, candidate, hardware)
        except ConfigError:
            continue
        if hardware.memory_bytes is None or plan["memory_per_device_bytes"] <= hardware.memory_bytes:
            ranked.append(plan)
    ranked.sort(key=ranking_key)
    # More recomputation never makes the same layout faster; it only lets it fit. Each layout keeps
    # its first (fastest, least recomputing) variant that fits, so the top few are different layouts.
    seen, distinct = set(), []
    for plan in ranked:
        layout = tuple(plan[key] for key in ("tp", "pp", "cp", "ep", "micro_batch", "schedule", "virtual_stages"))
        if layout not in seen:
            seen.add(layout)
            distinct.append(plan)
    # launch/plan.py --search's order: within the model's error of the fastest, the conventional layout first.
    distinct, ties = pick_first(distinct)
    said = [f"note: {n}" for n in hardware.notes] + ([ties_line(distinct[0], ties)] if ties else [])
    return distinct, cost_model(hardware).removeprefix("cost model: "), said


def _one_rank_layout(world: int, recipe: Recipe):
    from launch.config.layout import Layout
    B = recipe.train.global_batch_size
    return Layout(world_size=world, tp=1, pp=1, dp=world, micro_batch_size=1, global_batch_size=B,
                  grad_accum_steps=max(1, B // world))


def choose(recipe: Recipe, world: int, fixed: Dict[str, int], vocab_size: int, local: int, on_cpu: bool,
           sweep: int = 0) -> dict:
    """Rank 0's decision as JSON: the choice and the top candidates (at least `sweep` of them, with
    a rendezvous port for each trial), or the refusal's line."""
    try:
        ranked, model_used, said = rank_layouts(recipe, world, fixed, vocab_size, local, on_cpu)
    except ConfigError as e:
        return {"refused": str(e)}
    if not ranked:
        given = " ".join(f"--set {FREE_SETTINGS[axis]}={value}" if axis in FREE_SETTINGS else f"--{axis} {value}"
                         for axis, value in fixed.items()) or "no axis given"
        return {"refused": f"--layout auto: no layout of {world} processes passes the run's rules and fits ({given}, "
                           f"global batch {recipe.train.global_batch_size}); drop a fixed axis or start another "
                           f"number of processes"}
    best = ranked[0]
    top = [{key: r[key] for key in ("tp", "pp", "cp", "dp", "ep", "micro_batch", "recompute", "schedule",
                                    "virtual_stages", "step_time_s")}
           for r in ranked[:max(SHOWN, sweep)]]
    from launch.engine.distributed import free_port
    return {"choice": dict(tp=best["tp"], pp=best["pp"], cp=best["cp"], ep=best["ep"], micro_batch=best["micro_batch"],
                           recompute=best["recompute"], schedule=best["schedule"],
                           virtual_stages=best["virtual_stages"], predicted_step_time_s=best["step_time_s"],
                           ranked=len(ranked), cost_model=model_used),
            "top": top, "trial_ports": [free_port() for _ in top[:sweep]], "said": said}


def _swept_choice(args, decision: dict, planned: AutoChoice, world: int, fixed: Dict[str, int]) -> AutoChoice:
    """The fastest measured of the trials of the top candidates (rank 0's measurements, on every rank)."""
    from data.job_listing import once_per_job
    trials = decision["top"][:len(decision["trial_ports"])]
    local_times = run_trials(args, trials, decision["trial_ports"])
    times = once_per_job(["auto sweep", str(args.recipe), args.overrides, world, fixed, decision["trial_ports"]],
                         lambda: local_times, "--auto-sweep: rank 0 failed its trials",
                         "--auto-sweep: rank 0 did not finish its trials")
    best = fastest_measured(trials, times)
    if best is None:
        raise ConfigError(f"--auto-sweep {len(trials)}: every trial failed (their last lines are above); train a "
                          f"layout given with --tp/--pp, or --layout auto without --auto-sweep")
    won = trials[best]
    return dataclasses.replace(planned, tp=won["tp"], pp=won["pp"], cp=won["cp"], ep=won["ep"],
                               micro_batch=won["micro_batch"], recompute=won["recompute"], schedule=won["schedule"],
                               virtual_stages=won["virtual_stages"],
                               predicted_step_time_s=won["step_time_s"],
                               measured_step_time_s=times[best], swept=len(trials))


def auto_layout(args, recipe: Recipe, world: int, vocab_size: int, on_cpu: bool) -> Tuple[Recipe, AutoChoice]:
    """The recipe with the chosen cp, ep and micro-batch, and the choice (tp, pp among it); the same
    on every rank. Prints the top candidates on rank 0."""
    from data.job_listing import once_per_job
    from launch.config.cli import training_recipe
    fixed = _fixed_axes(args)
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or world)
    sweep = args.auto_sweep or 0
    decision = once_per_job(["layout auto", str(args.recipe), args.overrides, world, fixed, sweep],
                            lambda: choose(recipe, world, fixed, vocab_size, local, on_cpu, sweep),
                            "--layout auto: rank 0 failed to choose", "--layout auto: rank 0 did not choose")
    if "refused" in decision:
        raise ConfigError(decision["refused"])
    choice = AutoChoice(**decision["choice"])
    rank0 = os.environ.get("RANK", "0") == "0"
    if rank0:
        print("layout auto: the fastest predicted\n" + "\n".join(
            f"  {i}. {describe(r)}: {r['step_time_s']:.4g} s" for i, r in enumerate(decision["top"][:SHOWN], 1)),
            flush=True)
    if sweep:
        choice = _swept_choice(args, decision, choice, world, fixed)
    if rank0:
        print("\n".join(decision.get("said", []) + [choice.line()]), flush=True)
    chosen = argparse.Namespace(**{**vars(args), "overrides": list(args.overrides) + choice.overrides()})
    return training_recipe(chosen), choice
