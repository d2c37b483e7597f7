"""ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", sec. 3.1) on DeepSpeed's own
pipeline engine: a schedule class and two instructions, installed on one engine.

The schedule is DeepSpeed's TrainSchedule step for step (the same sends and receives in the same
order), with each backward split into B (`BackwardInputPass`: input gradients, while our linears
defer their weight gradients, model/weight_grad.py) and W (`WeightPass`: the oldest deferred
micro-batch's weight gradients), W run where 1F1B idles, when stage k holds more than k + 1
pending, and before the step's reductions. W passes run in micro-batch order: the same bits as
1F1B. At pp = 1, 1F1B runs. Why and what it costs: docs/pipeline-schedules.md."""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, List

from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

from model.weight_grad import WEIGHT_GRADS

if TYPE_CHECKING:
    from deepspeed.runtime.pipe.schedule import PipeInstruction


def runs_zero_bubble(schedule_name: str, pp: int) -> bool:
    """Whether a run of `train.schedule` at `pp` stages executes ZB-H1 (at pp = 1, 1F1B runs)."""
    return schedule_name == "zb-h1" and pp > 1


def deferred_microbatches(stage: int, microbatches: int) -> int:
    """The most micro-batches whose weight gradients stage `stage` keeps pending after a step of
    the schedule: stage + 1 (module docstring), never more than the step has."""
    return min(stage + 1, microbatches)


class BackwardInputPass(schedule.BufferOpInstruction):
    """The backward pass of one micro-batch, with the linears' weight gradients deferred (B)."""


class WeightPass(schedule.PipeInstruction):
    """The deferred weight gradients of the oldest micro-batch whose B pass ran (W)."""


class ZeroBubbleH1Schedule(schedule.TrainSchedule):
    """DeepSpeed's TrainSchedule with its backward split into B and W (module docstring)."""

    def steps(self) -> Iterator[List[PipeInstruction]]:
        pending = 0
        keep = deferred_microbatches(self.stage_id, self.micro_batches)  # pending W allowed after a B step
        for cmds in super().steps():
            out: List[PipeInstruction] = []
            computes = any(isinstance(c, (schedule.ForwardPass, schedule.BackwardPass)) for c in cmds)
            for cmd in cmds:
                if isinstance(cmd, schedule.BackwardPass):
                    out.append(BackwardInputPass(cmd.buffer_id))
                    pending += 1
                elif isinstance(cmd, schedule.ReduceTiedGrads):  # the step's end: every W first
                    out += [WeightPass() for _ in range(pending)]
                    pending = 0
                    out.append(cmd)
                else:
                    out.append(cmd)
            if pending and (not computes or pending > keep):
                out.append(WeightPass())
                pending -= 1
            yield out


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
    BF16 optimizer adds each micro-batch's bf16 gradients into its fp32 ones after the pass."""
    bf16 = engine.using_bf16_optimizer
    if bf16:
        engine.optimizer.clear_lp_grads()
    WEIGHT_GRADS.compute_oldest()
    if bf16:
        engine.optimizer.update_hp_grads(clear_lp_grads=False)


def _exec_reduce_tied_grads(engine: PipelineEngine) -> None:
    assert WEIGHT_GRADS.pending == 0, f"{WEIGHT_GRADS.pending} micro-batches' weight gradients were never computed"
    PipelineEngine._exec_reduce_tied_grads(engine)


def use_zero_bubble_schedule(engine: PipelineEngine) -> None:
    """Train `engine` with ZB-H1 from its next `train_batch` on (evaluation is unchanged)."""
    handlers = dict(engine._INSTRUCTION_MAP)
    handlers[BackwardInputPass] = _exec_backward_input_pass
    handlers[WeightPass] = _exec_weight_pass
    handlers[schedule.RecvGrad] = _exec_recv_grads
    handlers[schedule.ReduceTiedGrads] = _exec_reduce_tied_grads
    engine._INSTRUCTION_MAP = handlers  # an instance attribute: `_exec_schedule` looks it up on the engine
    engine._train_schedule = lambda: ZeroBubbleH1Schedule(micro_batches=engine.micro_batches,
                                                          stages=engine.num_stages, stage_id=engine.stage_id)
