"""Deferred weight gradients, for the zero-bubble pipeline schedule ZB-H1 (Qi et al. 2023;
launch/analysis/zero_bubble_schedule.py is the schedule, launch/runtime/zero_bubble.py runs it,
docs/pipeline-schedules.md explains it).

A linear's backward is B, dL/dX = G W (which the stage before waits for), and W, dL/dW = G^T X
(which nothing needs until the optimizer step). While the store defers (the pipeline's B pass),
`weight_grad_now_or_later` queues W (holding X, or this rank's sequence chunk, and G);
`seal_microbatch` closes a micro-batch's queue and `compute_oldest` (the W pass) adds the oldest
one's gradients to `.grad` as AccumulateGrad would. Micro-batches run in the order they were
deferred, so every gradient is the 1F1B one to the bit. Biases, norms, embeddings and a fused
q/k/v weight built from gathered key/value heads (not a parameter) stay in B."""
import contextlib
from collections import deque
from typing import Callable, Deque, Iterator, List, Optional, Sequence, Tuple

import torch

# (weights, the computation of their gradients, the tensors it holds until it runs)
GradWork = Tuple[Sequence[torch.nn.Parameter], Callable[[], Sequence[torch.Tensor]], Sequence[torch.Tensor]]


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """What autograd's AccumulateGrad does with a new gradient: keep it (laid out like the
    parameter: optimizers flatten and view gradients), or add it in place."""
    if param.grad is None:
        param.grad = grad.contiguous()
    else:
        param.grad.add_(grad)


class WeightGradStore:
    """The process's queue of deferred weight-gradient computations, one list per micro-batch."""

    def __init__(self) -> None:
        self.enabled = False
        """The run defers weight gradients: the plain linears go through `DeferrableLinear` and
        the backwards may queue theirs (set by the run's schedule, at build, before any forward)."""
        self._deferring = False
        self._open: List[GradWork] = []
        self._sealed: Deque[List[GradWork]] = deque()

    @contextlib.contextmanager
    def deferring(self) -> Iterator[None]:
        """Within: the linears' backward queues its weight gradients (the B pass)."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False

    def weight_grads_now_or_later(self, weights: Sequence[torch.Tensor], compute: Callable[[], Sequence[torch.Tensor]],
                                  holds: Sequence[torch.Tensor]) -> Sequence[Optional[torch.Tensor]]:
        """The gradients of `weights` for a backward to return: `compute()` now, or, in a run that
        defers (`enabled`), while deferring and when every weight is a parameter (a leaf), Nones
        and the work queued. `holds`: the tensors `compute` reads (a linear's input and output
        gradient), which a deferred computation keeps alive until its W pass (`held_bytes`)."""
        if not self.enabled:  # nothing defers in this run: compiled blocks keep W in their backward graph
            return compute()
        return self._now_or_later(weights, compute, holds)

    # Opaque to torch.compile: traced, the deferral flag would be read once, at a compiled block's
    # first forward (AOT autograd traces the backward there, outside any B pass), and baked into
    # the backward graph. Dynamo cannot trace a backward that calls this, so the linear's autograd
    # Function runs eagerly between the compiled parts of the block and reads the flag when B runs.
    @torch.compiler.disable
    def _now_or_later(self, weights: Sequence[torch.Tensor], compute: Callable[[], Sequence[torch.Tensor]],
                      holds: Sequence[torch.Tensor]) -> Sequence[Optional[torch.Tensor]]:
        if self._deferring and all(w.is_leaf and w.requires_grad for w in weights):
            self._open.append((weights, compute, holds))
            return [None] * len(weights)
        return compute()

    def seal_microbatch(self) -> None:
        """The B pass of one micro-batch is done: its queue is one W pass."""
        self._sealed.append(self._open)
        self._open = []

    def compute_oldest(self) -> int:
        """The W pass: compute the oldest sealed micro-batch's weight gradients into `.grad`;
        return how many."""
        computed = 0
        with torch.no_grad():
            for weights, compute, _ in self._sealed.popleft():
                for weight, grad in zip(weights, compute()):
                    accumulate_grad(weight, grad)
                    computed += 1
        return computed

    def held_bytes(self) -> int:
        """Bytes of the distinct storages the queued computations hold (the memory ZB-H1 adds)."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for work in list(self._sealed) + [self._open] for _, _, holds in work for t in holds}
        return sum(storages.values())

    @property
    def pending(self) -> int:
        """Micro-batches whose weight gradients are still queued."""
        return len(self._sealed) + bool(self._open)


WEIGHT_GRADS = WeightGradStore()


def weight_grad_now_or_later(weight: torch.Tensor, compute: Callable[[], torch.Tensor],
                             holds: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """`WEIGHT_GRADS.weight_grads_now_or_later` for one weight."""
    return WEIGHT_GRADS.weight_grads_now_or_later([weight], lambda: [compute()], holds)[0]


class DeferrableLinear(torch.autograd.Function):
    """functional.linear (x (..., in), W (out, in), b (out,) -> (..., out)) whose weight
    gradient may be deferred. Forward and both gradients are computed with the calls autograd
    uses for functional.linear (addmm/mm on the flattened input; dL/dW as (X^T G)^T), so the
    numbers are the same to the bit as functional.linear's, deferred or not."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):  # grad: (..., out)
        x, weight = ctx.saved_tensors
        grad_2d = grad.reshape(-1, grad.size(-1))  # (N, out)
        grad_x = grad.matmul(weight)  # (..., in)
        grad_bias = grad_2d.sum(0) if ctx.has_bias else None
        grad_weight = weight_grad_now_or_later(
            weight, lambda: x.reshape(-1, x.size(-1)).t().mm(grad_2d).t(), holds=(x, grad))  # (out, in)
        return grad_x, grad_weight, grad_bias


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """functional.linear, through `DeferrableLinear` when the run's schedule defers weight gradients."""
    if WEIGHT_GRADS.enabled:
        return DeferrableLinear.apply(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)
