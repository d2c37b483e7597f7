"""Deferred weight gradients, for the zero-bubble pipeline schedule ZB-H1 (Qi et al. 2023;
launch/analysis/zero_bubble_schedule.py is the schedule, launch/engine/zero_bubble.py runs it,
docs/pipeline-schedules.md explains it).

A linear's backward is B, dL/dX = G W (which the stage before waits for), and W, dL/dW = G^T X
(which nothing needs until the optimizer step). While the store defers (the pipeline's B pass),
`weight_grad_now_or_later` queues W (holding X, or this rank's sequence chunk, and G);
`seal_microbatch` closes a micro-batch's queue and `compute_oldest` (the W pass) adds the oldest
one's gradients to `.grad` as AccumulateGrad would. Micro-batches run in the order they were
deferred, so every gradient is the 1F1B one to the bit. Biases, norms, embeddings and a fused
q/k/v weight built from gathered key/value heads (not a parameter) stay in B.

Gradient-accumulation fusion (Megatron-LM's): a weight that carries `main_grad`, its fp32
gradient in the BF16 optimizer's buffer (launch/optim/main_grad.py), gets its gradient added
there by the weight-gradient GEMM itself (`add_product_into`), in B or in W, and keeps no `.grad`:
no bf16 gradient to allocate, zero, cast and add into fp32 after every micro-batch."""
import contextlib
from collections import deque
from typing import Callable, Deque, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from model.parallel.compile_boundary import opaque_to_compile

# The computation of some weights' gradients: given each weight's fp32 main gradient or None, it
# adds into the main gradients and returns None for them, and returns the others' gradients.
GradCompute = Callable[[Sequence[Optional[torch.Tensor]]], Sequence[Optional[torch.Tensor]]]
# (weights, the computation of their gradients, the tensors it holds until it runs)
GradWork = Tuple[Sequence[torch.nn.Parameter], GradCompute, Sequence[torch.Tensor]]


def main_grads(weights: Sequence[torch.Tensor]) -> List[Optional[torch.Tensor]]:
    """Each weight's fp32 main gradient (`main_grad`, shaped like it), or None where it has none."""
    return [getattr(weight, "main_grad", None) for weight in weights]


def runs_cuda_kernels(tensor: torch.Tensor) -> bool:
    """Whether ops on `tensor` take the CUDA branches: on a GPU, or on the meta device, whose kernels
    check dtypes and shapes as CUDA's do (tests/model/test_cuda_contracts.py runs those branches on CPU)."""
    return tensor.device.type in ("cuda", "meta")


