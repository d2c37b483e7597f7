"""The DeepSpeed pipeline model against its sequential form: the dense GPT of model/gpt/model.py run
in one process. Same loss through `eval_batch`, and the same gradient (one SGD step of lr 1
applied by the engine), shard by shard, including the tied embedding whose gradient
DeepSpeed sums over the first and last stage. With sequence parallelism too: stage-to-stage
tensors are per-TP-rank sequence chunks, LayerNorm gradients are summed over TP."""
import dataclasses

import pytest
import torch
import torch.distributed as dist

from helpers.distributed import run_distributed, sgd_engine, uses_deepspeed
from model.config import GPTConfig
from model.gpt.model import GPT
from model.hf.convert import dense_name
from model.parallel.cross_entropy import vocab_parallel_cross_entropy
from model.parallel.layers import shard_rows
from model.parallel.state import init_parallel_state

CONFIG = GPTConfig(n_layer=4, n_head=4, n_embd=32, seq_len=16, vocab_size=101, vocab_pad_multiple=4, seed=5)
MICRO, N_MICRO = 2, 3


def _batches():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, CONFIG.vocab_size, (N_MICRO, MICRO, CONFIG.seq_len + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _local_shard(full: torch.Tensor, param: torch.Tensor, group) -> torch.Tensor:
    if not getattr(param, "tensor_model_parallel", False):
        return full
    if param.partition_dim == 0:
        if full.size(0) < param.size(0) * (1 if group is None else dist.get_world_size(group)):
            full = torch.cat([full, full.new_zeros(param.size(0) * dist.get_world_size(group) - full.size(0),
                                                   *full.shape[1:])])  # vocab padding of this tp
        return shard_rows(full, group, param.partition_stride)
    return shard_rows(full.t(), group).t()


@uses_deepspeed
def _pipeline_body(tp, pp, sequence_parallel):
    state = init_parallel_state(tp, pp)
    engine = sgd_engine(dataclasses.replace(CONFIG, sequence_parallel=sequence_parallel), state, MICRO, N_MICRO)
    pipe = engine.module
    before = {n: p.detach().clone() for n, p in pipe.named_parameters()}

    dense = GPT(CONFIG)
    dense_params = dict(dense.named_parameters())
    for name, value in before.items():  # step-0 weights are the dense model's, shard by shard
        local = dict(pipe.named_parameters())[name]
        full = dense_params[dense_name(name, CONFIG)].detach()
        torch.testing.assert_close(value, _local_shard(full, local, state.tp_group))

    eval_loss = engine.eval_batch(iter(_batches())).item()
    dense_loss = torch.stack([vocab_parallel_cross_entropy(dense(x), y, None).mean() for x, y in _batches()]).mean()
    assert abs(eval_loss - dense_loss.item()) <= 1e-5 * dense_loss.item(), (eval_loss, dense_loss.item())

    train_loss = engine.train_batch(iter(_batches())).item()
    assert abs(train_loss - dense_loss.item()) <= 1e-5 * dense_loss.item()
    if engine.is_last_stage():  # DeepSpeed keeps the last stage's outputs (the logits) after backward
        kept = [t.untyped_storage().nbytes() for t in engine.pipe_buffers["outputs"] if t is not None]
        assert kept and not any(kept), f"finished micro-batches' logits still hold {kept} bytes"
    dense_loss.backward()
    for name, param in pipe.named_parameters():  # SGD lr 1: the engine's gradient = before - after
        pipe_grad = before[name] - param.detach()
        dense_grad = _local_shard(dense_params[dense_name(name, CONFIG)].grad, param, state.tp_group)
        torch.testing.assert_close(pipe_grad, dense_grad, atol=2e-6, rtol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("tp,pp,sequence_parallel", [(2, 2, False), (1, 3, False), (2, 2, True)],
                         ids=["tp2-pp2", "tp1-pp3", "tp2-pp2-sp"])
def test_pipeline_matches_sequential_model(tp, pp, sequence_parallel):
    run_distributed(_pipeline_body, tp * pp, tp, pp, sequence_parallel)
