"""Per-step metrics on the logging rank: a JSON-lines file, the console and wandb.

Each step's record holds the loss, gradient norm, lr, loss scale, consumed samples and tokens,
the throughput (tokens/s, model TFLOP/s per device, MFU) and the peak memory of the busiest
rank. The FLOPs and the batch arithmetic come from launch/analysis/formulas.py, the same numbers the
planner (launch/plan.py) predicts with, so a run can be held against its plan.
"""
from __future__ import annotations

import json
import os
import resource
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from launch.analysis import formulas
from launch.config.layout import Layout
from launch.errors import ConfigError
from launch.instruments.moe_metrics import charted_moe_metrics

if TYPE_CHECKING:  # annotations only: no import cost at run time
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from launch.instruments.step_time import StepPrediction
    from model.config import GPTConfig

PEAK_TFLOPS_ENV = "GPT3D_PEAK_TFLOPS"
"""Dense TFLOP/s per device that MFU divides by, for devices missing from launch/analysis/plan_setup.py's GPUS."""


def is_logging_rank(global_rank: int) -> bool:
    """The one predicate that decides who prints, writes metrics and talks to wandb.

    Global rank 0 is on the first stage; DeepSpeed broadcasts each step's loss from the last
    stage to the whole pipeline, and the gradient norm is reduced over every rank."""
    return global_rank == 0


# ---------------------------------------------------------------- pure helpers

def tflops_per_device(model_flops: float, step_time_s: float, world_size: int) -> float:
    """Model TFLOP/s each device achieves: model FLOPs per step / (step time * devices) / 1e12."""
    return model_flops / (step_time_s * world_size) / 1e12


def peak_flops(device_name: Optional[str], override_tflops: Optional[str]) -> Tuple[Optional[float], str]:
    """The peak FLOP/s per device that MFU divides by, and where that number comes from.

    `device_name` is torch.cuda.get_device_name() (None on CPU); `override_tflops` the value of
    GPT3D_PEAK_TFLOPS. No table entry and no override gives None: MFU is then reported as null
    rather than against a guessed peak."""
    if override_tflops:
        try:
            value = float(override_tflops)
        except ValueError:
            value = 0.0
        if not value > 0:
            raise ConfigError(f"{PEAK_TFLOPS_ENV}={override_tflops!r} must be a positive number of TFLOP/s")
        return value * 1e12, f"{value:g} TFLOP/s from {PEAK_TFLOPS_ENV}"
    if device_name is None:
        return None, f"none on CPU (mfu is null; set {PEAK_TFLOPS_ENV} to compare against a peak)"
    # The planner's datasheet table, its names matched whole (plan_setup.known_gpu): "NVIDIA GH200
    # 480GB" is no H200, "NVIDIA H100 PCIe" no SXM.
    from launch.analysis.plan_setup import known_gpu
    found = known_gpu(device_name)
    if found:
        gpu, flops = found[0], found[1].peak_flops
        return flops, f"{flops / 1e12:g} TFLOP/s ({gpu} dense bf16, device {device_name!r})"
    return None, f"unknown device {device_name!r} (mfu is null; set {PEAK_TFLOPS_ENV})"


