"""The mixture-of-experts metrics (launch/instruments/moe_metrics.py, model/transformer/moe_losses.py) against a
direct count of the router's choices: every MoE block's input is captured by a forward hook, and
the router's logits, softmax, top-k, load-balancing loss (transformers' own function) and z-loss are
recomputed from it and the router's weight with plain torch ops, micro-batch by micro-batch.

- In process: the dense GPT of model/gpt/model.py (blocks 1 and 3 of 4 MoE), several micro-batches with
  gradients, its records through `loss_summary`; nothing recorded under no_grad (evaluation).
- On 4 gloo processes, the run's engine (tests/helpers/distributed.py) under full recompute, whose
  checkpointed forward runs under no_grad and again with gradients in backward: each micro-batch is
  recorded once; `moe_step_record`'s sums over the data axis (dp, cp) and the pipeline stages equal
  the count over every rank's own tokens; `eval_batch` records nothing.
- wandb offline: the per-block imbalance series and the router losses reach the run file,
  MetricsLogger in this process (no run launched).
"""
import dataclasses
import json

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional

from helpers.distributed import run_distributed, sgd_engine, uses_deepspeed
from model.config import GPTConfig
from model.gpt.model import GPT
from model.moe_config import MoEConfig
from model.transformer.moe import MoEMLP
from model.transformer.moe_losses import loss_summary

E, K = 8, 2
# recipes/moe-tiny.yaml's model at a smaller vocabulary and sequence: qwen3_moe, a shared expert.
CONFIG = GPTConfig(arch="qwen3_moe", n_layer=4, n_head=4, n_kv_head=2, n_embd=64, seq_len=16, vocab_size=101,
                   seed=3, moe=MoEConfig(num_experts=E, experts_per_token=K, expert_ffn_hidden_size=32,
                                         shared_experts=1, aux_loss_coef=0.01, z_loss_coef=0.001))
MICRO, N_MICRO = 2, 3


