"""The step's loss is the mean over every counted token of the step (model/gpt/pipe.py: TokenMeanLoss,
launch/runtime/step_tokens.py; issue 33): with labels of -100 spread unevenly over the micro-batches
and the two DP replicas, and one sequence without any counted token, micro-batch 1 (4 micro-batches
per replica) and micro-batch 4 (one) give the same loss and the same update, and the loss is
F.cross_entropy's mean over the whole global batch on the single-process GPT of the same seed.
A mean of per-micro-batch means gives a different loss here, and NaN for the empty micro-batch."""
import torch
import torch.distributed as dist
from torch.nn import functional

from helpers.distributed import run_distributed, sgd_engine, uses_deepspeed
from helpers.launcher import TINY

VOCAB, SEQUENCES_PER_RANK = 4096, 4


def _global_batch(seq_len: int):
    """(inputs, labels), (8, T) each, the same on every rank: about a third of the labels masked,
    more on the second replica's sequences, and sequence 1 wholly masked."""
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (2 * SEQUENCES_PER_RANK, seq_len + 1), generator=g)
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    masked_share = torch.tensor([0.3] * SEQUENCES_PER_RANK + [0.6] * SEQUENCES_PER_RANK).unsqueeze(1)
    labels[torch.rand(labels.shape, generator=g) < masked_share] = -100
    labels[1] = -100
    return inputs, labels


@uses_deepspeed
def _same_loss_and_update_at_micro_batch_1_and_4():
    from launch.config.recipe import load_recipe
    from launch.runtime.step_tokens import count_step_tokens
    from model.gpt.model import GPT
    from model.parallel.state import init_parallel_state

    config = load_recipe(TINY, []).gpt_config(VOCAB)
    inputs, labels = _global_batch(config.seq_len)
    mine = slice(dist.get_rank() * SEQUENCES_PER_RANK, (dist.get_rank() + 1) * SEQUENCES_PER_RANK)
    losses, updates = {}, {}
    for micro_batch in (1, 4):
        micro_batches = SEQUENCES_PER_RANK // micro_batch
        engine = sgd_engine(config, init_parallel_state(1, 1), micro_batch, micro_batches)
        before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        feed = iter(list(zip(inputs[mine].split(micro_batch), labels[mine].split(micro_batch))))
        losses[micro_batch] = engine.train_batch(count_step_tokens(engine, feed, micro_batches)).item()
        updates[micro_batch] = {n: p.detach() - before[n] for n, p in engine.module.named_parameters()}

    dense = GPT(config)
    logits = dense(inputs)
    reference = functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    reference.backward()
    assert abs(losses[1] - reference.item()) < 1e-5 and abs(losses[4] - reference.item()) < 1e-5, \
        (losses, reference.item())
    for name, update in updates[1].items():
        torch.testing.assert_close(update, updates[4][name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    # SGD at lr 1: the update is minus the gradient; its norm is the dense model's gradient norm.
    update_norm = sum(u.pow(2).sum() for u in updates[4].values()).sqrt().item()
    dense_norm = sum(p.grad.pow(2).sum() for p in dense.parameters()).sqrt().item()
    assert abs(update_norm - dense_norm) <= 1e-5 * dense_norm, (update_norm, dense_norm)


def test_loss_is_the_token_mean_over_the_step_at_any_micro_batch_size():
    run_distributed(_same_loss_and_update_at_micro_batch_1_and_4, 2)
