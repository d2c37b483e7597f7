"""Megatron's conjugate collectives for the tensor-parallel region (Shoeybi et al. 2019, sec. 3)
and for sequence parallelism (Korthikanti et al. 2022, "K22", sec. 4.2).

Sequence parallelism shards the LayerNorm / dropout / residual regions of a block along the
sequence (dim 1 of our batch-first (B, T, h) activations): where plain TP all-reduces a
row-parallel output, SP reduce-scatters it along the sequence, and where plain TP copies the
input of a column-parallel linear, SP all-gathers the sequence. An all-reduce is a
reduce-scatter followed by an all-gather, so SP moves the same bytes as TP (K22 sec. 4.2).

Context parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023) shards the whole sequence over the
CP group; around the attention core two all-to-alls trade a sequence shard of every head for the
whole sequence of a head shard, and back (`all_to_all_sequence_to_heads`,
`all_to_all_heads_to_sequence`; each is the other's backward). Shapes are attention's
(B, heads, T, d); CP rank r holds tokens [r T/cp, (r+1) T/cp) and heads [r H/cp, (r+1) H/cp).

Expert parallelism (issue 26) sends each token to the ranks of its experts and back: an all-to-all
of rows with variable split sizes over the EP group (`all_to_all_to_experts`, and
`all_to_all_from_experts` for the return; each is the other's backward), the sizes exchanged
first (`exchange_counts`).

Three tiers, as in Megatron core: a private helper that does the communication, a private
autograd Function whose forward and backward are one line each, and a public wrapper whose
docstring says what happens in each direction. Every helper is the identity when the group
is None (tp_size == 1, cp_size == 1), so the single-device model runs the exact same code.
"""
from typing import List, Optional

import torch
import torch.distributed as dist

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


