"""Tensor-parallel layers (Megatron-LM, Shoeybi et al. 2019), built on `model/parallel/mappings.py`;
the vocab-parallel embedding is model/parallel/vocab_embedding.py.

- Layout-invariant init (docs/design.md contract 2): each layer draws its full weight from the
  generator it is given and keeps only its shard, so step-0 weights are the same at every tp.
- Sharded parameters carry `tensor_model_parallel = True` (and Megatron's `partition_dim` /
  `partition_stride`), which DeepSpeed's gradient norm needs to count them on every TP rank
  (contract 5).
- Sequence parallelism (Korthikanti et al. 2022, contract 11): replicated parameters used on a
  sequence chunk carry `sequence_parallel = True`; their gradients are summed over TP once per
  step (`sequence_parallel_params`), not per micro-batch.
- Under ZB-H1 each linear may defer its weight gradient to a W pass, and in bf16 each adds its
  weight gradient straight into the fp32 main gradient (model/parallel/weight_grad.py)."""
from typing import List, Optional, Sequence

import torch
import torch.nn as nn
from torch.nn import functional
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from model.parallel.mappings import (Group, all_gather_sequence, gather_from_tp_region,
                                     reduce_from_tp_region, reduce_scatter_sequence,
                                     reduce_scatter_to_sequence_parallel_region, start_all_reduce)
from model.parallel.weight_grad import (WEIGHT_GRADS, add_product_into, linear, linear_weight_grad,
                                       weight_grad_now_or_later)


def group_size(group: Group) -> int:
    return 1 if group is None else torch.distributed.get_world_size(group)


def group_rank(group: Group) -> int:
    return 0 if group is None else torch.distributed.get_rank(group)


