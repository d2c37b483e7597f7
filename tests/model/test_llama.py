"""The Llama family (model/transformer/llama.py, model/transformer/rotary.py, RMSNorm, the untied head) against
independent references:
- our dense model against transformers' LlamaForCausalLM built from the same weights (logits and
  loss, fp32, within 1e-5), grouped-query and multi-query, tied and untied, with and without biases;
- the tensor-parallel model at tp=2 and tp=4 with n_kv_head=2 (tp=4: two ranks share each key/value
  head) and n_kv_head=1, with and without sequence parallelism, against the dense model: step-0
  weights, loss, every gradient shard, and the gradient norm counted DeepSpeed's way (a shard on
  every TP rank, a replicated parameter once); with Qwen3's per-head q/k norm at tp=2 over one
  shared key/value head, and OLMoE's norm over the whole projection at tp=2 with SP;
- the DeepSpeed pipeline (tp=2, pp=2, SP, multi-query, untied head as its own stage layer)
  against the dense model: loss and the gradient of one SGD step;
- the recipe checks: one-line errors that name the values and the fix.
"""
import dataclasses
import itertools

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional

from helpers.distributed import run_distributed, sgd_engine, uses_deepspeed
from launch.config.recipe import load_recipe
from launch.errors import ConfigError
from launch.feed.run_inputs import resolved_recipe_dict
from model.config import GPTConfig, ModelConfig, llama_ffn_hidden_size
from model.gpt.layer_table import pipeline_layers
from model.gpt.model import GPT
from model.hf.convert import dense_name, rule_for, split
from model.hf.llama import llama_config_kwargs, to_llama_state_dict
from model.parallel.cross_entropy import vocab_parallel_cross_entropy
from model.parallel.layers import allreduce_sequence_parallel_grads
from model.parallel.state import init_parallel_state

LLAMA = GPTConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden_size=48, seq_len=16,
                  vocab_size=97, vocab_pad_multiple=8, seed=3)


def _ids(config, batch=2, seed=4):
    return torch.randint(0, config.vocab_size, (batch, config.seq_len + 1), generator=torch.Generator().manual_seed(seed))


def _loss(model, ids, group=None):
    return vocab_parallel_cross_entropy(model(ids[:, :-1]), ids[:, 1:], group).mean()


# ------------------------------------------------------------------ against transformers

# Llama 3's RoPE scaling with an original context of 8 < seq_len 16: every frequency of the 8-dim
# heads is divided by the factor or interpolated, so an ignored scaling changes the logits.
LLAMA3_SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8)


@pytest.mark.parametrize("changes", [{}, dict(n_kv_head=1, tie_embeddings=True, bias=True, rope_theta=500000.0),
                                     dict(rope_theta=500000.0, rope_scaling=LLAMA3_SCALING)],
                         ids=["gqa-untied", "mqa-tied-bias-theta5e5", "llama3-rope-scaling"])
def test_dense_llama_matches_transformers(changes):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = dataclasses.replace(LLAMA, **changes)
    ours = GPT(config)
    with torch.no_grad():  # non-trivial norms and biases, so a swapped name would show
        for name, param in ours.named_parameters():
            if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")) or name.endswith(".bias"):
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    theirs = LlamaForCausalLM(LlamaConfig(**llama_config_kwargs(config))).eval()
    dense = {name: param for name, param in ours.named_parameters()}
    theirs.load_state_dict(to_llama_state_dict(dense, config), strict=True)
    ids = _ids(config)
    with torch.no_grad():
        logits_ours = ours(ids[:, :-1])[..., :config.vocab_size]
        logits_theirs = theirs(ids[:, :-1]).logits
        loss_ours = _loss(ours, ids)
        loss_theirs_next = functional.cross_entropy(logits_theirs.reshape(-1, config.vocab_size), ids[:, 1:].reshape(-1))
        # transformers' own labels= path shifts inside: position t predicts label t + 1, so it scores
        # the first T - 1 positions against ids[:, 1:-1]; ours on the same targets.
        loss_theirs = theirs(ids[:, :-1], labels=ids[:, :-1]).loss
        loss_ours_shifted = vocab_parallel_cross_entropy(ours(ids[:, :-1])[:, :-1], ids[:, 1:-1], None).mean()
    assert (logits_ours - logits_theirs).abs().max().item() <= 1e-5
    assert abs(loss_ours.item() - loss_theirs_next.item()) <= 1e-5 * loss_theirs_next.item()
    assert abs(loss_ours_shifted.item() - loss_theirs.item()) <= 1e-5 * loss_theirs.item()
    if config.rope_scaling is not None:  # the scaling matters here: without it the logits move 10x the bar
        unscaled = GPT(dataclasses.replace(config, rope_scaling=None))
        unscaled.load_state_dict(ours.state_dict())
        with torch.no_grad():
            assert (unscaled(ids[:, :-1])[..., :config.vocab_size] - logits_theirs).abs().max().item() > 1e-4


