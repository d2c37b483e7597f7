"""Cross-entropy over logits whose vocabulary is split across the TP group (Megatron-LM).

No rank ever holds the full (B, T, V) logits: each reduces its shard to a max, a sum of
exponentials and the target logit, and three all-reduces of (B*T,) vectors combine them.
Padded vocabulary columns arrive as -inf and contribute exp(-inf) = 0.

At a large vocabulary the (B, T, V/p) tensors dominate the last stage's memory, so the loss works
in chunks of tokens: it never holds an fp32 copy of the logits or a softmax for the whole
micro-batch. It keeps the (low-precision) logits and a (B*T,) max and sum of exponentials between
forward and backward, and backward recomputes the softmax chunk by chunk.
"""
from typing import Optional

import torch
import torch.distributed as dist

from model.parallel.mappings import Group

# fp32 bytes of one chunk's temporary (tokens x V/p), the loss's only large allocation besides its
# gradient: 256 MiB is ~520 tokens at V = 128,256 and tp = 1 (16 chunks of 8,192 tokens, a few
# kernels each), small against the 2 GiB of those logits in bf16.
CHUNK_BYTES = 256 * 2 ** 20
IGNORE_INDEX = -100  # as functional.cross_entropy: such a token has loss 0 and gradient 0


def _chunks(n: int, chunk_tokens: int):
    for start in range(0, n, chunk_tokens):
        yield slice(start, min(start + chunk_tokens, n))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, chunk_tokens, consume_logits):
        # logits: (..., V/p) this rank's shard; target: (...) global token ids
        shard_size = logits.size(-1)
        flat = logits.reshape(-1, shard_size)  # (N, V/p): a view of the caller's tensor
        n = flat.size(0)
        chunk = chunk_tokens or max(1, CHUNK_BYTES // (4 * shard_size))
        # The max is exact in the input's precision: no fp32 copy needed for it.
        logits_max = torch.empty(n, dtype=torch.float32, device=logits.device)
        for rows in _chunks(n, chunk):
            logits_max[rows] = flat[rows].amax(dim=-1)
        if group is not None:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)

        vocab_start = 0 if group is None else dist.get_rank(group) * shard_size
        target = target.reshape(-1)
        outside = (target < vocab_start) | (target >= vocab_start + shard_size)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        target_logit = flat.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).float() - logits_max
        target_logit = target_logit.masked_fill(outside, 0.0)

        sum_exp = torch.empty(n, dtype=torch.float32, device=logits.device)
        for rows in _chunks(n, chunk):
            # (chunk, V/p) fp32, the only large temporary: the input upcast, then shifted and exp in
            # place (a mixed-dtype subtraction would make a second one)
            shifted = flat[rows].to(torch.float32, copy=True).sub_(logits_max[rows].unsqueeze(-1))
            torch.sum(shifted.exp_(), dim=-1, out=sum_exp[rows])
            del shifted  # before the next chunk's is made
        if group is not None:
            dist.all_reduce(target_logit, group=group)
            dist.all_reduce(sum_exp, group=group)
        ignored = target == IGNORE_INDEX
        loss = (sum_exp.log() - target_logit).masked_fill_(ignored, 0.0)

        # The logits are saved as an alias (not through save_for_backward) so that a caller that
        # consumes them can drop its own reference's memory (model/gpt/pipe.py: TokenMeanLoss).
        ctx.logits, ctx.version = flat.detach(), logits._version
        ctx.save_for_backward(logits_max, sum_exp, local_target, outside, ignored)
        ctx.chunk, ctx.consume, ctx.shape = chunk, consume_logits, logits.shape
        return loss.view(logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad_loss):
        # dL/dlogits = (softmax - onehot(target)) * dL/dloss on this rank's shard, the softmax
        # recomputed per chunk exactly as forward had it. With consume_logits the gradient
        # overwrites the logits (nothing reads them after the loss), so a second backward through
        # the same graph would be wrong: refuse it.
        flat = getattr(ctx, "logits", None)
        if flat is None:
            raise RuntimeError("vocab-parallel cross-entropy: backward ran twice through one graph")
        if flat._version != ctx.version:  # what save_for_backward would have checked
            raise RuntimeError("vocab-parallel cross-entropy: the logits were modified in place after the loss")
        logits_max, sum_exp, local_target, outside, ignored = ctx.saved_tensors
        if ctx.consume:
            del ctx.logits
            grad = flat
        else:
            grad = torch.empty_like(flat)  # one buffer of the logits' dtype
        grad_loss = grad_loss.reshape(-1).masked_fill(ignored, 0.0)
        onehot = (~outside).float().unsqueeze(-1)
        fp32 = grad.dtype == torch.float32
        for rows in _chunks(flat.size(0), ctx.chunk):
            # fp32: straight into the output; else an fp32 (chunk, V/p) temporary, rounded once
            out = grad[rows]
            softmax = torch.sub(flat[rows], logits_max[rows].unsqueeze(-1), out=out) if fp32 \
                else flat[rows].float().sub_(logits_max[rows].unsqueeze(-1))
            softmax.exp_().div_(sum_exp[rows].unsqueeze(-1))
            softmax.scatter_add_(-1, local_target[rows].unsqueeze(-1), -onehot[rows])
            softmax.mul_(grad_loss[rows].unsqueeze(-1))
            if not fp32:
                out.copy_(softmax)
            del softmax  # before the next chunk's is made
        return grad.view(ctx.shape), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: Group,
                                 chunk_tokens: Optional[int] = None, consume_logits: bool = False) -> torch.Tensor:
    """Per-token loss (...), from (..., V/p) vocab-sharded logits and (...) target ids; a target of
    IGNORE_INDEX gives loss 0 and gradient 0. `chunk_tokens` tokens are processed at a time (by
    default CHUNK_BYTES' worth). `consume_logits`: backward writes the gradient into the logits'
    memory instead of a new buffer; for callers that never read the logits after the loss."""
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"vocab-parallel cross-entropy: chunk_tokens must be >= 1, got {chunk_tokens}")
    return _VocabParallelCrossEntropy.apply(logits, target, group, chunk_tokens, consume_logits)
