"""The router losses' gradient at cp 2: the run's engine on two gloo processes, (tp, cp, pp,
dp, ep) = (1,2,1,1,2), one step of three micro-batches with the scale the run sets
(launch/engine/experts.py: set_router_loss_scale), against the single-process GPT of the same seed
and batches. Each router weight's gradient is the dense one to fp32 rounding.

The router losses are weighted up here (load balancing 0.5, z-loss 0.05), so that their share of the
router's gradient is large: summing their counts over one CP shard only (the CP group dropped from
model/transformer/moe_losses.py), or scaling their backward by cp once more, moves the gradient by far
more than the tolerance (both measured red)."""
from types import SimpleNamespace

import torch

from helpers.distributed import run_distributed, sgd_engine, uses_deepspeed
from model.config import GPTConfig
from model.moe_config import MoEConfig

CONFIG = GPTConfig(arch="qwen3_moe", n_layer=2, n_head=4, n_kv_head=2, n_embd=64, seq_len=16, vocab_size=101,
                   seed=5, moe=MoEConfig(num_experts=4, experts_per_token=2, expert_ffn_hidden_size=32,
                                         aux_loss_coef=0.5, z_loss_coef=0.05))
MICRO, N_MICRO, CP, EP = 2, 3, 2, 2


def _batches():
    g = torch.Generator().manual_seed(17)
    tokens = torch.randint(0, CONFIG.vocab_size, (N_MICRO, MICRO, CONFIG.seq_len + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def dense_router_gradients():
    """{dense name: gradient} of every router weight: the single-process GPT, each micro-batch's mean
    loss and router losses weighted 1 / N_MICRO (DeepSpeed's mean over the gradient-accumulation steps)."""
    from model.gpt.model import GPT
    from model.parallel.cross_entropy import vocab_parallel_cross_entropy
    from model.transformer.moe_losses import stage_statistics
    dense = GPT(CONFIG)
    stage_statistics(dense).backward_scale = 1.0 / N_MICRO
    for x, y in _batches():
        (vocab_parallel_cross_entropy(dense(x), y, None).mean() / N_MICRO).backward()
    return {name: p.grad for name, p in dense.named_parameters() if name.endswith("router.weight")}


@uses_deepspeed
def _router_gradients_at_cp2_match_the_dense_model():
    from launch.engine.experts import set_router_loss_scale
    from launch.feed.step_tokens import count_step_tokens
    from model.hf.convert import dense_name
    from model.parallel.context_parallel import sequence_shards
    from model.parallel.state import init_parallel_state

    state = init_parallel_state(1, 1, CP, EP, experts=True)
    engine = sgd_engine(CONFIG, state, MICRO, N_MICRO)
    set_router_loss_scale(engine, SimpleNamespace(cp=CP, grad_accum_steps=N_MICRO))  # as the run, before each step
    routers = {dense_name(n, CONFIG): p for n, p in engine.module.named_parameters() if n.endswith("router.weight")}
    before = {name: p.detach().clone() for name, p in routers.items()}
    feed = sequence_shards(iter(_batches()), state.cp_rank, state.cp_size)
    engine.train_batch(count_step_tokens(engine, feed, N_MICRO))
    expected = dense_router_gradients()
    assert sorted(expected) == sorted(routers) and len(routers) == CONFIG.n_layer
    for name, p in routers.items():
        gradient = before[name] - p.detach()  # SGD at lr 1
        torch.testing.assert_close(gradient, expected[name], rtol=1e-4, atol=1e-6 * expected[name].abs().max(),
                                   msg=lambda m: f"{name}: {m}")


def test_router_gradients_at_cp2_match_the_dense_model():
    run_distributed(_router_gradients_at_cp2_match_the_dense_model, CP)
