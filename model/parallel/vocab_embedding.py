"""The vocab-parallel embedding (Megatron-LM, Shoeybi et al. 2019): the (V_pad, h) table split
by vocabulary rows over TP, used as the input lookup and, tied or as its own head, as the output
logits of this rank's vocabulary shard (vocab-parallel cross-entropy: model/parallel/cross_entropy.py)."""
import torch
import torch.nn as nn
from torch.nn import functional

from model.parallel.layers import column_parallel_projections, group_rank, group_size, mark_tensor_parallel, shard_rows
from model.parallel.mappings import (Group, gather_from_sequence_parallel_region, reduce_from_tp_region,
                                     reduce_scatter_to_sequence_parallel_region, start_all_reduce)
from model.parallel.weight_grad import add_product_into, embedding, linear, weight_grad_now_or_later


class _PaddedVocabLogits(torch.autograd.Function):
    """logits = h W^T with this shard's padded-vocabulary columns set to -inf:
    (B, T, h), (V/p, h) -> (B, T, V/p), where only the first `real_rows` rows of W are words.

    Written as one Function so that the largest tensor of the model is never copied: the
    -inf fill is in place on the matmul's fresh output (a `masked_fill` made a (B, T, V/p)
    copy in forward and another in backward). A -inf column is a constant, so its gradient
    is zero whatever the consumer sends back: backward reads only the real columns of the
    incoming gradient and gives the padded rows of W a zero gradient (they stay zero).

    `group`: the TP group over which dL/dh is summed (Megatron's f), all-reduced while dL/dW is
    computed (model/parallel/layers.py: _OverlappedLinears); None where the caller sums it (SP's
    gather) or there is one rank."""

    @staticmethod
    def forward(ctx, hidden, weight, real_rows, group):
        ctx.save_for_backward(hidden, weight)
        ctx.real_rows, ctx.group = real_rows, group
        logits = functional.linear(hidden, weight)
        logits[..., real_rows:] = float("-inf")
        return logits

    @staticmethod
    def backward(ctx, grad):  # grad: (B, T, V/p)
        hidden, weight = ctx.saved_tensors
        real = ctx.real_rows
        grad_real = grad.reshape(-1, grad.size(-1))[:, :real]  # (B*T, real): a view, no copy
        grad_hidden = grad_real.matmul(weight[:real]).view_as(hidden)  # (B, T, h)
        pending = start_all_reduce(grad_hidden, ctx.group)

        def weight_grad(main):
            hidden_2d = hidden.reshape(-1, hidden.size(-1))  # (B*T, h)
            if main is not None:  # the padded rows' main gradient stays zero
                return add_product_into(main[:real], grad_real.t(), hidden_2d)
            grad_weight = torch.zeros_like(weight)  # (V/p, h); padded rows: zero
            torch.mm(grad_real.t(), hidden_2d, out=grad_weight[:real])
            return grad_weight
        grad_weight = weight_grad_now_or_later(weight, weight_grad, holds=(hidden, grad))
        if pending is not None:
            pending.wait()
        return grad_hidden, grad_weight, None, None


class VocabParallelEmbedding(nn.Module):
    """E[ids] with the vocabulary rows split across TP: rank r holds rows [r*V/p, (r+1)*V/p).

    The vocabulary is padded to `padded_vocab_size` (a multiple of tp); rows >= `vocab_size`
    start at zero and `logits()` masks them to -inf, so padding never takes probability mass
    and the loss is the same at every padding (docs/design.md contract 4).
    The same weight serves as the output head (tied embeddings, GPT-2).
    """

    def __init__(self, vocab_size: int, padded_vocab_size: int, embedding_dim: int,
                 tp_group: Group, generator: torch.Generator, init_std: float,
                 sequence_parallel: bool = False):
        super().__init__()
        tp_size, tp_rank = group_size(tp_group), group_rank(tp_group)
        assert padded_vocab_size % tp_size == 0 and padded_vocab_size >= vocab_size
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel and tp_group is not None
        self.vocab_size = vocab_size
        self.rows_per_partition = padded_vocab_size // tp_size
        self.vocab_start = tp_rank * self.rows_per_partition
        self.vocab_end = self.vocab_start + self.rows_per_partition
        full = torch.zeros(padded_vocab_size, embedding_dim)
        full[:vocab_size].normal_(0.0, init_std, generator=generator)
        self.weight = nn.Parameter(shard_rows(full, tp_group))  # (V_pad/p, h)
        mark_tensor_parallel(self.weight, partition_dim=0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids -> (B, T, h) embeddings, replicated on the TP group; with
        sequence parallelism this rank's (B, T/t, h) chunk (reduce-scatter, not all-reduce)."""
        if self.tp_group is None:  # one rank holds every row: no masking, no (B, T, h) masked copy
            return embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        emb = embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(emb, self.tp_group)
        return reduce_from_tp_region(emb, self.tp_group)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, h) replicated -> (B, T, V_pad/p) this rank's vocab shard of the logits.
        With sequence parallelism `hidden` is this rank's (B, T/t, h) chunk, all-gathered."""
        # Without SP, dL/dh's all-reduce over TP runs while dL/dW is computed.
        real_rows = min(max(self.vocab_size - self.vocab_start, 0), self.rows_per_partition)
        if not self.sequence_parallel:
            if real_rows == self.rows_per_partition:  # this shard holds no padding rows
                return column_parallel_projections(hidden, [(self.weight, None)], self.tp_group,
                                                   sequence_parallel=False)[0]
            return _PaddedVocabLogits.apply(hidden, self.weight, real_rows, self.tp_group)
        hidden = gather_from_sequence_parallel_region(hidden, self.tp_group)  # (B, T, h)
        if real_rows == self.rows_per_partition:
            return linear(hidden, self.weight)
        return _PaddedVocabLogits.apply(hidden, self.weight, real_rows, None)
