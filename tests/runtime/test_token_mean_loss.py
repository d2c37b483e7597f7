"""The step's loss is the mean over every counted token of the step (model/gpt/pipe.py: TokenMeanLoss,
launch/feed/step_tokens.py): with labels of -100 spread unevenly over the micro-batches
and the two DP replicas, and one sequence without any counted token, micro-batch 1 (4 micro-batches
per replica) and micro-batch 4 (one) give the same loss and the same update, and the loss is
F.cross_entropy's mean over the whole global batch on the single-process GPT of the same seed.
A mean of per-micro-batch means gives a different loss here, and NaN for the empty micro-batch.

The same for a mixture of experts whose router losses leave the -100 tokens out (global-batch
balancing from a given last-step load, and the z-loss), at dp 2 and at pp 2 (where the first stage
sends the masks to the second): the update's norm is that of the dense model's gradient with the
router losses written out in plain torch over the counted tokens only."""
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.nn import functional

from helpers.distributed import run_distributed, sgd_engine, uses_deepspeed
from helpers.launcher import TINY
from model.config import GPTConfig
from model.moe_config import MoEConfig

VOCAB, SEQUENCES_PER_RANK = 4096, 4
MOE = GPTConfig(arch="qwen3_moe", n_layer=2, n_head=4, n_kv_head=2, n_embd=64, seq_len=16, vocab_size=VOCAB, seed=5,
                moe=MoEConfig(num_experts=4, experts_per_token=2, expert_ffn_hidden_size=32, aux_loss_coef=0.1,
                              z_loss_coef=0.01, balance_scope="global_batch"))
LAST_STEP_LOAD = torch.tensor([0.9, 0.1, 0.6, 0.4])  # f_e of a previous step: sums to k = 2


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


def _routers(module):
    return [m.router for m in module.modules() if hasattr(m, "router") and hasattr(m, "layer_index")]


def _train_step(config, micro_batch: int, inputs, labels, pp: int = 1):
    """(reported loss, {name: update}) of one SGD step at lr 1 of the run's engine on the two ranks as
    dp 2 (each rank 4 sequences) or pp 2 (8), in micro-batches of `micro_batch`, fed as the run feeds
    them; the update of this rank's parameters."""
    from launch.engine.experts import set_router_loss_scale
    from launch.feed.step_tokens import RouterTokens, count_step_tokens
    from model.parallel.state import init_parallel_state
    sequences = inputs.size(0) * pp // dist.get_world_size()
    micro_batches = sequences // micro_batch
    state = init_parallel_state(1, pp, experts=config.moe.enabled)
    engine = sgd_engine(config, state, micro_batch, micro_batches)
    routers = None
    if config.moe.enabled:
        for router in _routers(engine.module):
            router.step_load.copy_(LAST_STEP_LOAD)
        set_router_loss_scale(engine, SimpleNamespace(cp=1, grad_accum_steps=micro_batches))
        routers = RouterTokens((micro_batch, config.seq_len), cp=1)
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    mine = slice(state.dp_rank * sequences, (state.dp_rank + 1) * sequences)
    feed = iter(list(zip(inputs[mine].split(micro_batch), labels[mine].split(micro_batch))))
    loss = engine.train_batch(count_step_tokens(engine, feed, micro_batches, routers)).item()
    return loss, {n: p.detach() - before[n] for n, p in engine.module.named_parameters()}


def _dense_reference(config, inputs, labels):
    """(language-model loss, gradient norm) of the single-process GPT on the whole global batch: the
    mean cross-entropy over the counted tokens, plus, with experts, each MoE block's router losses
    over the counted tokens (transformers leaves padding out the same way), averaged over the blocks."""
    from model.gpt.model import GPT
    from model.transformer.moe_losses import stage_statistics
    dense = GPT(config)
    block_inputs = []
    if config.moe.enabled:
        statistics = stage_statistics(dense)
        statistics.aux_loss_coef = statistics.z_loss_coef = 0.0  # written out below instead
        for router in _routers(dense):
            router.step_load.copy_(LAST_STEP_LOAD)
        for mlp in dense.modules():
            if hasattr(mlp, "router") and hasattr(mlp, "layer_index"):
                mlp.register_forward_hook(lambda module, args, out: block_inputs.append((args[0], module.router.weight)))
    lm_loss = functional.cross_entropy(dense(inputs).flatten(0, 1), labels.flatten(), ignore_index=-100)
    objective = lm_loss
    counted = (labels != -100).flatten().float()
    for x, weight in block_inputs:
        logits = functional.linear(x.reshape(-1, x.size(-1)).float(), weight.float())
        probs = torch.softmax(logits, dim=-1)
        aux = config.moe.num_experts * (LAST_STEP_LOAD * (probs * counted[:, None]).sum(0)).sum() / counted.sum()
        z = (torch.logsumexp(logits, dim=-1).pow(2) * counted).sum() / counted.sum()
        objective = objective + (config.moe.aux_loss_coef * aux + config.moe.z_loss_coef * z) / len(block_inputs)
    objective.backward()
    return lm_loss.item(), sum(p.grad.pow(2).sum() for p in dense.parameters()).sqrt().item()


@uses_deepspeed
def _same_loss_and_update_at_micro_batch_1_and_4():
    """dp 2 for the dense and the MoE model, pp 2 for the MoE model (the masks sent down the pipeline)."""
    from launch.config.recipe import load_recipe
    for config, pp in ((load_recipe(TINY, []).gpt_config(VOCAB), 1), (MOE, 1), (MOE, 2)):
        inputs, labels = _global_batch(config.seq_len)
        losses, updates = {}, {}
        for micro_batch in (1, 4):
            losses[micro_batch], updates[micro_batch] = _train_step(config, micro_batch, inputs, labels, pp)
        reference, dense_norm = _dense_reference(config, inputs, labels)
        assert abs(losses[1] - reference) < 1e-5 and abs(losses[4] - reference) < 1e-5, (pp, losses, reference)
        for name, update in updates[1].items():
            torch.testing.assert_close(update, updates[4][name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        # SGD at lr 1: the update is minus the gradient; its norm is the dense model's gradient norm
        # (at pp 2 each rank holds one stage's parameters: their squares summed over the stages).
        squares = sum(u.pow(2).sum() for u in updates[4].values()).reshape(1)
        if pp > 1:
            dist.all_reduce(squares)
        update_norm = squares.sqrt().item()
        assert abs(update_norm - dense_norm) <= 1e-5 * dense_norm, (config.moe.enabled, pp, update_norm, dense_norm)


def test_loss_is_the_token_mean_over_the_step_at_any_micro_batch_size():
    run_distributed(_same_loss_and_update_at_micro_batch_1_and_4, 2)