def add_product_into(main: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
    """main += left @ right, (out, N) @ (N, in) -> (out, in), with `main` an fp32 main gradient and
    the operands bf16: the GEMM accumulates into `main` itself (Megatron's gradient-accumulation
    fusion), with no bf16 product, no cast and no separate add over the weight's elements. Inside a
    compiled block, one opaque op (`gpt3d::add_product_into`) that runs this same code."""
    if torch.compiler.is_compiling():
        torch.ops.gpt3d.add_product_into(main, left, right)
    else:
        _add_product_into(main, left, right)


# Dynamo cannot trace the probe below (try/except on kernels a build may lack): as a custom op with
# its mutation declared, the compiled backward calls the eager code at run time and the block stays
# one graph (torch.library.custom_op, torch >= 2.4).
@torch.library.custom_op("gpt3d::add_product_into", mutates_args=("main",))
def _add_product_op(main: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
    _add_product_into(main, left, right)


@_add_product_op.register_fake
def _(main: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
    return None


def _add_product_into(main: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
    if runs_cuda_kernels(main) and left.dtype != main.dtype:
        _MIXED_GEMMS[mixed_gemm_path(main.device)](main, left, right)
    else:  # no mixed-dtype addmm on CPU: the operands (activation-sized) cast to fp32, where bf16 is
        # exact, so this is the CUDA kernel's fp32 sum of exact products, up to summation order
        main.addmm_(left.to(main.dtype), right.to(main.dtype))


# The ways to add a bf16 product into an fp32 matrix on a GPU, best first. cuBLAS takes bf16
# operands with fp32 accumulation and output (aten::addmm.dtype_out); torch builds that accept an
# fp32 `self` for it do it in one GEMM. Older ones require `self` in the operands' dtype: then the
# fp32 product is a temporary added once (mm.dtype), or, without that, the bf16 product.
_MIXED_GEMMS = {
    "addmm-out-fp32": lambda main, a, b: torch.addmm(main, a, b, out_dtype=main.dtype, out=main),
    "mm-fp32-then-add": lambda main, a, b: main.add_(torch.mm(a, b, out_dtype=main.dtype)),
    "mm-then-add": lambda main, a, b: main.add_(torch.mm(a, b)),
}
_CHOSEN_PATH = {}


def runs_right(add: Callable[[], object], main: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether `add()` runs in this torch build and leaves `want` in `main`; on the meta device,
    which holds no values, whether it runs (its dtype and shape checks pass)."""
    try:
        add()
    except (RuntimeError, TypeError):  # an overload or kernel this build does not have
        return False
    return main.device.type == "meta" or torch.equal(main, want)


def first_that_runs_right(ways: Dict[str, Callable], trial: Callable[[str, Callable], bool], device: torch.device,
                          what: str) -> str:
    """The name of the first of `ways` whose `trial(name, way)` holds (runs_right on a small product,
    whose expected sums may depend on the way); a RuntimeError naming `what` when none does."""
    for name, way in ways.items():
        if trial(name, way):
            return name
    raise RuntimeError(f"no way to add {what} into an fp32 gradient on {device}: set train.grad_accum_fusion: false")


def mixed_gemm_path(device: torch.device) -> str:
    """The first of `_MIXED_GEMMS` this torch runs correctly on `device`, tried once on a 2 x 2
    product (bench/gpu/gpu_check.py reports which, and its error against an fp32 GEMM)."""
    if device.type not in _CHOSEN_PATH:
        a = torch.tensor([[1.0, 2.0], [3.0, 4.0]], device=device, dtype=torch.bfloat16)
        want = torch.tensor([[8.0, 11.0], [16.0, 23.0]], device=device)

        def trial(name: str, add: Callable) -> bool:
            main = torch.ones(2, 2, device=device)
            return runs_right(lambda: add(main, a, a), main, want)
        _CHOSEN_PATH[device.type] = first_that_runs_right(_MIXED_GEMMS, trial, device, "a bf16 product")
    return _CHOSEN_PATH[device.type]


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

    def weight_grads_now_or_later(self, weights: Sequence[torch.Tensor], compute: GradCompute,
                                  holds: Sequence[torch.Tensor]) -> Sequence[Optional[torch.Tensor]]:
        """The gradients of `weights` for a backward to return: computed now (None for a weight
        with a main gradient: added into it), or, in a run that defers (`enabled`), while deferring
        and when every weight is a parameter (a leaf), Nones and the work queued. `holds`: the
        tensors `compute` reads (a linear's input and output gradient), which a deferred
        computation keeps alive until its W pass (`held_bytes`)."""
        if not self.enabled:  # compiled blocks keep this W in their backward graph
            return compute(main_grads(weights))
        return self._now_or_later(weights, compute, holds)

    # Opaque to torch.compile, in a run that defers only: traced, the deferral flag would be read
    # once, at a compiled block's first forward (AOT autograd traces the backward there, outside any
    # B pass), and baked into the backward graph. Dynamo cannot trace a backward that calls this, so
    # the linear's autograd Function runs eagerly between the compiled parts of the block and reads
    # the flag when B runs. Without deferral the add is `add_product_into`'s op, inside the graph.
    @opaque_to_compile
    def _now_or_later(self, weights: Sequence[torch.Tensor], compute: GradCompute,
                      holds: Sequence[torch.Tensor]) -> Sequence[Optional[torch.Tensor]]:
        if self.enabled and self._deferring and all(w.is_leaf and w.requires_grad for w in weights):
            self._open.append((weights, compute, holds))
            return [None] * len(weights)
        return compute(main_grads(weights))

    def seal_microbatch(self) -> None:
        """The B pass of one micro-batch is done: its queue is one W pass."""
        self._sealed.append(self._open)
        self._open = []

    def compute_oldest(self) -> int:
        """The W pass: compute the oldest sealed micro-batch's weight gradients into their main
        gradients, or `.grad` where they have none; return how many."""
        computed = 0
        with torch.no_grad():
            for weights, compute, _ in self._sealed.popleft():
                for weight, grad in zip(weights, compute(main_grads(weights))):
                    if grad is not None:  # None: added into the weight's main gradient
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


def weight_grad_now_or_later(weight: torch.Tensor, compute: Callable[[Optional[torch.Tensor]], Optional[torch.Tensor]],
                             holds: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """`WEIGHT_GRADS.weight_grads_now_or_later` for one weight: compute(main gradient or None)."""
    return WEIGHT_GRADS.weight_grads_now_or_later([weight], lambda mains: [compute(mains[0])], holds)[0]


def linear_weight_grad(x_2d: torch.Tensor, grad_2d: torch.Tensor, main: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """dL/dW of functional.linear from its (N, in) input and (N, out) output gradient: (out, in),
    computed as autograd computes it ((X^T G)^T, so the same to the bit), or added into the fp32
    main gradient `main` (then None)."""
    if main is None:
        return x_2d.t().mm(grad_2d).t()
    add_product_into(main, grad_2d.t(), x_2d)
    return None


class DeferrableLinear(torch.autograd.Function):
    """functional.linear (x (..., in), W (out, in), b (out,) -> (..., out)) whose weight
    gradient may be deferred. Forward and both gradients are computed with the calls autograd
    uses for functional.linear (addmm/mm on the flattened input; dL/dW as (X^T G)^T), so the
    numbers are the same to the bit as functional.linear's, deferred or not.

    `dtype` (the MoE router's fp32): x and W are cast to it for the products (the stored ones are
    not), the output is in it, and the gradients come back in x's and W's own dtypes."""

    @staticmethod
    def forward(ctx, x, weight, bias, dtype=None):
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.dtype = bias is not None, dtype
        if dtype is not None:  # a no-op where they are in it already
            x, weight = x.to(dtype), weight.to(dtype)
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):  # grad: (..., out), in ctx.dtype if set
        x, weight = ctx.saved_tensors
        dtype = ctx.dtype or weight.dtype
        grad_2d = grad.reshape(-1, grad.size(-1))  # (N, out)
        grad_x = grad.matmul(weight.to(dtype)).to(x.dtype)  # (..., in)
        grad_bias = grad_2d.sum(0) if ctx.has_bias else None

        def weight_grad(main):  # (out, in), or added into main
            x_2d = x.reshape(-1, x.size(-1)).to(ctx.dtype or x.dtype)  # (N, in); cast here: a deferred W holds x
            grad_weight = linear_weight_grad(x_2d, grad_2d, main)
            return grad_weight if grad_weight is None else grad_weight.to(weight.dtype)
        return grad_x, weight_grad_now_or_later(weight, weight_grad, holds=(x, grad)), grad_bias, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """functional.linear, through `DeferrableLinear` when the run's schedule defers weight gradients
    or the weight's gradient accumulates into its main gradient."""
    if WEIGHT_GRADS.enabled or hasattr(weight, "main_grad"):
        return DeferrableLinear.apply(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


class _MainGradEmbedding(torch.autograd.Function):
    """functional.embedding (ids (...), W (V, h) -> (..., h)) whose gradient, the rows of G summed
    per id, is scattered straight into W's fp32 main gradient (index_add_ over the looked-up rows
    only) instead of a dense (V, h) bf16 gradient built, cast and added per micro-batch."""

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.main_grad = weight.main_grad
        return torch.nn.functional.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):  # grad: (..., h)
        ids, = ctx.saved_tensors
        main = ctx.main_grad
        main.index_add_(0, ids.reshape(-1), grad.reshape(-1, grad.size(-1)).to(main.dtype))
        return None, None


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """functional.embedding, with the gradient added into the weight's main gradient where it has one."""
    if hasattr(weight, "main_grad") and torch.is_grad_enabled():
        return _MainGradEmbedding.apply(ids, weight)
    return torch.nn.functional.embedding(ids, weight)
