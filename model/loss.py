"""Cross-entropy over logits whose vocabulary is split across the TP group (Megatron-LM).

No rank ever holds the full (B, T, V) logits: each reduces its shard to a max, a sum of
exponentials and the target logit, and three all-reduces of (B, T) tensors combine them.
Padded vocabulary columns arrive as -inf and contribute exp(-inf) = 0.
"""
import torch
import torch.distributed as dist

from model.mappings import Group


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group):
        # logits: (..., V/p) this rank's shard; target: (...) global token ids
        ctx.logits_dtype = logits.dtype
        logits = logits.float()
        logits_max = logits.max(dim=-1).values
        if group is not None:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)

        shard_size = logits.size(-1)
        vocab_start = 0 if group is None else dist.get_rank(group) * shard_size
        outside = (target < vocab_start) | (target >= vocab_start + shard_size)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(outside, 0.0)

        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if group is not None:
            dist.all_reduce(target_logit, group=group)
            dist.all_reduce(sum_exp, group=group)
        loss = sum_exp.log() - target_logit  # (...)

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        # dL/dlogits = softmax - onehot(target), on this rank's shard only.
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax.clone()
        onehot = (~outside).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -onehot)
        return (grad * grad_loss.unsqueeze(-1)).to(ctx.logits_dtype), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: Group) -> torch.Tensor:
    """Per-token loss (...), from (..., V/p) vocab-sharded logits and (...) target ids."""
    return _VocabParallelCrossEntropy.apply(logits, target, group)
