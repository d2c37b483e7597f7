"""ZeRO-0's gradient norm and clipping (launch/optim/grad_norm.py, docs/design.md contract 5),
in process: the engine the run builds (launch/engine/engine.py) at tp=2 pp=2 in fp32 ZeRO-0 on
four gloo ranks, one step of recipes/tiny.yaml on random tokens, against the dense GPT of the same
seed in each rank. The norm is the dense gradient's norm (TP shards counted on every TP rank,
replicated parameters once, the tied embedding once); every rank's gradient, as the optimizer
receives it, is the dense gradient's shard scaled by grad_clip / norm. The launched run's metrics:
tests/e2e/test_zero0.py (slow)."""
import torch
import torch.distributed as dist

from helpers.distributed import run_distributed, uses_deepspeed
from helpers.launcher import TINY

TP, PP = 2, 2
GRAD_CLIP = 0.1  # below the first step's norm, so clipping acts


def _dense_shard(full: torch.Tensor, name: str, group, padded_vocab: int) -> torch.Tensor:
    """This TP rank's part of a dense parameter or gradient, by the export's split rules."""
    from model.hf.convert import rule_for
    from model.parallel.layers import shard_rows
    rule = rule_for(name)
    if rule.dim is None:
        return full
    if rule.vocab:
        full = torch.cat([full, full.new_zeros(padded_vocab - full.size(0), *full.shape[1:])])
    if rule.dim == 0:
        return shard_rows(full, group, rule.stride)
    return shard_rows(full.t(), group).t()


@uses_deepspeed
def _zero0_norm_is_the_dense_norm():
    from launch.config.layout import check_and_derive_layout
    from launch.config.recipe import load_recipe
    from launch.engine.engine import build_engine
    from model.hf.convert import dense_name
    from model.gpt.model import GPT
    from model.parallel.cross_entropy import vocab_parallel_cross_entropy
    from model.parallel.state import init_parallel_state

    recipe = load_recipe(TINY, ["train.zero_stage=0", f"train.grad_clip={GRAD_CLIP}"])
    layout = check_and_derive_layout(recipe, dist.get_world_size(), TP, PP, True)
    state = init_parallel_state(TP, PP)
    config = recipe.gpt_config(4096)
    engine, own_norm = build_engine(recipe, layout, state, config)
    assert own_norm is not None, "fp32 ZeRO-0 must use our own norm"
    clipped = {}
    engine.optimizer.register_step_pre_hook(  # runs after the norm's hook: the gradients the step uses
        lambda optimizer, args, kwargs: clipped.update({n: p.grad.detach().clone()
                                                        for n, p in engine.module.named_parameters()}))
    tokens = torch.randint(0, 4096, (layout.grad_accum_steps, layout.micro_batch_size, config.seq_len + 1),
                           generator=torch.Generator().manual_seed(11))
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
    engine.train_batch(iter(batches))

    dense = GPT(config)
    torch.stack([vocab_parallel_cross_entropy(dense(x), y, None).mean() for x, y in batches]).mean().backward()
    dense_norm = sum(p.grad.pow(2).sum() for p in dense.parameters()).sqrt().item()
    assert abs(own_norm.value - dense_norm) <= 1e-5 * dense_norm, (own_norm.value, dense_norm)
    assert dense_norm > GRAD_CLIP
    scale = GRAD_CLIP / (own_norm.value + 1e-6)
    dense_grads = {name: p.grad for name, p in dense.named_parameters()}
    assert clipped
    for name, grad in clipped.items():
        key = dense_name(name, config)
        want = _dense_shard(dense_grads[key], key, state.tp_group, config.padded_vocab_size(TP)) * scale
        torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-7, msg=lambda m: f"clipped dL/d{name}: {m}")


def test_zero0_norm_and_clipping_match_the_dense_model_at_tp2_pp2():
    run_distributed(_zero0_norm_is_the_dense_norm, TP * PP)
