"""The experts' GEMMs (model/transformer/moe.py): Y_g = X_g W_g^T for each local expert g's consecutive
rows, as one grouped GEMM (`functional.grouped_mm`) where torch runs it well, else a GEMM per expert;
the weight gradient deferrable to ZB-H1's W pass or added into the fp32 main gradient (bf16
gradient-accumulation fusion, model/parallel/weight_grad.py), as a linear's.

The CUDA branches are chosen by `runs_cuda_kernels`, which takes the meta device for CUDA: its kernels
check dtypes and shapes as CUDA's do, so tests/model/test_cuda_contracts.py runs them on CPU.
"""
from typing import Callable, List, NamedTuple, Optional

import torch
from torch.nn import functional

from model.parallel.weight_grad import (add_product_into, first_that_runs_right, runs_cuda_kernels, runs_right,
                                        weight_grad_now_or_later)


class ExpertRows(NamedTuple):
    """The rows of each local expert in the two forms the GEMMs take: `offsets`, (E_local,) int32 on
    the device, where each expert's rows end (the grouped GEMM's: a cumsum of the counts, no host
    copy), and `sizes`, the same counts as host ints (the GEMMs per expert split by them)."""
    offsets: torch.Tensor
    sizes: List[int]


def expert_rows(counts: torch.Tensor, sizes: List[int]) -> ExpertRows:
    """(E_local,) row counts on the device and the same as host ints -> ExpertRows."""
    return ExpertRows(counts.cumsum(0).to(torch.int32), sizes)


