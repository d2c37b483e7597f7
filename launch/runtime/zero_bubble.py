"""ZB-H1 on one DeepSpeed pipeline engine: the handlers of the B and W instructions of
launch/analysis/zero_bubble_schedule.py (B runs the engine's backward with the linears' weight
gradients deferred, model/weight_grad.py; W computes the oldest deferred micro-batch's), and the
engine's train schedule swapped for ZeroBubbleH1Schedule.
"""
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

from launch.analysis.zero_bubble_schedule import BackwardInputPass, WeightPass, ZeroBubbleH1Schedule
from model.weight_grad import WEIGHT_GRADS


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