def format_duration(seconds: float) -> str:
    """A short clock for the ETA: 42s, 3m05s, 2h07m."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def eta_seconds(elapsed_s: float, step: int, total_steps: int) -> float:
    """Remaining time at the mean wall time per step so far (evaluation and logging included)."""
    return elapsed_s / step * (total_steps - step)


# ---------------------------------------------------------------- the run's fixed numbers

@dataclass(frozen=True)
class RunArithmetic:
    """Numbers fixed for the whole run: what the per-step metrics divide by, and the summary."""
    params: int
    """Model parameters (formulas.model_params: unpadded vocabulary, a tied head once)."""
    layout: Layout
    seq_len: int
    """Tokens per sample."""
    total_steps: int
    tokens_per_step: int
    model_flops_per_step: float
    """formulas.model_flops_per_step_of without recompute: what MFU counts."""
    bubble_fraction: float
    """Predicted bubble with equal stages: 1F1B's (p-1)/(m+p-1), interleaved (p-1)/(v m+p-1)."""
    peak_flops: Optional[float]
    """Per device; None where unknown (CPU): MFU is then null."""
    peak_source: str
    active_params: Optional[int] = None
    """A mixture of experts: the parameters one token passes through (k routed experts, shared
    experts, router: formulas.model_params_active); None for a dense model."""
    prediction: Optional[StepPrediction] = None
    """The planner's step time for this layout on this device (launch/instruments/step_time.py)."""
    virtual_stages: int = 1
    """train.virtual_stages: chunks per pipeline rank (interleaved 1F1B when > 1)."""

    def _bubble_line(self) -> str:
        p, m, v = self.layout.pp, self.layout.grad_accum_steps, self.virtual_stages
        if v > 1:  # Narayanan et al. 2021, sec. 2.2.2: each pass is 1/v of a stage's
            return (f"  interleaved 1F1B bubble predicted (p-1)/(v m+p-1) = {p - 1}/{v * m + p - 1} = "
                    f"{self.bubble_fraction:.1%} (v = {v} chunks per rank)")
        return f"  1F1B bubble predicted (p-1)/(m+p-1) = {p - 1}/{m + p - 1} = {self.bubble_fraction:.1%}"

    def summary(self) -> str:
        l, p, m = self.layout, self.layout.pp, self.layout.grad_accum_steps
        cp = f"cp {l.cp} x " if l.cp > 1 else ""
        active = f" ({self.active_params:,} active per token)" if self.active_params is not None else ""
        ep = f", ep {l.ep}" if l.ep > 1 else ""
        return (f"summary: {self.params:,} parameters{active}; world {l.world_size} = tp {l.tp} x {cp}pp {p} x dp "
                f"{l.dp}{ep}\n"
                f"  per step: {m} micro-batches of {l.micro_batch_size} per pipeline x dp {l.dp} = "
                f"{l.global_batch_size} samples = {self.tokens_per_step:,} tokens; {self.total_steps} steps\n"
                + self._bubble_line() +
                f"\n  model FLOPs per step {self.model_flops_per_step:.4g} (no recompute); "
                f"MFU peak per device: {self.peak_source}"
                + ("\n" + self.prediction.summary_line() if self.prediction is not None else ""))


def accelerator_device_name() -> Optional[str]:
    """torch.cuda.get_device_name() on CUDA, None elsewhere (CPU runs have no peak table)."""
    from deepspeed.accelerator import get_accelerator
    if get_accelerator().device_name() != "cuda":
        return None
    import torch
    return torch.cuda.get_device_name()


def run_arithmetic(config: GPTConfig, layout: Layout, seq_len: int, total_steps: int,
                   prediction: Optional[StepPrediction] = None, virtual_stages: int = 1) -> RunArithmetic:
    """From the model's GPTConfig, the layout, tokens per sample and steps (reads the device
    name and GPT3D_PEAK_TFLOPS for the MFU peak), and the planner's step time when known."""
    peak, source = peak_flops(accelerator_device_name(), os.environ.get(PEAK_TFLOPS_ENV))
    return RunArithmetic(
        params=formulas.model_params(config),
        layout=layout, seq_len=seq_len, total_steps=total_steps,
        tokens_per_step=layout.global_batch_size * seq_len,
        model_flops_per_step=formulas.model_flops_per_step_of(config, layout.global_batch_size, seq_len),
        bubble_fraction=formulas.interleaved_bubble_fraction(layout.pp, layout.grad_accum_steps, virtual_stages),
        virtual_stages=virtual_stages,
        peak_flops=peak, peak_source=source,
        active_params=formulas.model_params_active(config) if config.moe.enabled else None, prediction=prediction)


# ---------------------------------------------------------------- read on every rank