# ------------------------------------------------------------------ tensor parallel vs dense

def _dense_shard(full: torch.Tensor, name: str, group, config: GPTConfig) -> torch.Tensor:
    """This TP rank's part of a dense parameter or gradient, by the export's split rules."""
    tp = dist.get_world_size(group)
    return split(name, full, dist.get_rank(group), tp, config.padded_vocab_size(tp), config)


def _deepspeed_norm_squared(model, group) -> float:
    """ZeRO-1's counting rule (docs/design.md contract 5): a `tensor_model_parallel` parameter on
    every TP rank, any other on TP rank 0 only, summed over the TP group."""
    total = torch.zeros(())
    for param in model.parameters():
        if getattr(param, "tensor_model_parallel", False) or dist.get_rank(group) == 0:
            total += param.grad.pow(2).sum()
    dist.all_reduce(total, group=group)
    return total.item()


def _tp_matches_dense(config: GPTConfig):
    group = dist.new_group(list(range(dist.get_world_size())))
    dense, tp_model = GPT(config), GPT(config, group)
    dense_params = dict(dense.named_parameters())
    for name, param in tp_model.named_parameters():  # layout-invariant init
        torch.testing.assert_close(param.detach(), _dense_shard(dense_params[name].detach(), name, group, config),
                                   rtol=0, atol=0, msg=lambda m: f"step-0 {name}: {m}")
    ids = _ids(config)
    losses = [_loss(dense, ids), _loss(tp_model, ids, group)]
    for loss in losses:
        loss.backward()
    allreduce_sequence_parallel_grads(tp_model, group)  # the once-per-step sum (model/parallel/layers.py)
    assert abs(losses[1].item() - losses[0].item()) <= 1e-5 * losses[0].item(), [x.item() for x in losses]
    for name, param in tp_model.named_parameters():
        want = _dense_shard(dense_params[name].grad, name, group, config)
        torch.testing.assert_close(param.grad, want, rtol=1e-4, atol=2e-6, msg=lambda m: f"dL/d{name}: {m}")
    dense_norm = sum(p.grad.pow(2).sum() for p in dense.parameters()).item()
    assert abs(_deepspeed_norm_squared(tp_model, group) - dense_norm) <= 1e-5 * dense_norm


def _tp_body():
    tp = dist.get_world_size()
    seq = dict(seq_len=4 * tp)
    for changes in (dict(), dict(sequence_parallel=True, recompute_attention=True), dict(n_kv_head=1),
                    dict(n_kv_head=1, sequence_parallel=True, tie_embeddings=True, bias=True)):
        _tp_matches_dense(dataclasses.replace(LLAMA, **seq, **changes))
    if LLAMA.n_kv_head % tp == 0:  # OLMoE's q/k norm over TP-split heads (whole key/value heads per rank: the layout's rule)
        _tp_matches_dense(dataclasses.replace(LLAMA, **seq, qk_norm="projection", sequence_parallel=True))
    # Switches mixed into the gpt2 module layout: RoPE, RMSNorm, an untied head, no biases.
    _tp_matches_dense(GPTConfig(n_layer=2, n_head=4, n_embd=32, vocab_size=97, vocab_pad_multiple=8, seed=3,
                                position="rope", norm="rmsnorm", tie_embeddings=False, bias=False,
                                sequence_parallel=True, **seq))


