"""The all-to-alls of context and expert parallelism, in the three tiers of model/parallel/mappings.py.

Context parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023) shards the whole sequence over the
CP group; around the attention core two all-to-alls trade a sequence shard of every head for the
whole sequence of a head shard, and back (`all_to_all_sequence_to_heads`,
`all_to_all_heads_to_sequence`; each is the other's backward). Shapes are attention's
(B, heads, T, d); CP rank r holds tokens [r T/cp, (r+1) T/cp) and heads [r H/cp, (r+1) H/cp).

Expert parallelism sends each token to the ranks of its experts and back: an all-to-all
of rows with variable split sizes over the EP group (`all_to_all_to_experts`, and
`all_to_all_from_experts` for the return; each is the other's backward), the sizes exchanged
first (`exchange_counts`). Every helper is the identity when the group is None.
"""
from typing import List

import torch
import torch.distributed as dist

from model.parallel.mappings import Group, gather_rows


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


def all_to_all_sequence_to_heads(x: torch.Tensor, cp_group: Group) -> torch.Tensor:
    """forward: (B, H, T/cp, d) -> (B, H/cp, T, d), an all-to-all over CP (Ulysses' first);
    backward: the inverse all-to-all of the gradient, (B, H/cp, T, d) -> (B, H, T/cp, d).

    A permutation of elements across ranks: no sums, so forward and backward are exact."""
    return x if cp_group is None else _SequenceToHeads.apply(x, cp_group)


def all_to_all_heads_to_sequence(x: torch.Tensor, cp_group: Group) -> torch.Tensor:
    """forward: (B, H/cp, T, d) -> (B, H, T/cp, d), an all-to-all over CP (Ulysses' second);
    backward: (B, H, T/cp, d) -> (B, H/cp, T, d)."""
    return x if cp_group is None else _HeadsToSequence.apply(x, cp_group)


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
    return gather_rows(x.unsqueeze(0), cp_group)
