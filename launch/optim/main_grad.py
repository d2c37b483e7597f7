"""Gradient-accumulation fusion (Megatron-LM's `--gradient-accumulation-fusion`) on
DeepSpeed's BF16 optimizer, `train.grad_accum_fusion` (docs/design.md contract 8).

Without it, every micro-batch's backward zeroes each parameter's bf16 `.grad` and adds into it,
and the optimizer then casts it to fp32 and adds it into its fp32 gradient buffer: element-wise
passes over every parameter per micro-batch (tests/model/test_grad_accum_fusion.py counts them). With
it, every parameter gets `main_grad`, its fp32 gradient: a view of the optimizer's flat buffer,
shaped like the parameter. Our linears' weight-gradient GEMMs add into it, and the token
embedding's lookup scatters into it (model/parallel/weight_grad.py: eagerly, in ZB-H1's W pass, under
recompute, the tied output layer, with sequence parallelism), leaving `.grad` None, which the
optimizer's per-micro-batch `update_hp_grads` skips. The other gradients (biases, norms, learned
positions) still come through `.grad` and are added into the same buffer as without the fusion, so the buffer
holds the same sum. Everything after backward already reads that buffer: the data-parallel
all-reduce (`get_grads_for_reduction`), the tied and sequence-parallel all-reduces (`_hp_grad`),
the gradient norm, clipping and the step.
"""
import torch
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer


def attach_main_grads(optimizer) -> bool:
    """Give every parameter of `optimizer` (DeepSpeed's BF16 optimizer accumulating in fp32) its
    fp32 gradient as `main_grad`; return whether it did (not for fp32 or fp16 runs, whose
    optimizers keep the gradient in `.grad`: nothing to fuse). Call once, after deepspeed.initialize."""
    if not isinstance(optimizer, BF16_Optimizer) or optimizer.grad_acc_dtype != torch.float32 \
            or not optimizer.using_real_optimizer:
        return False
    for group, grads in zip(optimizer.bf16_groups, optimizer.fp32_groups_gradients):
        for param, grad in zip(group, grads):
            param.main_grad = grad.view(param.shape)  # (numel,) slice of the flat fp32 buffer
            # What DeepSpeed's tied-weight all-reduce reads (set by `_update_hp_grad`, which a
            # gradient that never passes through `.grad` does not reach).
            param._hp_grad = param.main_grad
    clear_hp_grads = optimizer.clear_hp_grads

    def clear_hp_grads_and_count_them():
        clear_hp_grads()
        _count_every_gradient(optimizer)
    optimizer.clear_hp_grads = clear_hp_grads_and_count_them  # after every step and zero_grad
    _count_every_gradient(optimizer)
    optimizer.accumulates_into_main_grads = True
    return True


def _count_every_gradient(optimizer: BF16_Optimizer) -> None:
    """The norm and clipping take a parameter's fp32 gradient only where `fp32_groups_has_gradients`
    says it has one, which `_update_hp_grad` sets for a `.grad` it adds: a main gradient is filled
    without it. Every parameter of the run gets a gradient every step, so every one is counted."""
    optimizer.fp32_groups_has_gradients = [[True] * len(group) for group in optimizer.bf16_groups]


def accumulates_into_main_grads(optimizer) -> bool:
    """Whether `attach_main_grads` fused this optimizer's gradient accumulation."""
    return getattr(optimizer, "accumulates_into_main_grads", False)