def grouped_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM (one kernel for all experts) runs these operands well: it exists
    in this torch and its rows are 16-byte aligned. On a GPU only torch's own kernel counts, bf16 on
    compute capability 9.x or 10.x: elsewhere torch loops over the groups after copying the offsets to
    the host (a sync per GEMM), so a GEMM per expert, on the sizes already on the host, is better.
    The meta device stands for such a GPU (its checks are that kernel's). Inside a compiled block
    (train.compile) the compiler takes it in bf16 only."""
    if not hasattr(functional, "grouped_mm"):
        return False
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return False
    if any(n * x.element_size() % 16 for n in weight.shape[1:]):
        return False
    if not runs_cuda_kernels(x):
        return True
    return x.dtype == torch.bfloat16 and (x.device.type == "meta" or torch.cuda.get_device_capability(x.device)[0] in (9, 10))


def _gemm_per_expert_into(main, left, right, offsets, sizes) -> None:
    # each expert's product added by the dense fused GEMM: fp32 accumulation where the dense probe found it
    for e, (left_e, right_e) in enumerate(zip(left.split(sizes, dim=1), right.split(sizes))):
        add_product_into(main[e], left_e, right_e)


# The ways to add bf16 expert products into their fp32 main gradient on a GPU, best first. torch 2.13's
# grouped GEMM writes only its inputs' dtype ("Grouped gemm output dtype must match `mat_a` dtype";
# meta: "If output dtype provided, it must be torch.bfloat16"), so fp32 accumulation is a GEMM per expert
# (add_product_into's probed path); failing that, the grouped bf16 product added, rounded once per
# expert as without the fusion. Arguments: main (E, out, in) fp32, left (out, M), right (M, in), the
# offsets and sizes of the M rows.
_GROUPED_MIXED_GEMMS = {
    "gemm-per-expert": _gemm_per_expert_into,
    "grouped-bf16-then-add": lambda main, left, right, offsets, sizes: main.add_(
        functional.grouped_mm(left, right, offs=offsets)),
}
_CHOSEN_GROUPED_PATH = {}


def grouped_gemm_path(device: torch.device) -> str:
    """The first of `_GROUPED_MIXED_GEMMS` that runs on `device` and sums as it promises (fp32, or
    the product rounded to bf16 for the last), tried once on two experts whose first product,
    1 + 2**-8, is exact in fp32 and 1 in bf16."""
    if device.type not in _CHOSEN_GROUPED_PATH:
        grad, x = torch.zeros(16, 8), torch.zeros(16, 8)  # (M, out), (M, in): 16-byte rows, 8 per expert
        grad[0, 0], grad[1, 0], grad[8, 1] = 1.0, 2.0 ** -8, 3.0
        x[0, 0], x[1, 0], x[8, 2] = 1.0, 1.0, 5.0
        exact = torch.zeros(2, 8, 8)
        exact[0, 0, 0], exact[1, 1, 2] = 1.0 + 2.0 ** -8, 15.0
        wants = {"gemm-per-expert": exact, "grouped-bf16-then-add": exact.bfloat16().float()}
        grad, x = grad.bfloat16().to(device), x.bfloat16().to(device)
        offsets = torch.tensor([8, 16], dtype=torch.int32, device=device)

        def trial(name: str, add: Callable) -> bool:
            main = torch.zeros(2, 8, 8, device=device)
            return runs_right(lambda: add(main, grad.t(), x, offsets, [8, 8]), main, wants[name].to(device))
        _CHOSEN_GROUPED_PATH[device.type] = first_that_runs_right(_GROUPED_MIXED_GEMMS, trial, device,
                                                                  "bf16 expert products")
    return _CHOSEN_GROUPED_PATH[device.type]


def add_grouped_product_into(main: torch.Tensor, left: torch.Tensor, right: torch.Tensor,
                             offsets: Optional[torch.Tensor], sizes: List[int], path: Optional[str] = None) -> None:
    """main[g] += left_g @ right_g for each expert g: main (E, out, in) fp32, left (out, M) and right
    (M, in) cut at the experts' rows (`offsets` for a grouped GEMM, None for a GEMM per expert).
    `path`: one of `_GROUPED_MIXED_GEMMS` instead of the probed one (tests). Inside a compiled block,
    one opaque op, as `add_product_into`."""
    if torch.compiler.is_compiling():
        torch.ops.gpt3d.add_grouped_product_into(main, left, right, offsets, sizes, path)
    else:
        _add_grouped_product_into(main, left, right, offsets, sizes, path)


# As weight_grad.py's `gpt3d::add_product_into`: the probe and the CPU grouped GEMM in fp32 (which
# fake tensors refuse) run eagerly inside the compiled backward, one op with its mutation declared.
@torch.library.custom_op("gpt3d::add_grouped_product_into", mutates_args=("main",))
def _add_grouped_product_op(main: torch.Tensor, left: torch.Tensor, right: torch.Tensor, offsets: Optional[torch.Tensor],
                            sizes: List[int], path: Optional[str]) -> None:
    _add_grouped_product_into(main, left, right, offsets, sizes, path)


@_add_grouped_product_op.register_fake
def _(main, left, right, offsets, sizes, path) -> None:
    return None


def _add_grouped_product_into(main: torch.Tensor, left: torch.Tensor, right: torch.Tensor,
                              offsets: Optional[torch.Tensor], sizes: List[int], path: Optional[str]) -> None:
    if offsets is None:
        _gemm_per_expert_into(main, left, right, offsets, sizes)
    elif runs_cuda_kernels(main) and left.dtype != main.dtype:
        _GROUPED_MIXED_GEMMS[path or grouped_gemm_path(main.device)](main, left, right, offsets, sizes)
    else:  # CPU: the operands in fp32, where a bf16 product is exact (add_product_into's rule)
        main.add_(functional.grouped_mm(left.to(main.dtype), right.to(main.dtype), offs=offsets))


class _GroupedLinear(torch.autograd.Function):
    """X (M, in) in groups of expert rows, W (E_local, out, in) -> (M, out); one grouped GEMM per
    product when `offsets` is given, else a GEMM per expert of `sizes` rows."""

    @staticmethod
    def forward(ctx, x, weight, offsets, sizes):
        ctx.save_for_backward(x, weight)
        ctx.offsets, ctx.sizes = offsets, sizes
        if offsets is not None:
            return functional.grouped_mm(x, weight.transpose(1, 2), offs=offsets)
        return torch.cat([functional.linear(x_g, w_g) for x_g, w_g in zip(x.split(sizes), weight)])

    @staticmethod
    def backward(ctx, grad):  # grad: (M, out)
        x, weight = ctx.saved_tensors
        offsets, sizes = ctx.offsets, ctx.sizes
        grad = grad.contiguous()
        if offsets is not None:
            grad_x = functional.grouped_mm(grad, weight, offs=offsets)  # (M, in)
        else:
            grad_x = torch.cat([g.matmul(w_g) for g, w_g in zip(grad.split(sizes), weight)])

        def weight_grad(main):  # G_g^T X_g per expert, (E_local, out, in), or added into main; no rows: zero
            if main is not None:
                add_grouped_product_into(main, grad.t(), x, offsets, sizes)
                return None
            if offsets is not None:  # the rows (dim K of the product) cut at the offsets
                return functional.grouped_mm(grad.t(), x, offs=offsets)
            out = torch.empty_like(weight)
            for e, (g, x_g) in enumerate(zip(grad.split(sizes), x.split(sizes))):
                torch.mm(g.t(), x_g, out=out[e])
            return out
        return grad_x, weight_grad_now_or_later(weight, weight_grad, holds=(x, grad)), None, None


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, rows: ExpertRows) -> torch.Tensor:
    """(M, in) rows grouped by expert, (E_local, out, in) -> (M, out): each group through its expert,
    by one grouped GEMM where it fits (`grouped_mm_fits`), else a GEMM per expert."""
    return _GroupedLinear.apply(x, weight, rows.offsets if grouped_mm_fits(x, weight) else None, rows.sizes)
