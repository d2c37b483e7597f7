"""The run's step time as the planner predicts it, checked against the measured one in every run.
Rank 0 plans the run's own layout, its virtual stages included, before step 1 (launch/analysis/planner.py,
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
    # The run's own cut (its stage boundaries, as blocks per stage), else the recipe's rule. At v > 1 the
    # rule or list (blocks per rank, split over its chunks: partition.chunk_blocks), which the planner
    # applies as the run does.
    v = layout.virtual_stages
    cut = tuple(blocks_per_stage(model.resolved(), list(layout.parts))) if layout.parts and v == 1 else train.partition
    setup = Setup(gpus=layout.world_size, tp=layout.tp, pp=layout.pp, micro_batch=layout.micro_batch_size,
                  global_batch=layout.global_batch_size, zero=train.zero_stage, recompute=train.recompute,
                  partition=cut if isinstance(cut, (str, tuple)) else tuple(cut), schedule=train.schedule,
                  precision=train.precision, communication_data_type=recipe.deepspeed.get("communication_data_type"),
                  reduce_bucket_elements=int(recipe.deepspeed.get("zero_optimization", {}).get(
                      "reduce_bucket_size", REDUCE_BUCKET_ELEMENTS)),
                  grad_accum_fusion=train.grad_accum_fusion, cp=layout.cp, ep=layout.ep, optimizer=train.optimizer,
                  virtual_stages=v, compile=train.compile, document_mask=recipe.data.document_mask)
    return model, setup


def this_device_hardware(precision: str, local_processes: int):
    """(Hardware, how its profile was found) for the machine this rank runs on, or (None, why).
    launch/plan.py --gpu this, --layout auto and every run's prediction all take this one
    (plan_setup.device_hardware: the device's name matched exactly, its memory less the headroom,
    its calibration or datasheet, links never free)."""
    import dataclasses

    import torch

    from launch.analysis.device_profile import DeviceProfile
    from launch.analysis.plan_setup import device_hardware, known_gpu
    from launch.autotune.calibrate import cache_path, device_name
    name = device_name(local_processes)
    cached = cache_path(name, precision)
    profile = DeviceProfile.from_json(cached.read_text()) if cached.exists() else None
    on_gpu = torch.cuda.is_available()
    if profile is None and not (on_gpu and known_gpu(name)):
        return None, (f"no calibration of {name!r} in {precision}: `python launch/plan.py --recipe RECIPE --gpus "
                      f"{local_processes} --precision {precision} --calibrate` measures one")
    # A GPU's memory is its own (torch's total less the headroom); a CPU's is not checked, and its
    # calibration's rates and links stand for everything.
    total = torch.cuda.get_device_properties(torch.cuda.current_device() if torch.cuda.is_initialized() else 0
                                             ).total_memory if on_gpu else None
    hardware, notes = device_hardware(name, total, profile, local_processes, precision)
    return (hardware if on_gpu else dataclasses.replace(hardware, notes=())), None


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