def split_rows(full: torch.Tensor, tp_rank: int, tp_size: int, stride: int = 1,
               sections: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Rank `tp_rank`'s share of dim 0 of `full`, taken from each of `stride` equal blocks, or
    from each block of `sections` rows when the blocks differ in size.

    stride=3 shards GPT-2's fused [Q; K; V] weight so that each rank gets [Q_r; K_r; V_r], i.e.
    whole attention heads (Megatron's `stride`); sections=(a*d, kv*d, kv*d) does the same for
    Llama's, whose key/value blocks are smaller with grouped-query attention.
    """
    blocks = full.split(list(sections), dim=0) if sections else full.chunk(stride, dim=0)
    return torch.cat([b.chunk(tp_size, dim=0)[tp_rank] for b in blocks], dim=0).contiguous()


def shard_rows(full: torch.Tensor, group: Group, stride: int = 1, sections: Optional[Sequence[int]] = None) -> torch.Tensor:
    """This rank's share of dim 0 of `full` (see `split_rows`)."""
    return split_rows(full, group_rank(group), group_size(group), stride, sections)


def mark_sequence_parallel(param: nn.Parameter, group: Group) -> None:
    """`param` is replicated over TP but, under sequence parallelism (`group` not None), used on
    this rank's sequence chunk only: its gradient must be summed over TP (once per step)."""
    if group is not None and param is not None:
        param.sequence_parallel = True


def sequence_parallel_params(module: nn.Module) -> List[nn.Parameter]:
    return [p for p in module.parameters() if getattr(p, "sequence_parallel", False)]


def allreduce_sequence_parallel_grads(module: nn.Module, tp_group: Group) -> None:
    """Sum the gradients of `module`'s sequence-parallel parameters over TP, in one all-reduce:
    after backward, for a model trained without DeepSpeed's pipeline engine (tests, benches)."""
    grads = [p.grad for p in sequence_parallel_params(module) if p.grad is not None]
    if tp_group is None or not grads:
        return
    flat = _flatten_dense_tensors(grads)
    torch.distributed.all_reduce(flat, group=tp_group)
    for grad, summed in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(summed)


def mark_tensor_parallel(param: nn.Parameter, partition_dim: int, stride: int = 1, sections: Optional[Sequence[int]] = None) -> None:
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = stride
    if sections:  # the full rows of each block that is split on its own (`split_rows`)
        param.partition_sections = tuple(sections)


class _SequenceGatherLinear(torch.autograd.Function):
    """Y = [X_1; ...; X_t] A^T + b from this rank's sequence chunk X_r: (B, T/t, in) -> (B, T, out/p).

    Saves only X_r and all-gathers it again in backward instead of keeping the gathered
    (B, T, in) input: that is what makes the LayerNorm-output activations 1/t per rank
    (K22 sec. 4.2). dL/dX is a partial sum over this rank's output columns, so it is
    reduce-scattered back to the sequence chunks."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return functional.linear(all_gather_sequence(x, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):  # grad: (B, T, out/p)
        x, weight = ctx.saved_tensors
        group = ctx.group
        grad_x = reduce_scatter_sequence(grad.matmul(weight), group)  # (B, T/t, in)
        grad_2d = grad.reshape(-1, grad.size(-1))  # (B*T, out/p)
        grad_bias = grad_2d.sum(0) if ctx.has_bias else None

        def weight_grad(main):  # gathers the sequence when it runs: a deferred W pass keeps only x
            x_full = all_gather_sequence(x, group)  # (B, T, in)
            x_2d = x_full.reshape(-1, x_full.size(-1))  # (B*T, in)
            if main is None:
                return grad_2d.t().matmul(x_2d)  # (out/p, in)
            add_product_into(main, grad_2d.t(), x_2d)
        return grad_x, weight_grad_now_or_later(weight, weight_grad, holds=(x, grad)), grad_bias, None


class ColumnParallelLinear(nn.Module):
    """Y = XA^T + b with A split by output rows: A = [A_1; ...; A_p], Y_i = X A_i^T + b_i.

    Input (..., in) replicated on the TP group; output (..., out/p) sharded, or (..., out) when
    `gather_output`. Backward all-reduces dL/dX (Megatron's f) while it computes dL/dA
    (`column_parallel_projections`). With `sequence_parallel`
    the input is this rank's (B, T/t, in) sequence chunk, all-gathered before the matmul
    (backward: reduce-scatter).

    `sections` fuses several linears of one input into one GEMM (Llama's q/k/v, gate/up): the
    output is their outputs side by side, each drawn in turn from the generator as its own
    linear would be, and each split over TP on its own (`split_rows`), so rank r's rows are
    [A_1,r; A_2,r; ...] and its output columns hold its share of every part.
    """

    def __init__(self, in_features: int, out_features: int, tp_group: Group,
                 generator: torch.Generator, init_std: float, bias: bool = True,
                 gather_output: bool = False, stride: int = 1, sequence_parallel: bool = False,
                 sections: Optional[Sequence[int]] = None):
        super().__init__()
        tp_size = group_size(tp_group)
        assert out_features % (tp_size * stride) == 0, (out_features, tp_size, stride)
        assert not sections or (sum(sections) == out_features and all(n % tp_size == 0 for n in sections)), sections
        assert not (gather_output and sequence_parallel), "SP feeds a row-parallel layer"
        self.tp_group = tp_group
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel and tp_group is not None
        self.output_size_per_partition = out_features // tp_size
        full = torch.cat([torch.empty(n, in_features).normal_(0.0, init_std, generator=generator)
                          for n in (sections or [out_features])])
        self.weight = nn.Parameter(shard_rows(full, tp_group, stride, sections))  # (out/p, in)
        mark_tensor_parallel(self.weight, partition_dim=0, stride=stride, sections=sections)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition))
            mark_tensor_parallel(self.bias, partition_dim=0, stride=stride, sections=sections)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:  # (B, T/t, in) -> (B, T, out/p)
            return _SequenceGatherLinear.apply(x, self.weight, self.bias, self.tp_group)
        y, = column_parallel_projections(x, [(self.weight, self.bias)], self.tp_group, sequence_parallel=False)
        return gather_from_tp_region(y, self.tp_group) if self.gather_output else y


class _SequenceGatherLinears(torch.autograd.Function):
    """`_SequenceGatherLinear` for several weights that read the same input (q, k, v; gate, up):
    one all-gather of the sequence in forward and one in backward for all of them, and only this
    rank's (B, T/t, in) chunk saved. Arguments after the group: n, then n weights, then n biases
    (None where a linear has none); returns the n outputs (B, T, out_i)."""

    @staticmethod
    def forward(ctx, x, group, n, *params):
        weights, biases = params[:n], params[n:]
        ctx.save_for_backward(x, *weights)
        ctx.group, ctx.has_bias = group, [b is not None for b in biases]
        x_full = all_gather_sequence(x, group)
        return tuple(functional.linear(x_full, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        group = ctx.group
        grad_x_full = sum(g.matmul(w) for g, w in zip(grads, weights))
        grads_2d = [grad.reshape(-1, grad.size(-1)) for grad in grads]
        grad_biases = [grad_2d.sum(0) if has_bias else None for grad_2d, has_bias in zip(grads_2d, ctx.has_bias)]

        def weight_grads(mains):  # one sequence gather for all the weights, when it runs (B or W pass)
            x_full = all_gather_sequence(x, group)
            x_2d = x_full.reshape(-1, x_full.size(-1))
            return [grad_2d.t().matmul(x_2d) if main is None else add_product_into(main, grad_2d.t(), x_2d)
                    for grad_2d, main in zip(grads_2d, mains)]  # None where added into the main gradient
        grad_weights = WEIGHT_GRADS.weight_grads_now_or_later(weights, weight_grads, holds=(x, *grads))
        return (reduce_scatter_sequence(grad_x_full, group), None, None, *grad_weights, *grad_biases)


class _OverlappedLinears(torch.autograd.Function):
    """Several column-parallel linears of one replicated input, without sequence parallelism:
    (B, T, in) -> n x (B, T, out_i/p). Backward starts the all-reduce of dL/dX = sum_i G_i A_i
    over TP (Megatron's f), computes the weight and bias gradients while it runs, then waits:
    Megatron-LM's asynchronous grad-input all-reduce (LinearWithGradAccumulationAndAsyncCommunication).
    dL/dW is `linear_weight_grad`'s, as DeferrableLinear's (the calls autograd uses for
    functional.linear), and may be deferred (ZB-H1) or added into a main gradient as there.
    Arguments after the group: n, then n weights, then n biases (None where a linear has none)."""

    @staticmethod
    def forward(ctx, x, group, n, *params):
        weights, biases = params[:n], params[n:]
        ctx.save_for_backward(x, *weights)
        ctx.group, ctx.has_bias = group, [b is not None for b in biases]
        return tuple(functional.linear(x, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads):  # each (B, T, out_i/p)
        x, *weights = ctx.saved_tensors
        grad_x = grads[0].matmul(weights[0])  # (B, T, in): this rank's partial sum
        for grad, weight in zip(grads[1:], weights[1:]):
            grad_x += grad.matmul(weight)
        pending = start_all_reduce(grad_x, ctx.group)
        grads_2d = [grad.reshape(-1, grad.size(-1)) for grad in grads]  # (N, out_i/p)

        def weight_grads(mains):  # (out_i/p, in) each, or added into its main gradient (None)
            x_2d = x.reshape(-1, x.size(-1))  # (N, in)
            return [linear_weight_grad(x_2d, grad_2d, main) for grad_2d, main in zip(grads_2d, mains)]
        grad_weights = WEIGHT_GRADS.weight_grads_now_or_later(weights, weight_grads, holds=(x, *grads))
        grad_biases = [grad_2d.sum(0) if has_bias else None for grad_2d, has_bias in zip(grads_2d, ctx.has_bias)]
        if pending is not None:
            pending.wait()
        return (grad_x, None, None, *grad_weights, *grad_biases)


def column_parallel_projections(x: torch.Tensor, params, tp_group: Group, sequence_parallel: bool):
    """[X A_i^T + b_i for (A_i, b_i) in params]: several column-parallel linears of one input,
    which is copied to the TP region (or, with sequence parallelism, all-gathered) once for all.
    Under TP the backward's all-reduce of dL/dX runs while the weight gradients are computed."""
    if tp_group is None:
        return [linear(x, weight, bias) for weight, bias in params]
    weights, biases = zip(*params)
    if sequence_parallel:  # (B, T/t, in) -> n x (B, T, out_i/p)
        return list(_SequenceGatherLinears.apply(x, tp_group, len(params), *weights, *biases))
    return list(_OverlappedLinears.apply(x, tp_group, len(params), *weights, *biases))


class RowParallelLinear(nn.Module):
    """Y = XA^T + b with A split by input columns: A = [A_1 ... A_p], Y = sum_i X_i A_i^T + b.

    Input (..., in/p) already sharded (the output of a ColumnParallelLinear); output (..., out)
    replicated after one all-reduce. The bias is added after the reduce, so it is replicated
    and is not marked as TP-split. With `sequence_parallel` the all-reduce becomes a
    reduce-scatter along the sequence: output (B, T/t, out), this rank's chunk.
    """

    def __init__(self, in_features: int, out_features: int, tp_group: Group,
                 generator: torch.Generator, init_std: float, bias: bool = True,
                 sequence_parallel: bool = False):
        super().__init__()
        tp_size = group_size(tp_group)
        assert in_features % tp_size == 0, (in_features, tp_size)
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel and tp_group is not None
        self.input_size_per_partition = in_features // tp_size
        full = torch.empty(out_features, in_features).normal_(0.0, init_std, generator=generator)
        self.weight = nn.Parameter(shard_rows(full.t(), tp_group).t().contiguous())  # (out, in/p)
        mark_tensor_parallel(self.weight, partition_dim=1)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        mark_sequence_parallel(self.bias, tp_group if self.sequence_parallel else None)

    def forward(self, x_parallel: torch.Tensor) -> torch.Tensor:
        partial = linear(x_parallel, self.weight)  # (B, T, out): this rank's partial sum
        if not self.sequence_parallel:
            y = reduce_from_tp_region(partial, self.tp_group)
            return y if self.bias is None else y + self.bias
        y = reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)  # (B, T/t, out)
        return y if self.bias is None else y + self.bias  # meets this rank's chunk only: marked
