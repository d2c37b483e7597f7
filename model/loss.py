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
        # The (..., V/p) tensors are the largest of the model: allocate as few as possible.
        ctx.logits_dtype = logits.dtype
        fp32 = logits.float()  # bf16/fp16: a private fp32 copy; fp32: the caller's tensor itself
        logits_max = fp32.max(dim=-1).values
        if group is not None:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        if fp32 is logits:  # never write into the caller's tensor
            shifted = fp32 - logits_max.unsqueeze(-1)
        else:
            shifted = fp32.sub_(logits_max.unsqueeze(-1))

        shard_size = logits.size(-1)
        vocab_start = 0 if group is None else dist.get_rank(group) * shard_size
        outside = (target < vocab_start) | (target >= vocab_start + shard_size)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(outside, 0.0)

        exp = shifted.exp_()  # shifted is not needed any more: target_logit is a gathered copy
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
        # In place into the saved softmax (as Megatron does), without the two (..., V/p) copies a
        # clone and an out-of-place multiply made. The saved softmax is consumed, so a second
        # backward through the same graph (retain_graph=True) would be wrong: refuse it.
        if getattr(ctx, "consumed", False):
            raise RuntimeError("vocab-parallel cross-entropy: backward ran twice through one graph")
        ctx.consumed = True
        grad, local_target, outside = ctx.saved_tensors
        onehot = (~outside).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -onehot)
        return grad.mul_(grad_loss.unsqueeze(-1)).to(ctx.logits_dtype), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: Group) -> torch.Tensor:
    """Per-token loss (...), from (..., V/p) vocab-sharded logits and (...) target ids."""
    return _VocabParallelCrossEntropy.apply(logits, target, group)
