"""The global gradient norm and clipping for ZeRO stage 0 in fp32, where DeepSpeed has neither.

DeepSpeed 0.19.8 runs fp32 ZeRO-0 with the bare torch optimizer: `engine.get_global_grad_norm()`
stays None, and its clipping (`runtime/utils.py: clip_grad_norm_`) counts replicated parameters
only on model-parallel rank 0, i.e. on the first pipeline stage (docs/design.md contract 5). Here
DeepSpeed's clipping is switched off for that mode and this hook, run just before each optimizer
step (gradients already all-reduced over dp and between the tied embeddings' stages), computes
the norm with ZeRO-1's counting rule and clips with it:
- a TP-sharded parameter (`tensor_model_parallel`) counts on every TP rank (each holds a shard);
- a replicated one counts on TP rank 0 of each stage only;
- a pipeline-replicated copy (`ds_pipe_replicated`: the tied embedding's second stage) not at all;
then the squares are summed over the model-parallel group (every TP rank of every stage). An expert
parameter of a mixture of experts (model/transformer/moe.py) holds different experts on the ranks of its
expert-parallel group: its squares are summed over that group too, so each expert counts once.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # annotations only: no import cost at run time
    from deepspeed.runtime.pipe.engine import PipelineEngine


def uses_own_grad_norm(zero_stage: int, precision: str) -> bool:
    """fp32 ZeRO-0 is the one mode without a DeepSpeed optimizer wrapper that computes the norm."""
    return zero_stage == 0 and precision == "fp32"


class Zero0GradNorm:
    """Install with `Zero0GradNorm(engine, tp_rank, grad_clip, ep_group)`; `value` is the last step's norm."""

    def __init__(self, engine: PipelineEngine, tp_rank: int, grad_clip: float, ep_group=None):
        self.module, self.mpu, self.tp_rank, self.grad_clip = engine.module, engine.mpu, tp_rank, grad_clip
        self.ep_group = ep_group
        self.value: Optional[float] = None
        engine.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: self._before_step())

    def _counted_here(self, p: torch.nn.Parameter) -> bool:
        if getattr(p, "ds_pipe_replicated", False):
            return False
        return getattr(p, "tensor_model_parallel", False) or self.tp_rank == 0

    def _before_step(self) -> None:
        from model.transformer.moe import is_expert_param
        params = [p for p in self.module.parameters() if p.grad is not None]
        grads = [p.grad for p in params]
        squares = torch.zeros(2, dtype=torch.float32, device=grads[0].device if grads else "cpu")  # dense, experts
        for p in params:
            if self._counted_here(p):
                squares[int(is_expert_param(p))] += p.grad.detach().float().pow(2).sum()
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=self.mpu.get_model_parallel_group())
        dense, experts = squares.unbind()
        if self.ep_group is not None:
            experts = experts.clone().reshape(1)
            dist.all_reduce(experts, op=dist.ReduceOp.SUM, group=self.ep_group)
        norm = math.sqrt((dense + experts.sum()).item())
        self.value = norm
        if self.grad_clip > 0:
            coef = self.grad_clip / (norm + 1e-6)  # torch's and DeepSpeed's clip_grad_norm_ rule
            if coef < 1.0:
                for g in grads:
                    g.detach().mul_(coef)


def last_grad_norm(engine: PipelineEngine, own: Optional[Zero0GradNorm]) -> float:
    """The last step's global gradient norm: ours in fp32 ZeRO-0 (build_engine returns it), else DeepSpeed's."""
    return float(own.value if own is not None else engine.get_global_grad_norm())