def loss_scale(engine: PipelineEngine) -> float:
    """The fp16 dynamic loss scale now; 1.0 for fp32 and bf16, which scale nothing.

    `_get_optimizer_loss_scale` is how DeepSpeed 0.19.8's own PipelineEngine reads it: it covers
    both the ZeRO optimizer (`cur_scale`) and FP16_Optimizer (`loss_scale_config.cur_scale`)."""
    return float(engine._get_optimizer_loss_scale()) if engine.fp16_enabled() else 1.0


CLEAR_REFS = Path("/proc/self/clear_refs")  # Linux: writing "5" resets the peak RSS (VmHWM)


def reset_step_memory_peak() -> None:
    """Start one step's memory peak: the caching allocator's peak statistics on an accelerator;
    on CPU the kernel's peak RSS, where Linux lets a process reset it (else the peak since start)."""
    from deepspeed.accelerator import get_accelerator
    if get_accelerator().device_name() != "cpu":
        get_accelerator().reset_peak_memory_stats()
        return
    try:
        CLEAR_REFS.write_text("5")
    except OSError:
        pass


def local_step_memory_peak() -> Tuple[int, Optional[int]]:
    """(peak allocated, peak reserved) bytes of this process since `reset_step_memory_peak`.
    On CPU: (peak RSS, None): there is no caching allocator whose reserve could differ."""
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        status = Path("/proc/self/status")
        if status.exists():
            for line in status.read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024, None  # KiB
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, None  # Linux reports KiB
    return int(accelerator.max_memory_allocated()), int(accelerator.max_memory_reserved())


def synchronize_device() -> None:
    """Wait for the device's queued work, so that a clock read after it includes that work
    (the pp=1 optimizer step runs asynchronously after `train_batch` returns on a GPU)."""
    from deepspeed.accelerator import get_accelerator
    get_accelerator().synchronize()


# ---------------------------------------------------------------- the logger

def earlier_records(path: Path, last_step: int) -> List[str]:
    """The lines of an earlier run's metrics file up to `last_step`: the steps a resumed run
    does not repeat. Later steps (trained after the checkpoint) and a torn last line are dropped."""
    if not path.exists():
        return []
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    return kept


