"""The planner's counts for the Llama family (launch/analysis/formulas.py) against independent
references: transformers' LlamaForCausalLM on the meta device for the three GPU recipes'
shapes (parameters, exactly, and the published counts), the parameters our model really
builds, torch's FLOP counter on our model's forward, and GPT-2's closed forms (which the
general functions must reproduce bit for bit)."""
import dataclasses
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from launch.analysis import formulas, memory_formulas, partition
from launch.analysis.plan_setup import GPUS, Hardware, Setup
from launch.analysis.planner import estimate_plan
from launch.config.layout import check_and_derive_layout
from launch.config.recipe import load_recipe
from model.config import GPTConfig, ModelConfig
from model.gpt.model import GPT

REPO = Path(__file__).resolve().parents[2]
# (recipe, published parameters: the model cards / config.json, as transformers counts them)
PUBLISHED = [("tinyllama-1.1b", 1_100_048_384), ("llama3.2-1b", 1_235_814_400), ("llama2-7b", 6_738_415_616)]


@pytest.mark.parametrize("name,published", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_planner_parameters_equal_transformers_on_meta(name, published):
    from transformers import LlamaConfig, LlamaForCausalLM

    from model.hf.llama import llama_config_kwargs
    recipe = load_recipe(REPO / "recipes" / f"{name}.yaml", [])
    config = GPTConfig(**dataclasses.asdict(recipe.model))
    with torch.device("meta"):
        theirs = LlamaForCausalLM(LlamaConfig(**llama_config_kwargs(config)))
    counted = sum(p.numel() for p in theirs.parameters())  # a tied head is one parameter, counted once
    plan = estimate_plan(recipe.model, Setup(gpus=64, tp=2, pp=2, micro_batch=1, global_batch=1024),
                         Hardware(GPUS["H100"].peak_flops, 450e9, 50e9))
    assert plan["params_total"] == formulas.model_params(config) == counted == published
    # Valid at a cluster layout, and the per-rank counts at tp=2, pp=2 add up to the whole plus what
    # the layout adds: padded vocabulary rows, the last stage's copy of a tied head, a second copy
    # of the replicated RMSNorm weights (2 per block and the final one; no biases).
    check_and_derive_layout(recipe, 64, 2, 2, on_cpu=False)
    h, padded_vocab = config.n_embd, config.padded_vocab_size(2)
    vocab_matrices = 1 if config.tie_embeddings else 2
    added = ((padded_vocab - config.vocab_size) * h * vocab_matrices + (padded_vocab * h if config.tie_embeddings else 0)
             + (2 * config.n_layer + 1) * h)
    assert 2 * sum(plan["params_per_stage"]) == published + added


def _built_params(config: GPTConfig) -> int:
    model = GPT(config)
    padding = (config.padded_vocab_size(1) - config.vocab_size) * config.n_embd
    return sum(p.numel() for p in model.parameters()) - padding * (1 if config.tie_embeddings else 2)


@pytest.mark.parametrize("changes", [dict(arch="llama"), dict(arch="llama", n_kv_head=1, tie_embeddings=True, bias=True,
                                                               position="learned", norm="layernorm", mlp="gelu"),
                                     dict(position="rope", norm="rmsnorm", tie_embeddings=False, bias=False)],
                         ids=["llama-gqa", "llama-mqa-mixed", "gpt2-mixed"])
def test_parameters_and_flops_of_the_built_model(changes):
    llama = dict(n_kv_head=2, ffn_hidden_size=176) if changes.get("arch") else {}
    config = GPTConfig(n_layer=2, n_head=4, n_embd=64, seq_len=32, **dict(llama, **changes),
                       vocab_size=304, vocab_pad_multiple=8)  # no padding: torch counts the padded logits too
    assert formulas.model_params(config) == _built_params(config)
    one_stage = partition.stage_partition(config, 1, "blocks")
    assert formulas.model_stage_params_per_rank(config, 1, 1, 0, one_stage) == formulas.model_params(config) + (
        (config.padded_vocab_size(1) - config.vocab_size) * config.n_embd * (1 if config.tie_embeddings else 2))
    b, s = 2, config.seq_len
    with FlopCounterMode(display=False) as counter:
        GPT(config)(torch.randint(0, 304, (b, s)))
    # torch counts the matmuls; the attention core (QK^T and @V, 4*b*s^2*a*d per layer) runs in
    # SDPA, which the CPU counter leaves out. Forward + backward = 3x forward.
    core = 4 * b * s * s * config.n_head * config.head_dim * config.n_layer
    assert formulas.model_flops_per_step_of(config, b, s) == pytest.approx(3 * (counter.get_total_flops() + core), rel=1e-12)


@pytest.mark.parametrize("l,h,a,V,s", [(12, 768, 12, 50257, 1024), (4, 64, 4, 512, 32), (24, 2048, 16, 50257, 2048)])
def test_general_formulas_are_gpt2_closed_forms_for_gpt2(l, h, a, V, s):
    m = ModelConfig(n_layer=l, n_embd=h, n_head=a, vocab_size=V, seq_len=s).resolved()
    assert formulas.model_params(m) == formulas.params_exact(l, h, V, s)
    for recompute in (False, True):
        assert formulas.model_flops_per_step_of(m, 64, s, recompute) == formulas.model_flops_per_step(64, s, l, h, V, recompute)
    for tp, pp in ((1, 1), (2, 2), (4, 3)):
        parts = partition.stage_partition(m, pp, "blocks")
        assert [formulas.model_stage_params_per_rank(m, tp, pp, k, parts) for k in range(pp)] == \
            [formulas.stage_params_per_rank(l, h, V, s, tp, pp, k, parts=parts) for k in range(pp)]


# ------------------------------------------------------------------ activation memory

def _saved_block_bytes(config: GPTConfig, batch: int, dtype: torch.dtype = torch.float32) -> int:
    from bench.memory.activation_memory import saved_activation_bytes
    from model.transformer.block import Block
    block = Block(config, 0, None).train().to(dtype)
    x = torch.randn(batch, config.seq_len, config.n_embd, requires_grad=True, dtype=dtype)
    return saved_activation_bytes(lambda: block(x), block.parameters())


@pytest.mark.parametrize("changes", [dict(), dict(mlp="gelu"), dict(norm="layernorm"),
                                     dict(position="learned", mlp="gelu", norm="layernorm")],
                         ids=["llama", "gelu", "layernorm", "gpt2-like"])
def test_activation_formula_is_what_autograd_saves(changes):
    """fp32 (E = 4), CPU dropout masks of 4 bytes, norm statistics of 4 bytes, dropout > 0 so that
    SDPA stores its scores (the core term): the count equals the saved bytes exactly (tp=1).
    n_kv_head = n_head here: SDPA's math path saves k and v expanded to all heads anyway."""
    config = GPTConfig(arch="llama", n_layer=2, n_head=4, n_embd=32, ffn_hidden_size=64, seq_len=16, vocab_size=50,
                       dropout=0.1, **changes)
    formula = memory_formulas.model_activation_bytes_per_layer(config, config.seq_len, 2, element_bytes=4, mask_bytes=4,
                                                        layernorm_stat_bytes=4)
    assert formula == _saved_block_bytes(config, 2)


@pytest.mark.parametrize("changes", [dict(), dict(n_kv_head=2), dict(arch="gpt2", ffn_hidden_size=None)],
                         ids=["llama", "llama-gqa", "gpt2"])
@pytest.mark.parametrize("selective", [False, True], ids=["none", "selective"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_attention_formula_is_what_autograd_saves(changes, selective, dtype):
    """Dropout 0: SDPA takes its fused (flash) kernel, on CPU as on GPU, and stores no s x s
    scores: the fused count (a logsumexp per row and head; nothing of the core under selective
    recompute) equals the saved bytes exactly, grouped-query heads unexpanded, in fp32 and in bf16
    (RMSNorm's fp32 copy of its input). The planner counts this path (it plans for GPUs). The
    device assumption passed here: CPU keeps LayerNorm's mean and 1/std in the input's dtype
    (CUDA in fp32, the planner's 4 bytes); RMSNorm's 1/rms is fp32 on both."""
    config = GPTConfig(**dict(dict(arch="llama", n_layer=2, n_head=4, n_embd=32, ffn_hidden_size=64, seq_len=16,
                                   vocab_size=50, dropout=0.0, recompute_attention=selective), **changes))
    element = torch.finfo(dtype).bits // 8
    stats = 4 if config.norm == "rmsnorm" else element
    formula = memory_formulas.model_activation_bytes_per_layer(config, config.seq_len, 2, selective=selective,
                                                               element_bytes=element, mask_bytes=0,
                                                               layernorm_stat_bytes=stats, fused_attention=True)
    assert formula == _saved_block_bytes(config, 2, dtype)


@pytest.mark.parametrize("l,h,a,s,b,t", [(12, 768, 12, 1024, 4, 2), (4, 64, 4, 32, 2, 4)])
def test_activation_and_layer_flops_are_gpt2s_for_gpt2(l, h, a, s, b, t):
    m = ModelConfig(n_layer=l, n_embd=h, n_head=a, seq_len=s, vocab_size=100).resolved()
    for kwargs in (dict(), dict(sequence_parallel=True), dict(selective=True), dict(recompute=True),
                   dict(fused_attention=True)):
        assert memory_formulas.model_activation_bytes_per_layer(m, s, b, t, **kwargs) == \
            memory_formulas.activation_bytes_per_layer(s, b, h, a, t, **kwargs)
    for recompute in (False, True):
        assert formulas.model_layer_flops_per_microbatch(m, b, s, recompute) == \
            formulas.layer_flops_per_microbatch(b, s, h, recompute)


OFFLINE = ["data.name=builtin", "data.config=null", "data.revision=null", "data.tokenizer=builtin", "data.streaming=false",
           "model.n_layer=2", "model.n_embd=64", "model.n_head=4", "model.n_kv_head=2", "model.ffn_hidden_size=176",
           "model.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=4", "train.eval_every=0"]


@pytest.mark.parametrize("name,tp", [("tinyllama-1.1b", 4), ("llama3.2-1b", 8), ("llama2-7b", 8)])
def test_gpu_recipes_name_their_tokenizer_and_run_offline(name, tp):
    from data.builtin import BUILTIN_VOCAB_SIZE
    from launch.feed.run_inputs import check_vocab
    path = REPO / "recipes" / f"{name}.yaml"
    recipe = load_recipe(path, [])
    assert recipe.data.tokenizer != "builtin" and recipe.model.arch == "llama"
    check_and_derive_layout(recipe, 8 * tp, tp, 1, on_cpu=False)  # the largest tp the header names
    offline = load_recipe(path, OFFLINE)
    check_and_derive_layout(offline, 1, 1, 1, on_cpu=True)
    assert check_vocab(offline, BUILTIN_VOCAB_SIZE) == recipe.model.vocab_size  # the published vocabulary kept


def test_kv_gather_traffic_only_when_tp_exceeds_kv_heads():
    m = ModelConfig(arch="llama", n_layer=4, n_head=32, n_kv_head=8, n_embd=2048, vocab_size=100).resolved()
    assert formulas.kv_gather_bytes_per_step(m, 8, 4, 3) == 0
    # tp 16: per block per micro-batch, k and v (8 heads x 64 rows x 2048) gathered and reduce-scattered
    assert formulas.kv_gather_bytes_per_step(m, 16, 4, 3) == 2 * 2 * 8 * 64 * 2048 * 2 * 4 * 3
    gpt2 = ModelConfig(n_layer=4, n_head=16, n_embd=1024, vocab_size=100).resolved()
    assert formulas.kv_gather_bytes_per_step(gpt2, 8, 4, 3) == 0