@pytest.mark.slow  # 20 s (tp=2) and 40 s (tp=4) on 2 shared cores: spawned ranks, five models each
@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_llama_matches_dense(tp):
    run_distributed(_tp_body, tp)


def _shared_kv_head_body():
    _tp_matches_dense(dataclasses.replace(LLAMA, n_kv_head=1, seq_len=8))
    # Qwen3's per-head q/k norm: the shared head's key-norm gradient is summed over the ranks sharing it.
    _tp_matches_dense(dataclasses.replace(LLAMA, n_kv_head=1, seq_len=8, qk_norm="head"))


def test_tensor_parallel_llama_with_a_shared_kv_head_matches_dense():
    """The fast tier's check of contract 5's one exception: at tp=2 > n_kv_head=1 both ranks use
    the one key/value head, each storing half its rows (model/transformer/llama.py)."""
    run_distributed(_shared_kv_head_body, 2)


# ------------------------------------------------------------------ pipeline vs dense

PIPE_CONFIG = dataclasses.replace(LLAMA, n_layer=4, n_kv_head=1, sequence_parallel=True)
MICRO, N_MICRO = 2, 3


@uses_deepspeed
def _pipeline_body(tp, pp):
    state = init_parallel_state(tp, pp)
    engine = sgd_engine(PIPE_CONFIG, state, MICRO, N_MICRO)
    pipe = engine.module
    before = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    dense = GPT(dataclasses.replace(PIPE_CONFIG, sequence_parallel=False))
    dense_params = dict(dense.named_parameters())
    batches = [(t[:, :-1], t[:, 1:]) for t in _ids(PIPE_CONFIG, MICRO * N_MICRO).chunk(N_MICRO)]
    dense_loss = torch.stack([vocab_parallel_cross_entropy(dense(x), y, None).mean() for x, y in batches]).mean()
    train_loss = engine.train_batch(iter(batches)).item()
    assert abs(train_loss - dense_loss.item()) <= 1e-5 * dense_loss.item(), (train_loss, dense_loss.item())
    dense_loss.backward()
    group = state.tp_group
    for name, param in pipe.named_parameters():
        key = dense_name(name, PIPE_CONFIG)
        torch.testing.assert_close(before[name], _dense_shard(dense_params[key].detach(), key, group, PIPE_CONFIG))
        torch.testing.assert_close(before[name] - param.detach(), _dense_shard(dense_params[key].grad, key, group, PIPE_CONFIG),
                                   atol=2e-6, rtol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
def test_pipeline_llama_matches_dense():
    run_distributed(_pipeline_body, 4, 2, 2)


def test_llama_pipeline_table():
    config = dataclasses.replace(LLAMA, n_layer=3)
    assert pipeline_layers(config) == [("embed", None), ("block", 0), ("block", 1), ("block", 2), ("ln_f", None),
                                       ("lm_head", None)]
    tied_learned = dataclasses.replace(config, position="learned", tie_embeddings=True)
    assert pipeline_layers(tied_learned) == [("embed", None), ("wpe", None), ("block", 0), ("block", 1), ("block", 2),
                                             ("ln_f", None), ("head", None)]  # GPT-2's table
    assert dense_name("5.weight", config) == "lm_head.weight" and rule_for("lm_head.weight").vocab


# ------------------------------------------------------------------ recipe: presets and errors

def test_presets_fill_only_unset_switches():
    llama = ModelConfig(arch="llama", n_embd=4096, n_head=32, n_kv_head=8).resolved()
    assert (llama.position, llama.norm, llama.mlp, llama.tie_embeddings, llama.bias) == ("rope", "rmsnorm", "swiglu",
                                                                                         False, False)
    assert llama.n_kv_head == 8 and llama.ffn_hidden_size == 11008 == llama_ffn_hidden_size(4096)
    gpt2 = ModelConfig().resolved()
    assert (gpt2.position, gpt2.norm, gpt2.mlp, gpt2.n_kv_head, gpt2.ffn_hidden_size, gpt2.tie_embeddings,
            gpt2.bias) == ("learned", "layernorm", "gelu", 12, 3072, True, True)


def _derive(overrides, tp=1):
    from launch.config.layout import check_and_derive_layout
    recipe = load_recipe(REPO_RECIPE, overrides)
    return check_and_derive_layout(recipe, tp, tp, 1, on_cpu=True)


REPO_RECIPE = __import__("pathlib").Path(__file__).resolve().parents[2] / "recipes" / "llama-tiny.yaml"


@pytest.mark.parametrize("overrides,tp,needle", [
    (["model.n_kv_head=3"], 1, "model.n_kv_head=3 must divide model.n_head=4"),
    (["model.n_head=6", "model.n_kv_head=3", "model.n_embd=96", "model.ffn_hidden_size=96"], 2,
     "tp must divide n_kv_head (each rank holds its own key/value heads) or n_kv_head must divide tp"),
    (["model.ffn_hidden_size=170"], 4, "model.ffn_hidden_size=170 must be >= 1 and divisible by --tp 4"),
    (["model.arch=gpt2", "model.mlp=swiglu"], 1, "set model.arch=llama"),
    (["model.arch=gpt2"], 1, "model.n_kv_head=2 with model.arch=gpt2"),
    (["model.arch=mistral"], 1, "model.arch='mistral' is not one of gpt2, llama"),
    (["model.norm=batchnorm"], 1, "model.norm='batchnorm' is not one of layernorm, rmsnorm"),
    (["model.n_embd=60", "model.n_head=4", "model.n_kv_head=1"], 1, "even head size"),
    (["model.n_kv_head=1", "model.n_head=8", "model.n_embd=16"], 8, "1/8 of its 2 rows"),
    (["model.rope_scaling={factor: 8}"], 1, "model.rope_scaling has keys factor; Llama 3's scaling takes exactly"),
    (["model.rope_scaling={factor: 8, low_freq_factor: 4, high_freq_factor: 1, original_max_position_embeddings: 8}"],
     1, "must be numbers > 0 with low_freq_factor < high_freq_factor"),
    (["model.position=learned", "model.rope_scaling={factor: 8}"], 1, "set model.position=rope or drop"),
], ids=["kv-not-dividing-heads", "tp-vs-kv", "ffn-vs-tp", "gpt2-swiglu", "gpt2-gqa", "arch",
        "norm", "rope-odd-head", "kv-rows", "rope-scaling-keys", "rope-scaling-order", "rope-scaling-learned"])
def test_bad_architecture_is_one_line(overrides, tp, needle):
    with pytest.raises(ConfigError) as error:
        _derive(overrides, tp)
    message = str(error.value)
    assert needle in message and "\n" not in message, message


def test_llama_tiny_fits_every_layout_and_saves_its_switches():
    """The recipe's promise: every layout up to tp=4 (two ranks per key/value head), pp=4, dp=2,
    with its global batch of 16 split into micro-batches of 2 over dp."""
    from launch.config.layout import Layout, check_and_derive_layout
    recipe = load_recipe(REPO_RECIPE, [])
    for tp, pp, dp in itertools.product((1, 2, 4), (1, 2, 4), (1, 2)):
        layout = check_and_derive_layout(recipe, tp * pp * dp, tp, pp, on_cpu=True)
        assert layout == Layout(world_size=tp * pp * dp, tp=tp, pp=pp, dp=dp, micro_batch_size=2,
                                global_batch_size=16, grad_accum_steps=16 // (2 * dp)), layout
    saved = resolved_recipe_dict(load_recipe(REPO_RECIPE, []), 512)["model"]
    assert saved["position"] == "rope" and saved["n_kv_head"] == 2 and saved["tie_embeddings"] is False