def keep_records_until(path: Path, last_step: int) -> None:
    """Cut a resumed run's metrics file to its records up to `last_step`, never in place: the kept
    lines go to a new file, made durable, then renamed over the old one, so a process killed
    meanwhile leaves the old file whole, and the resumed run appends to the new one."""
    kept = earlier_records(path, last_step)
    cut = path.with_name(path.name + ".resuming")
    with open(cut, "w") as f:
        f.writelines(line + "\n" for line in kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(cut, path)


class MetricsLogger:
    """Prints the run's summary once, then one record per step to the file, wandb and console.

    Adds to each record: tflops_per_device and mfu (from `step_time_s`), elapsed_s."""

    def __init__(self, metrics_out: Optional[Path], wandb_mode: str, wandb_project: str,
                 wandb_name: Optional[str], run_config: Dict[str, Any], run: RunArithmetic,
                 resume_after_step: Optional[int] = None, wandb_run_id: Optional[str] = None):
        """`resume_after_step`: a resumed run's checkpoint step; the metrics file keeps its
        records up to that step and continues after them. `wandb_run_id`: the checkpoint's
        wandb run, which a resumed run continues (same id) instead of starting a new one."""
        self.run = run
        self.steps_before = resume_after_step or 0  # the ETA counts this process's steps only
        print(run.summary(), flush=True)
        self.file = None
        if metrics_out is not None:
            metrics_out.parent.mkdir(parents=True, exist_ok=True)
            if resume_after_step is not None:
                keep_records_until(metrics_out, resume_after_step)
                self.file = open(metrics_out, "a")
            else:
                self.file = open(metrics_out, "w")
        self.wandb_run = None
        if wandb_mode != "disabled":
            import wandb
            arithmetic = {k: v for k, v in asdict(run).items() if k != "layout"}
            # resume="allow": continue the run of that id (steps it already has are not re-logged
            # by wandb), or start it under that id if it never reached the server (offline).
            self.wandb_run = wandb.init(project=wandb_project, name=wandb_name, mode=wandb_mode,
                                        config=dict(run_config, arithmetic=arithmetic),
                                        id=wandb_run_id, resume="allow" if wandb_run_id else None)
        self.start = time.perf_counter()

    @property
    def wandb_run_id(self) -> Optional[str]:
        return self.wandb_run.id if self.wandb_run is not None else None

    def log(self, record: Dict[str, Any]) -> None:
        tflops = tflops_per_device(self.run.model_flops_per_step, record["step_time_s"], self.run.layout.world_size)
        mfu = tflops * 1e12 / self.run.peak_flops if self.run.peak_flops else None
        record = dict(record, tflops_per_device=tflops, mfu=mfu,
                      elapsed_s=round(time.perf_counter() - self.start, 4))
        if self.run.prediction is not None:
            self.run.prediction.observe(record["step_time_s"])
            record["predicted_step_time_s"] = self.run.prediction.seconds
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.wandb_run is not None:  # wandb charts numbers; a null MFU is left out
            charted = {k: v for k, v in record.items()
                       if k not in ("step", "compute_s", "compute_s_by_rank", "expert_load", "tasks") and v is not None}
            charted.update(charted_moe_metrics(record))  # each MoE block's load imbalance
            charted.update({f"{task}/{key}": value for task, scores in record.get("tasks", {}).items()
                            for key, value in scores.items()})  # eval.tasks: hellaswag/acc, hellaswag/acc_norm, ...
            if "compute_s" in record:  # a thousand ranks are a thousand series: their max and median
                charted.update(compute_s_max=record["compute_s"]["max"], compute_s_median=record["compute_s"]["median"])
            self.wandb_run.log(charted, step=record["step"])
        print(self.progress_line(record), flush=True)

    def progress_line(self, record: Dict[str, Any]) -> str:
        """One plain line per step (logs go to files on clusters: no redrawn bars)."""
        step, total = record["step"], self.run.total_steps
        parts: List[str] = [
            f"step {step:>{len(str(total))}}/{total}", f"loss {record['loss']:.4f}",
            f"grad_norm {record['grad_norm']:.4f}", f"lr {record['lr']:.3e}",
            f"{record['tokens_per_s']:.0f} tok/s", f"{record['tflops_per_device']:.3g} TFLOP/s/dev"]
        if record["mfu"] is not None:
            parts.append(f"mfu {record['mfu']:.1%}")
        parts.append(f"mem {record['peak_memory_bytes'] / 2 ** 30:.2f} GiB")
        if record["loss_scale"] != 1.0:
            parts.append(f"scale {record['loss_scale']:g}")
        if "aux_loss" in record:  # a mixture of experts: the router's loss and the worst load imbalance
            parts.append(f"aux {record['aux_loss']:.4f} load max/mean {record['expert_load_max_over_mean']:.2f}")
        if "val_loss" in record:
            parts.append(f"val_loss {record['val_loss']:.4f} (ppl {record['val_ppl']:.1f}"
                         + (f", bpb {record['val_bpb']:.4f})" if "val_bpb" in record else ")"))
        for label, loss in record.get("val_loss_by_source", {}).items():  # a mixture (data.mix)
            parts.append(f"val[{label}] {loss:.4f}")
        for task, scores in record.get("tasks", {}).items():  # eval.tasks
            parts.append(f"{task} acc {scores['acc']:.4f} acc_norm {scores['acc_norm']:.4f}")
        eta = eta_seconds(record["elapsed_s"], step - self.steps_before, total - self.steps_before)
        parts.append(f"eta {format_duration(eta)}")
        return " | ".join(parts)

    def close(self) -> None:
        closing = self.run.prediction.closing_line() if self.run.prediction is not None else None
        if closing is not None:
            print(closing, flush=True)
        if self.file is not None:
            self.file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
