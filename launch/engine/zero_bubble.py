"""ZB-H1 on one DeepSpeed pipeline engine: the handlers of the B and W instructions of
launch/analysis/zero_bubble_schedule.py (B runs the engine's backward with the linears' weight
gradients deferred, model/parallel/weight_grad.py; W computes the oldest deferred micro-batch's), and the
engine's train schedule swapped for ZeroBubbleH1Schedule.

Every hook is a private member of DeepSpeed's engine or BF16 optimizer. On a DeepSpeed that lacks
one (an engine that builds its schedule inline, say) the override would be ignored and 1F1B run
while the role map says zb-h1: `check_deepspeed_hooks` refuses such a DeepSpeed before training,
and `check_weight_passes_ran` fails a run whose first step computed no deferred weight gradient.
"""
import inspect
from typing import List

import deepspeed
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

from launch.analysis.zero_bubble_schedule import BackwardInputPass, WeightPass, ZeroBubbleH1Schedule
from launch.errors import ConfigError
from launch.optim.main_grad import accumulates_into_main_grads
from model.parallel.weight_grad import WEIGHT_GRADS

# DeepSpeed's instructions whose handlers ours wrap (`use_zero_bubble_schedule`)
REPLACED_INSTRUCTIONS = (schedule.BackwardPass, schedule.RecvGrad, schedule.ReduceTiedGrads)


def _uses(cls: type, method: str, member: str) -> bool:
    """Whether `cls.method`'s own code reads or writes the attribute `member` (of self)."""
    function = inspect.getattr_static(cls, method, None)
    return inspect.isfunction(function) and member in function.__code__.co_names


def missing_deepspeed_hooks() -> List[str]:
    """The members of DeepSpeed's classes this module relies on that this DeepSpeed lacks, or no
    longer uses where the overrides expect (each as Class.member)."""
    missing = []
    instruction_map = getattr(PipelineEngine, "_INSTRUCTION_MAP", None)
    if not (isinstance(instruction_map, dict) and _uses(PipelineEngine, "_exec_schedule", "_INSTRUCTION_MAP")
            and all(inspect.isfunction(instruction_map.get(kind)) for kind in REPLACED_INSTRUCTIONS)):
        missing.append("PipelineEngine._INSTRUCTION_MAP")  # our handlers go in the engine's copy
    if not (inspect.isfunction(inspect.getattr_static(PipelineEngine, "_train_schedule", None))
            and _uses(PipelineEngine, "train_batch", "_train_schedule")):
        missing.append("PipelineEngine._train_schedule")  # our schedule replaces it on the instance
    for method in ("_exec_backward_pass", "_exec_recv_grads", "_exec_reduce_tied_grads"):
        if not inspect.isfunction(inspect.getattr_static(PipelineEngine, method, None)):
            missing.append(f"PipelineEngine.{method}")  # the B pass and the handlers wrap them
    if not _uses(PipelineEngine, "_allocate_or_extend_buffers", "_grad_layer_buf"):
        missing.append("PipelineEngine._grad_layer_buf")  # received gradients each get a new buffer
    for method in ("update_hp_grads", "clear_lp_grads"):
        if not inspect.isfunction(inspect.getattr_static(BF16_Optimizer, method, None)):
            missing.append(f"BF16_Optimizer.{method}")  # the W pass adds its gradients in fp32 through them
    return missing


def check_deepspeed_hooks(pp: int) -> None:
    """Raise ConfigError (one line) unless this DeepSpeed has every hook ZB-H1 overrides."""
    missing = missing_deepspeed_hooks()
    if missing:
        raise ConfigError(f"train.schedule=zb-h1 with --pp {pp}: DeepSpeed {deepspeed.__version__} lacks "
                          f"{', '.join(missing)}, which ZB-H1 overrides (written for DeepSpeed 0.19.8); 1F1B "
                          f"would run instead: use train.schedule=1f1b or DeepSpeed 0.19.8")


class WeightPassCounter:
    """The W instructions this process's engine ran and the deferred weight gradients they computed."""

    def __init__(self) -> None:
        self.passes = 0
        self.gradients = 0


WEIGHT_PASSES = WeightPassCounter()


def check_weight_passes_ran(engine: PipelineEngine) -> None:
    """After the first `train_batch` under ZB-H1: raise RuntimeError (one line) unless its W
    passes computed weight gradients on this stage; none means 1F1B ran, or B did W's work."""
    if WEIGHT_PASSES.gradients == 0:
        raise RuntimeError(f"train.schedule=zb-h1: stage {engine.stage_id}'s first step ran {WEIGHT_PASSES.passes} "
                           f"W passes computing no weight gradient: its backward was 1F1B's (DeepSpeed "
                           f"{deepspeed.__version__} ignoring the schedule's hooks, or compiled blocks not "
                           f"deferring); use train.schedule=1f1b")


def _exec_backward_input_pass(engine: PipelineEngine, buffer_id: int) -> None:
    with WEIGHT_GRADS.deferring():
        PipelineEngine._exec_backward_pass(engine, buffer_id)
    WEIGHT_GRADS.seal_microbatch()


def _exec_recv_grads(engine: PipelineEngine, buffer_id: int) -> None:
    """DeepSpeed's receive into a new buffer. Its own reuses one, which it also shares with the
    received activations (`_allocate_or_extend_buffers`); a deferred W pass still holds the
    gradient received for its micro-batch (the output gradient of this stage's last linear)."""
    engine.grad_layer, engine._grad_layer_buf = None, []
    PipelineEngine._exec_recv_grads(engine, buffer_id)


def _exec_weight_pass(engine: PipelineEngine) -> None:
    """What the engine's backward does around autograd, for the weight gradients alone: DeepSpeed's
    BF16 optimizer adds each micro-batch's bf16 gradients into its fp32 ones after the pass (with
    gradient-accumulation fusion the W pass adds into the fp32 ones itself: nothing to do)."""
    bf16 = engine.using_bf16_optimizer and not accumulates_into_main_grads(engine.optimizer)
    if bf16:
        engine.optimizer.clear_lp_grads()
    WEIGHT_PASSES.passes += 1
    WEIGHT_PASSES.gradients += WEIGHT_GRADS.compute_oldest()
    if bf16:
        engine.optimizer.update_hp_grads(clear_lp_grads=False)


def _exec_reduce_tied_grads(engine: PipelineEngine) -> None:
    assert WEIGHT_GRADS.pending == 0, f"{WEIGHT_GRADS.pending} micro-batches' weight gradients were never computed"
    PipelineEngine._exec_reduce_tied_grads(engine)


def use_zero_bubble_schedule(engine: PipelineEngine) -> None:
    """Train `engine` with ZB-H1 from its next `train_batch` on (evaluation is unchanged)."""
    check_deepspeed_hooks(engine.num_stages)
    WEIGHT_PASSES.passes = WEIGHT_PASSES.gradients = 0  # counted from this engine's first step on
    handlers = dict(engine._INSTRUCTION_MAP)
    handlers[BackwardInputPass] = _exec_backward_input_pass
    handlers[WeightPass] = _exec_weight_pass
    handlers[schedule.RecvGrad] = _exec_recv_grads
    handlers[schedule.ReduceTiedGrads] = _exec_reduce_tied_grads
    engine._INSTRUCTION_MAP = handlers  # an instance attribute: `_exec_schedule` looks it up on the engine
    engine._train_schedule = lambda: ZeroBubbleH1Schedule(micro_batches=engine.micro_batches,
                                                          stages=engine.num_stages, stage_id=engine.stage_id)
