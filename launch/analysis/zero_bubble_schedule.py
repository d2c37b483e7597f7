"""ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", sec. 3.1) on DeepSpeed's own
pipeline engine: the schedule class, its two instructions and how many micro-batches a stage
defers, for the engine (launch/engine/zero_bubble.py installs it) and the planner's simulator
(schedule_sim.py). Whether a run executes it at all is launch/config/layout.py's `runs_zero_bubble`.

1F1B's backward of a micro-batch is one pass, B+W: the input gradients the previous stage waits
for and the weight gradients nothing waits for. ZB-H1 splits it: `BackwardInputPass` (B) runs the
engine's own backward while our linears defer their weight gradients (model/parallel/weight_grad.py), and
`WeightPass` (W) computes the oldest deferred micro-batch's weight gradients later, where 1F1B
would wait for a gradient from the next stage.

The schedule is DeepSpeed's TrainSchedule step for step: the same sends and receives in the same
order, so it pairs across stages exactly as 1F1B does (no new deadlock to reason about), with each
BackwardPass replaced by a B pass and W passes added:
  - in each step where 1F1B idles (no forward or backward for this stage), one W if any is queued;
  - at the end of a B step when more than `stage + 1` W passes are queued, one W: stage k keeps at
    most k + 1 micro-batches' weight gradients pending, which bounds the memory they hold (their
    linears' inputs and output gradients) while the later stages, whose gradients the earlier
    ones wait for, defer the most. A simulation of every placement we tried (launch/analysis/
    schedule_sim.py plays these same instruction streams) found this one reaching ZB-H1's
    bubble (p-1)(T_F+T_B-T_W) whenever T_W <= T_B;
  - the rest before the gradient reductions of the step's end.
W passes run in micro-batch order, so each gradient is summed in 1F1B's order: the same bits.
Gradients received from the next stage go into a new buffer each (launch/engine/zero_bubble.py:
`_exec_recv_grads`).
At pp = 1 there is no bubble to fill and 1F1B runs (the tied embedding would otherwise receive its
two gradients in another order).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, List

from deepspeed.runtime.pipe import schedule

if TYPE_CHECKING:
    from deepspeed.runtime.pipe.schedule import PipeInstruction


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
