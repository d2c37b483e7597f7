"""The run's step time as the planner predicts it, checked against the measured one in every run.
Rank 0 plans the run's own layout before step 1 (launch/analysis/planner.py,
the same estimate `launch/plan.py` prints). The device profile is this machine's calibration
when one is cached (`launch/plan.py ... --calibrate`), else the datasheet of a known GPU; a CPU
without a calibration gets no prediction, and the summary says how to make one.

The console summary and every `--metrics-out` record carry `predicted_step_time_s`. At the end
the run prints the measured median step time after warm-up beside it."""
import os

from launch.config.layout import Layout
from launch.config.recipe import Recipe
from launch.instruments.step_time import StepPrediction


def planner_inputs(recipe: Recipe, layout: Layout, vocab_size: int):
    """(ModelConfig, Setup) of this run as the planner takes them."""
    import dataclasses

    from launch.analysis.plan_setup import Setup
    from launch.analysis.engine_memory import REDUCE_BUCKET_ELEMENTS
    from launch.analysis.partition import blocks_per_stage
    train = recipe.train
    model = dataclasses.replace(recipe.model, vocab_size=vocab_size, seq_len=recipe.seq_len)
    # The run's own cut (its stage boundaries, as blocks per stage), else the recipe's rule.
    cut = tuple(blocks_per_stage(model.resolved(), list(layout.parts))) if layout.parts else train.partition
    setup = Setup(gpus=layout.world_size, tp=layout.tp, pp=layout.pp, micro_batch=layout.micro_batch_size,
                  global_batch=layout.global_batch_size, zero=train.zero_stage, recompute=train.recompute_mode,
                  partition=cut if isinstance(cut, (str, tuple)) else tuple(cut), schedule=train.schedule,
                  precision=train.precision, communication_data_type=recipe.deepspeed.get("communication_data_type"),
                  reduce_bucket_elements=int(recipe.deepspeed.get("zero_optimization", {}).get(
                      "reduce_bucket_size", REDUCE_BUCKET_ELEMENTS)),
                  grad_accum_fusion=train.grad_accum_fusion, cp=layout.cp, ep=layout.ep, optimizer=train.optimizer)
    return model, setup


def this_device_hardware(precision: str, local_processes: int):
    """(Hardware, how its profile was found) for the machine this rank runs on, or (None, why)."""
    import torch

    from launch.analysis.device_profile import DeviceProfile, datasheet_profile
    from launch.analysis.plan_setup import GPUS, Hardware
    from launch.autotune.calibrate import cache_path, device_name
    name = device_name(local_processes)
    cached = cache_path(name, precision)
    profile = DeviceProfile.from_json(cached.read_text()) if cached.exists() else None
    gpu = next((GPUS[key] for key in GPUS if key in name.upper()), None) if torch.cuda.is_available() else None
    if profile is None and gpu is None:
        return None, (f"no calibration of {name!r} in {precision}: `python launch/plan.py --recipe RECIPE --gpus "
                      f"{local_processes} --precision {precision} --calibrate` measures one")
    if profile is None:
        profile = datasheet_profile(name, gpu.peak_flops, 0.5, gpu.memory_bw)
    # A CPU has no datasheet: its calibration's rates and links stand for everything (one
    # process alone has no links to cost).
    links = profile.link_bw or float("inf")
    hardware = Hardware(peak_flops=gpu.peak_flops if gpu else max(profile.gemm.values(), default=1.0),
                        intra_node_bw=gpu.intra_node_bw if gpu else links,
                        inter_node_bw=gpu.inter_node_bw if gpu else links, gpus_per_node=local_processes,
                        profile=profile)
    return hardware, None


def predict_step_time(recipe: Recipe, layout: Layout, vocab_size: int) -> StepPrediction:
    """The planner's estimate for this run's layout on this device (rank 0 calls it once)."""
    from launch.analysis.plan_report import cost_model
    from launch.analysis.planner import estimate_plan
    from launch.errors import ConfigError
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or layout.world_size)
    hardware, why_not = this_device_hardware(recipe.train.precision, local)
    if hardware is None:
        return StepPrediction(None, why_not)
    model, setup = planner_inputs(recipe, layout, vocab_size)
    try:
        plan = estimate_plan(model, setup, hardware)
    except ConfigError as e:  # a layout the run accepts but the planner cannot cost (e.g. a CPU-only rule)
        return StepPrediction(None, f"the planner cannot cost this layout: {e}")
    return StepPrediction(plan["step_time_s"], cost_model(hardware).removeprefix("cost model: "))