def all_gather_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """(B, T/t, ...) on each rank -> (B, T, ...), rank order along dim 1. No autograd: for
    Functions that manage their own backward (model/layers.py); otherwise use the wrappers.

    Into one rank-major (t*B, T/t, ...) tensor (`all_gather_single`, torch's name for
    all_gather_into_tensor), then one copy to batch-first order; none at B = 1. The list form
    (`all_gather` + `cat`) copies twice: NCCL and gloo gather into a flat buffer and copy out to
    the list, then `cat` copies again (#15)."""
    if group is None:
        return x
    t, x = dist.get_world_size(group), x.contiguous()
    gathered = torch.empty((t * x.size(0),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_single(gathered, x, group=group)
    return gathered.view(t, *x.shape).movedim(0, 1).reshape(x.size(0), -1, *x.shape[2:])  # (B, T, ...)


def reduce_scatter_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """(B, T, ...) partial sums on each rank -> this rank's (B, T/t, ...) chunk of their sum.

    One copy to rank-major order (t*B, T/t, ...), none at B = 1, then `reduce_scatter_single`
    (torch's name for reduce_scatter_tensor); the list form copies each chunk and the collective
    flattens the list again (#15)."""
    if group is None:
        return x
    t = dist.get_world_size(group)
    B, T = x.shape[:2]
    ranked = x.reshape(B, t, T // t, *x.shape[2:]).movedim(1, 0).reshape(t * B, T // t, *x.shape[2:])
    out = torch.empty((B, T // t) + tuple(x.shape[2:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_single(out, ranked, group=group)
    return out


def _gather_rows(x: torch.Tensor, group: Group) -> torch.Tensor:
    """(rows, ...) on each rank -> (t * rows, ...), rank order: the collective's own layout, no copy."""
    x = x.contiguous()
    out = torch.empty((dist.get_world_size(group) * x.size(0),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_single(out, x, group=group)
    return out


def _reduce_scatter_rows(x: torch.Tensor, group: Group) -> torch.Tensor:
    """(t * rows, ...) partial sums -> this rank's (rows, ...) of their sum, no copy."""
    x = x.contiguous()
    out = torch.empty((x.size(0) // dist.get_world_size(group),) + tuple(x.shape[1:]), dtype=x.dtype,
                      device=x.device)
    dist.reduce_scatter_single(out, x, group=group)
    return out


def _all_to_all(ranked: torch.Tensor, group: Group) -> torch.Tensor:
    """(c, ...) rank-major: slice j goes to rank j -> (c, ...): slice i came from rank i."""
    ranked = ranked.contiguous()
    out = torch.empty_like(ranked)  # after .contiguous(): empty_like keeps a permuted input's strides
    dist.all_to_all_single(out, ranked, group=group)
    return out


def sequence_to_heads(x: torch.Tensor, group: Group) -> torch.Tensor:
    """(B, H, T/c, d): this rank's tokens of every head -> (B, H/c, T, d): every token of its heads.
    No autograd (the wrappers below). Rank j is sent head chunk j; from rank i come tokens chunk i."""
    if group is None:
        return x
    c = dist.get_world_size(group)
    B, H, T_local, d = x.shape
    ranked = x.reshape(B, c, H // c, T_local, d).movedim(1, 0)  # (c, B, H/c, T/c, d): chunk j for rank j
    received = _all_to_all(ranked, group)  # (c, B, H/c, T/c, d): tokens chunk i from rank i
    return received.permute(1, 2, 0, 3, 4).reshape(B, H // c, c * T_local, d)  # (B, H/c, T, d)


def heads_to_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """(B, H/c, T, d): every token of this rank's heads -> (B, H, T/c, d): its tokens of every head.
    No autograd. Rank j is sent tokens chunk j; from rank i come head chunk i.

    The result is a transposed view of a (B, T/c, H, d) tensor, so the caller's merge of the heads
    back into (B, T/c, H*d) is a view, as without CP."""
    if group is None:
        return x
    c = dist.get_world_size(group)
    B, H_local, T, d = x.shape
    ranked = x.reshape(B, H_local, c, T // c, d).permute(2, 0, 3, 1, 4)  # (c, B, T/c, H/c, d): tokens chunk j
    received = _all_to_all(ranked, group)  # (c, B, T/c, H/c, d): head chunk i from rank i
    by_token = received.permute(1, 2, 0, 3, 4).reshape(B, T // c, c * H_local, d)  # (B, T/c, H, d)
    return by_token.transpose(1, 2)  # (B, H, T/c, d)


def _all_to_all_rows(x: torch.Tensor, output_splits: List[int], input_splits: List[int],
                     group: Group) -> torch.Tensor:
    """(sum(input_splits), ...): rows [sum(input_splits[:j]), sum(input_splits[:j+1])) go to rank j
    -> (sum(output_splits), ...): output_splits[i] rows from rank i, in rank order."""
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=output_splits, input_split_sizes=input_splits,
                           group=group)
    return out


def exchange_counts(counts: torch.Tensor, group: Group) -> torch.Tensor:
    """(ep, n) integer counts, row j for rank j -> (ep, n): row i is what rank i has for this rank.
    No autograd: the split sizes `all_to_all_to_experts` needs, sent before the rows."""
    if group is None:
        return counts
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
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
        return _gather_rows(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_rows(grad, ctx.group), None


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return sequence_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return heads_to_sequence(grad, ctx.group), None


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return heads_to_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return sequence_to_heads(grad, ctx.group), None


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.group), None


class _TokensToExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _all_to_all_rows(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all_rows(grad, ctx.splits[1], ctx.splits[0], ctx.group), None, None, None


class _TokensFromExperts(torch.autograd.Function):
    # The same exchange as _TokensToExperts (each is the other's backward): a class of its own so that
    # --comm-counts (launch/instruments/comm_counter.py) tells the return from the dispatch.
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _all_to_all_rows(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all_rows(grad, ctx.splits[1], ctx.splits[0], ctx.group), None, None, None


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
    their number, model/llama.py): the sum in backward reaches exactly the ranks that used
    those rows, the others contribute zeros."""
    return x if group is None else _GatherRowsFromTP.apply(x, group)


def all_to_all_sequence_to_heads(x: torch.Tensor, cp_group: Group) -> torch.Tensor:
    """forward: (B, H, T/cp, d) -> (B, H/cp, T, d), an all-to-all over CP (Ulysses' first);
    backward: the inverse all-to-all of the gradient, (B, H/cp, T, d) -> (B, H, T/cp, d).

    A permutation of elements across ranks: no sums, so forward and backward are exact."""
    return x if cp_group is None else _SequenceToHeads.apply(x, cp_group)


def all_to_all_heads_to_sequence(x: torch.Tensor, cp_group: Group) -> torch.Tensor:
    """forward: (B, H/cp, T, d) -> (B, H, T/cp, d), an all-to-all over CP (Ulysses' second);
    backward: (B, H, T/cp, d) -> (B, H/cp, T, d)."""
    return x if cp_group is None else _HeadsToSequence.apply(x, cp_group)


def all_reduce_sum(x: torch.Tensor, group: Group) -> torch.Tensor:
    """forward: all-reduce (a sum over the TP ranks that every rank then uses whole); backward:
    all-reduce, since each rank's output depends on every rank's term (the statistic of a norm
    over a TP-sharded vector: model/llama.py's q/k norm over the whole projection)."""
    return x if group is None else _AllReduceSum.apply(x, group)


def all_to_all_to_experts(x: torch.Tensor, output_splits: List[int], input_splits: List[int],
                          ep_group: Group) -> torch.Tensor:
    """forward: token rows to their experts' ranks, (sum(input_splits), h) -> (sum(output_splits), h):
    input_splits[j] consecutive rows go to EP rank j, output_splits[i] rows arrive from rank i, in
    rank order; backward: the rows' gradients go back the same way (the sizes swapped).

    A permutation of rows across ranks, no sums: forward and backward are exact."""
    return x if ep_group is None else _TokensToExperts.apply(x, output_splits, input_splits, ep_group)


def all_to_all_from_experts(x: torch.Tensor, output_splits: List[int], input_splits: List[int],
                            ep_group: Group) -> torch.Tensor:
    """forward: the experts' output rows back to their tokens' ranks (the inverse of
    `all_to_all_to_experts`, whose splits it takes swapped); backward: their gradients to the experts."""
    return x if ep_group is None else _TokensFromExperts.apply(x, output_splits, input_splits, ep_group)


def all_gather_context(x: torch.Tensor, cp_group: Group) -> torch.Tensor:
    """(B, T/cp, ...) on each CP rank -> (cp, B, T/cp, ...), rank-major, the collective's own layout:
    no autograd, for integer tensors (the document mask's segment ids, model/documents.py). Its own
    function, so that --comm-counts can tell it from sequence parallelism's gathers."""
    return _gather_rows(x.unsqueeze(0), cp_group)
