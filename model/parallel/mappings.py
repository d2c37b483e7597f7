"""Megatron's conjugate collectives for the tensor-parallel region (Shoeybi et al. 2019, sec. 3)
and for sequence parallelism (Korthikanti et al. 2022, "K22", sec. 4.2).

Sequence parallelism shards the LayerNorm / dropout / residual regions of a block along the
sequence (dim 1 of our batch-first (B, T, h) activations): where plain TP all-reduces a
row-parallel output, SP reduce-scatters it along the sequence, and where plain TP copies the
input of a column-parallel linear, SP all-gathers the sequence. An all-reduce is a
reduce-scatter followed by an all-gather, so SP moves the same bytes as TP (K22 sec. 4.2).

The all-to-alls of context and expert parallelism are model/parallel/all_to_all.py.

Three tiers, as in Megatron core: a private helper that does the communication, a private
autograd Function whose forward and backward are one line each, and a public wrapper whose
docstring says what happens in each direction. Every helper is the identity when the group
is None (tp_size == 1, cp_size == 1), so the single-device model runs the exact same code.
"""
from typing import Optional

import torch
import torch.distributed as dist

from model.parallel.torch_compat import all_gather_single, reduce_scatter_single

Group = Optional[dist.ProcessGroup]


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group is None:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _split_last_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group is None:
        return x
    chunks = torch.chunk(x, dist.get_world_size(group), dim=-1)
    return chunks[dist.get_rank(group)].contiguous()


def _gather_last_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group is None:
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def start_all_reduce(x: torch.Tensor, group: Group) -> Optional[dist.Work]:
    """Sum contiguous `x` over `group` in place: started, with its handle returned to wait on
    after the work it overlaps (Megatron's asynchronous grad-input all-reduce), or, traced by
    torch.compile (a compiled block), done at once (the blocking collective it knows) and None."""
    if group is None:
        return None
    if torch.compiler.is_compiling():
        dist.all_reduce(x, group=group)
        return None
    return dist.all_reduce(x, group=group, async_op=True)


def all_gather_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """(B, T/t, ...) on each rank -> (B, T, ...), rank order along dim 1. No autograd: for
    Functions that manage their own backward (model/parallel/layers.py); otherwise use the wrappers.

    Into one rank-major (t*B, T/t, ...) tensor (`all_gather_single`, torch's name for
    all_gather_into_tensor), then one copy to batch-first order; none at B = 1. The list form
    (`all_gather` + `cat`) copies twice: NCCL and gloo gather into a flat buffer and copy out to
    the list, then `cat` copies again."""
    if group is None:
        return x
    t, x = dist.get_world_size(group), x.contiguous()
    gathered = torch.empty((t * x.size(0),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_single(gathered, x, group=group)
    return gathered.view(t, *x.shape).movedim(0, 1).reshape(x.size(0), -1, *x.shape[2:])  # (B, T, ...)


def reduce_scatter_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """(B, T, ...) partial sums on each rank -> this rank's (B, T/t, ...) chunk of their sum.

    One copy to rank-major order (t*B, T/t, ...), none at B = 1, then `reduce_scatter_single`
    (torch's name for reduce_scatter_tensor); the list form copies each chunk and the collective
    flattens the list again."""
    if group is None:
        return x
    t = dist.get_world_size(group)
    B, T = x.shape[:2]
    ranked = x.reshape(B, t, T // t, *x.shape[2:]).movedim(1, 0).reshape(t * B, T // t, *x.shape[2:])
    out = torch.empty((B, T // t) + tuple(x.shape[2:]), dtype=x.dtype, device=x.device)
    reduce_scatter_single(out, ranked, group=group)
    return out


def gather_rows(x: torch.Tensor, group: Group) -> torch.Tensor:
    """(rows, ...) on each rank -> (t * rows, ...), rank order: the collective's own layout, no copy."""
    x = x.contiguous()
    out = torch.empty((dist.get_world_size(group) * x.size(0),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_single(out, x, group=group)
    return out


def _reduce_scatter_rows(x: torch.Tensor, group: Group) -> torch.Tensor:
    """(t * rows, ...) partial sums -> this rank's (rows, ...) of their sum, no copy."""
    x = x.contiguous()
    out = torch.empty((x.size(0) // dist.get_world_size(group),) + tuple(x.shape[1:]), dtype=x.dtype,
                      device=x.device)
    reduce_scatter_single(out, x, group=group)
    return out


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        # In place, without a copy: every caller passes the fresh output of a matmul or an
        # embedding lookup that no other op reads or saves for backward (a clone here cost one
        # (B, T, h) copy per row-parallel layer per micro-batch). mark_dirty bumps x's version,
        # so autograd raises, rather than computing wrong gradients, if a caller ever breaks that.
        if not x.is_contiguous():
            return _all_reduce(x, group)  # .contiguous() makes the private copy
        ctx.mark_dirty(x)
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad, ctx.group), None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_sequence(grad, ctx.group), None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_sequence(grad, ctx.group), None


class _GatherRowsFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_rows(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_rows(grad, ctx.group), None


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.group), None


def copy_to_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """forward: identity; backward: all-reduce (Megatron's f)."""
    return x if group is None else _CopyToTP.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """forward: all-reduce, in place into x (pass a temporary); backward: identity (Megatron's g)."""
    return x if group is None else _ReduceFromTP.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """forward: all-gather the last dim; backward: keep this rank's chunk."""
    return x if group is None else _GatherFromTP.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """forward: all-gather the sequence (dim 1); backward: reduce-scatter it (K22's g).

    The backward sums: the consumer is TP-sharded (a column-parallel or vocab-parallel linear),
    so each rank holds a partial gradient of the whole sequence."""
    return x if group is None else _GatherFromSequence.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """forward: reduce-scatter along the sequence (dim 1); backward: all-gather it (K22's g-bar)."""
    return x if group is None else _ReduceScatterToSequence.apply(x, group)


def gather_rows_from_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """forward: all-gather dim 0 (each rank's row shard of a weight -> the full weight);
    backward: reduce-scatter dim 0 (each rank keeps the sum over TP of its rows' gradient).

    For a weight that TP ranks use but hold only a shard of (key/value heads when tp exceeds
    their number, model/transformer/llama.py): the sum in backward reaches exactly the ranks that used
    those rows, the others contribute zeros."""
    return x if group is None else _GatherRowsFromTP.apply(x, group)


def all_reduce_sum(x: torch.Tensor, group: Group) -> torch.Tensor:
    """forward: all-reduce (a sum over the TP ranks that every rank then uses whole); backward:
    all-reduce, since each rank's output depends on every rank's term (the statistic of a norm
    over a TP-sharded vector: model/transformer/llama.py's q/k norm over the whole projection)."""
    return x if group is None else _AllReduceSum.apply(x, group)