def _batches(seed: int, n: int = N_MICRO):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CONFIG.vocab_size, (n, MICRO, CONFIG.seq_len + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


class BlockInputs:
    """Forward hooks on every MoEMLP of `module`: per block, in call order, each call's input
    (B, T_local, h), its router's weight then (an optimizer step changes it later), and whether
    gradients were on."""

    def __init__(self, module: torch.nn.Module):
        self.calls = {}
        for mlp in module.modules():
            if isinstance(mlp, MoEMLP):
                self.calls[mlp.layer_index] = []
                mlp.register_forward_hook(self._hook)

    def _hook(self, mlp, inputs, output):
        self.calls[mlp.layer_index].append(
            (inputs[0].detach().clone(), mlp.router.weight.detach().clone(), torch.is_grad_enabled()))


def router_totals(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """From a block's input rows and its router's weight, without model code: (2E + 2,) = the
    assignments per expert of the top-k choice, the summed softmax probabilities per expert, the
    summed squared logsumexp of the logits, the number of tokens."""
    logits = functional.linear(x.reshape(-1, x.size(-1)).float(), weight.detach().float())  # (N, E)
    probs = torch.softmax(logits, dim=-1)
    chosen = torch.topk(probs, K, dim=-1).indices  # (N, k)
    counts = functional.one_hot(chosen, E).sum(dim=(0, 1)).to(torch.float64)
    lse_squared = torch.logsumexp(logits, dim=-1).pow(2).sum()
    return torch.cat([counts, probs.sum(0).double(), lse_squared.double().view(1),
                      torch.tensor([float(logits.size(0))], dtype=torch.float64)])


def micro_batch_values(totals: torch.Tensor):
    """(aux, z, counts) of one micro-batch from its router_totals summed over the ranks holding it:
    Switch's E * sum_e f_e P_e (f_e: the share of the k assignments per token, summing to k) and
    the mean squared logsumexp."""
    counts, prob_sum, lse_squared, tokens = totals[:E], totals[E:2 * E], totals[2 * E], totals[2 * E + 1]
    return E * ((counts / tokens) * (prob_sum / tokens)).sum(), lse_squared / tokens, counts


def expected_summary(per_micro_batch):
    """{block: [(aux, z, counts) of each micro-batch]} -> what `loss_summary` reports: the mean over
    blocks of each block's mean over micro-batches, the counts summed, the worst max / mean."""
    blocks = sorted(per_micro_batch)
    aux = torch.stack([torch.stack([v[0] for v in per_micro_batch[b]]).mean() for b in blocks]).mean()
    z = torch.stack([torch.stack([v[1] for v in per_micro_batch[b]]).mean() for b in blocks]).mean()
    load = {b: torch.stack([v[2] for v in per_micro_batch[b]]).sum(0) for b in blocks}
    imbalance = max(float(c.max() / c.mean()) for c in load.values())
    return {"aux_loss": float(aux), "z_loss": float(z), "expert_load_max_over_mean": imbalance,
            "expert_load": {str(b): [int(c) for c in load[b].tolist()] for b in blocks}}


def assert_summary(got, expected):
    assert got["expert_load"] == expected["expert_load"]  # exact: counts of the same choices
    for key in ("aux_loss", "z_loss", "expert_load_max_over_mean"):
        assert got[key] == pytest.approx(expected[key], rel=1e-6, abs=1e-9), key


# ---------------------------------------------------------------- in process

def test_records_are_the_routers_choices_and_losses_in_process():
    """Blocks 1 and 3 are MoE (moe_every 2): per block and micro-batch the assignments per expert,
    the load-balancing loss (transformers' load_balancing_loss_func on the same logits) and the
    z-loss, then loss_summary's means over micro-batches and blocks, match the direct count.
    A forward under no_grad (evaluation) records nothing."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    config = dataclasses.replace(CONFIG, moe=dataclasses.replace(CONFIG.moe, moe_every=2))
    model = GPT(config)
    hooks = BlockInputs(model)
    assert sorted(hooks.calls) == [1, 3]
    for x, y in _batches(11):
        logits = model(x)
        functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    records = model.moe_statistics.take()
    assert records[[0, 2]].abs().sum() == 0  # the dense blocks record nothing
    per_micro_batch = {}
    for block, calls in hooks.calls.items():
        assert len(calls) == N_MICRO and all(grad for _, _, grad in calls)
        per_micro_batch[block] = [micro_batch_values(router_totals(x, w)) for x, w, _ in calls]
        for (x, w, _), (aux, _, counts) in zip(calls, per_micro_batch[block]):
            assert counts.sum() == MICRO * config.seq_len * K
            router_logits = functional.linear(x.reshape(-1, config.n_embd), w)
            theirs = load_balancing_loss_func((router_logits,), E, K)  # transformers' normalisation
            assert float(aux) == pytest.approx(float(theirs), rel=1e-6)
        assert records[block, 2] == N_MICRO  # micro-batches recorded
    assert_summary(loss_summary(records, [1, 3]), expected_summary(per_micro_batch))

    with torch.no_grad():  # evaluation: the router runs, nothing is recorded
        for x, _ in _batches(12):
            model(x)
    assert model.moe_statistics.take().abs().sum() == 0


def test_a_uniform_router_scores_k():
    """Router weights of zero: every probability 1/E, so aux = E * sum_e f_e / E = sum_e f_e = k
    (transformers' normalisation, whatever the load), z = (ln E)^2; the tied logits go to the k
    lowest experts (ties to the lower index), so each block's load is all on experts 0..k-1, E/k
    times the mean."""
    import math
    model = GPT(CONFIG)
    for mlp in model.modules():
        if isinstance(mlp, MoEMLP):
            torch.nn.init.zeros_(mlp.router.weight)
    for x, y in _batches(14, n=2):
        functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    summary = loss_summary(model.moe_statistics.take(), list(range(CONFIG.n_layer)))
    assert summary["aux_loss"] == pytest.approx(K, rel=1e-6)
    assert summary["z_loss"] == pytest.approx(math.log(E) ** 2, rel=1e-6)
    assert summary["expert_load_max_over_mean"] == pytest.approx(E / K)
    tokens = 2 * MICRO * CONFIG.seq_len
    assert summary["expert_load"] == {str(i): [tokens] * K + [0] * (E - K) for i in range(CONFIG.n_layer)}


# ---------------------------------------------------------------- on gloo processes, the run's engine

@uses_deepspeed
def _engine_body(tp, pp, cp, ep, sequence_parallel):
    """One step of N_MICRO micro-batches under full recompute, then moe_step_record against the
    count over every rank's hooked inputs; then an evaluation that records nothing."""
    from launch.instruments.moe_metrics import gather_step_records, moe_step_record
    from model.parallel.context_parallel import sequence_shards
    from model.transformer.moe_losses import stage_statistics
    from model.parallel.state import init_parallel_state
    config = dataclasses.replace(CONFIG, sequence_parallel=sequence_parallel)
    state = init_parallel_state(tp, pp, cp, ep, experts=True)
    engine = sgd_engine(config, state, MICRO, N_MICRO, full_recompute=True)
    assert engine.module.activation_checkpoint_interval > 0  # DeepSpeed's checkpointed forward
    hooks = BlockInputs(engine.module)
    feed = sequence_shards(iter(_batches(100 + state.dp_rank)), state.cp_rank, state.cp_size)
    engine.train_batch(data_iter=feed)

    # Each micro-batch ran each block twice here: the checkpointed forward under no_grad, the
    # recompute in backward with gradients, on the same input (1F1B interleaves them; each kind
    # runs the micro-batches in order).
    totals = torch.zeros(state.dp_size, N_MICRO, config.n_layer, 2 * E + 2, dtype=torch.float64)
    owns_tokens = sequence_parallel or state.tp_rank == 0  # without SP the TP ranks route the same tokens
    for block, calls in hooks.calls.items():
        forwards = [(x, w) for x, w, grad in calls if not grad]
        recomputed = [(x, w) for x, w, grad in calls if grad]
        assert len(forwards) == len(recomputed) == N_MICRO, (block, [grad for _, _, grad in calls])
        for m, ((x, w), (x_again, w_again)) in enumerate(zip(forwards, recomputed)):
            torch.testing.assert_close(x_again, x, rtol=0, atol=0)
            torch.testing.assert_close(w_again, w, rtol=0, atol=0)
            if owns_tokens:
                totals[state.dp_rank, m, block] = router_totals(x, w)
    dist.all_reduce(totals)  # a micro-batch's parts: its TP (SP) and CP ranks' tokens; blocks: their stage's
    per_micro_batch = {b: [micro_batch_values(totals[d, m, b]) for d in range(state.dp_size) for m in range(N_MICRO)]
                       for b in range(config.n_layer)}
    assert totals[..., :E].sum() == state.dp_size * N_MICRO * config.n_layer * MICRO * config.seq_len * K

    record = moe_step_record(gather_step_records(engine, config, state.cp_size), config)  # collective, as the run's
    assert_summary(record, expected_summary(per_micro_batch))

    engine.eval_batch(data_iter=sequence_shards(iter(_batches(200 + state.dp_rank)), state.cp_rank, state.cp_size))
    statistics = stage_statistics(engine.module)
    assert statistics.take().abs().sum() == 0  # evaluation runs under no_grad: no records


@pytest.mark.parametrize("tp,pp,cp,ep,sequence_parallel", [
    (1, 2, 1, 2, False),  # dp 2, experts over both data ranks, two stages
    # tp 2 with sequence-parallel chunks, cp 2 (each records the micro-batch), ep over cp; slow: the fast tier's budget
    pytest.param(2, 1, 2, 2, True, marks=pytest.mark.slow),
], ids=["pp2-dp2-ep2", "tp2-sp-cp2-ep2"])
def test_step_record_counts_every_micro_batch_once_under_full_recompute(tp, pp, cp, ep, sequence_parallel):
    run_distributed(_engine_body, 4, tp, pp, cp, ep, sequence_parallel)


# ---------------------------------------------------------------- wandb

def written_run_file(path, timeout_s: float = 30.0) -> bytes:
    """The run file's bytes once its history is on disk: `finish` returns in this process while
    wandb's core service may still be writing (seen once: the bare 7-byte header), so shut the
    service down, then wait for the history's first key."""
    import time

    import wandb
    wandb.teardown()
    deadline = time.monotonic() + timeout_s
    while True:
        content = path.read_bytes()
        if b"tokens_per_s" in content or time.monotonic() > deadline:
            return content
        time.sleep(0.2)


@pytest.mark.slow  # wandb's offline writer takes seconds to start and finish: the fast tier's budget
def test_wandb_offline_charts_each_blocks_imbalance_and_the_router_losses(tmp_path, monkeypatch):
    """MetricsLogger with wandb offline, given a step record with the MoE metrics of the in-process
    model: the run file holds expert_load_max_over_mean/block<i> of each MoE block with its value,
    aux_loss and z_loss with theirs, and not the full counts (those stay in --metrics-out)."""
    from launch.config.layout import Layout
    from launch.instruments import metrics
    from launch.instruments.moe_metrics import charted_moe_metrics
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    model = GPT(CONFIG)
    for x, y in _batches(13, n=1):
        functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    moe = loss_summary(model.moe_statistics.take(), list(range(CONFIG.n_layer)))
    layout = Layout(world_size=1, tp=1, pp=1, dp=1, micro_batch_size=MICRO, global_batch_size=MICRO, grad_accum_steps=1)
    run = metrics.RunArithmetic(params=1, layout=layout, seq_len=CONFIG.seq_len, total_steps=1, tokens_per_step=32,
                                model_flops_per_step=1e9, bubble_fraction=0.0, peak_flops=None, peak_source="test")
    logger = metrics.MetricsLogger(tmp_path / "m.jsonl", "offline", "gpt3d-test", None, {}, run)
    logger.log(dict({"step": 1, "samples": MICRO, "loss": 4.5, "grad_norm": 1.0, "lr": 1e-3, "loss_scale": 1.0,
                     "tokens": 32, "tokens_per_s": 16.0, "step_time_s": 2.0, "peak_memory_bytes": 2 ** 30,
                     "peak_reserved_bytes": None}, **moe))
    logger.close()
    (line,) = (tmp_path / "m.jsonl").read_text().splitlines()
    assert json.loads(line)["expert_load"] == moe["expert_load"]  # the full counts: in the metrics file

    charted = charted_moe_metrics(moe)
    assert sorted(charted) == [f"expert_load_max_over_mean/block{i}" for i in range(CONFIG.n_layer)]
    assert max(charted.values()) == pytest.approx(moe["expert_load_max_over_mean"])
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    (run_file,) = run_dir.glob("run-*.wandb")
    content = written_run_file(run_file)  # protobuf records; keys and JSON values verbatim
    for key, value in dict(charted, aux_loss=moe["aux_loss"], z_loss=moe["z_loss"]).items():
        assert key.encode() in content, key
        assert json.dumps(value).encode() in content, (key, value)
    # No full counts: every "expert_load" is an imbalance, each block's or the worst (the record's own key).
    assert content.count(b"expert_load") == content.count(b"expert_load_max_over_mean")
