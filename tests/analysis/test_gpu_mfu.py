"""The GPT-2 recipes and bench/gpu/gpu_mfu.py.

The recipes: they parse, their parameter counts are the published ones, they are valid at a
cluster layout and offline with the embedded tokenizer, and the benchmark's step sizes fit one
80 GB GPU by the planner's formulas. The script: it runs on CPU at toy sizes through
launch/train.py, and its table and JSON report the FLOPs torch counts in the toy model.
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import step_clock
from bench.gpu import gpu_mfu
from data.builtin import BUILTIN_VOCAB_SIZE
from helpers.flop_count import counted_flops
from launch import plan
from launch.analysis import formulas
from launch.config.layout import check_and_derive_layout
from launch.config.recipe import load_recipe
from launch.feed.run_inputs import check_vocab
from model.config import GPTConfig, padded_vocab_size
from model.gpt.model import GPT

REPO = Path(__file__).resolve().parents[2]

# (recipe, n_layer, n_embd, n_head, published parameters)
PUBLISHED = [
    ("gpt2-124m", 12, 768, 12, 124_439_808),   # GPT-2 small, as transformers counts it
    ("gpt2-350m", 24, 1024, 16, 354_823_168),  # GPT-2 medium ("355M")
    ("gpt2-1.3b", 24, 2048, 16, 1.3e9),        # GPT-3 XL, Brown et al. 2020 table 2.1 ("1.3B")
]
GIB = 2 ** 30


@pytest.mark.parametrize("name,layers,hidden,heads,published", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_recipe_parses_with_the_published_size(name, layers, hidden, heads, published):
    recipe = load_recipe(REPO / "recipes" / f"{name}.yaml", [])
    model_cfg, train_cfg = recipe.model, recipe.train
    assert (model_cfg.n_layer, model_cfg.n_embd, model_cfg.n_head, model_cfg.seq_len) == (layers, hidden, heads, 1024)
    assert (model_cfg.vocab_size, model_cfg.vocab_pad_multiple) == (50257, 128)
    assert (train_cfg.precision, train_cfg.zero_stage) == ("bf16", 1)
    params = formulas.params_exact(model_cfg.n_layer, model_cfg.n_embd, model_cfg.vocab_size, model_cfg.seq_len)
    if isinstance(published, int):
        assert params == published
    else:  # published rounded to two digits
        assert round(params, -8) == published, params


@pytest.mark.parametrize("name", gpu_mfu.RECIPES)
def test_recipe_is_valid_on_a_cluster_and_offline(name):
    path = REPO / "recipes" / f"{name}.yaml"
    recipe = load_recipe(path, [])
    # 64 GPUs as tp 2 x pp 2 x dp 16: the batch divides, the heads divide.
    layout = check_and_derive_layout(recipe, 64, 2, 2, on_cpu=False)
    assert layout.dp == 16 and layout.grad_accum_steps * 16 * recipe.train.micro_batch_size == recipe.train.global_batch_size
    # The benchmark's offline run: the embedded tokenizer fits the GPT-2 vocabulary.
    bench = load_recipe(path, gpu_mfu.recipe_overrides(name, gpu_mfu.parse_args([]), recipe.train.micro_batch_size))
    assert bench.data.name == "builtin" and bench.data.tokenizer == "builtin" and not bench.data.streaming
    assert check_vocab(bench, BUILTIN_VOCAB_SIZE) == 50257
    assert check_and_derive_layout(bench, 1, 1, 1, on_cpu=False).grad_accum_steps == gpu_mfu.ACCUM[name]


@pytest.mark.parametrize("name", gpu_mfu.RECIPES)
def test_benchmark_step_fits_one_80gb_gpu_by_the_formulas(name, capsys):
    """launch/plan.py's memory (what DeepSpeed allocates for the model states, its fp32 gradient
    buffer included, and the activations of one micro-batch) plus what it leaves out: the loss's
    (b, s, V) tensors (bf16 logits, their fp32 copy, softmax, and its gradient)."""
    path = REPO / "recipes" / f"{name}.yaml"
    recipe = load_recipe(path, [])
    b = recipe.train.micro_batch_size
    assert plan.main(["--recipe", str(path), "--gpus", "1", "--global-batch", str(b * gpu_mfu.ACCUM[name]),
                      "--json"]) == 0
    # The JSON is the last line (an in-process DeepSpeed import may log its accelerator first).
    planned = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["memory_per_device_bytes"]
    model_cfg = recipe.model
    logits = b * model_cfg.seq_len * padded_vocab_size(model_cfg.vocab_size, 1, model_cfg.vocab_pad_multiple)
    extra = logits * (2 + 4 + 4 + 4)
    assert planned + extra < 75 * GIB, (name, planned / GIB, extra / GIB)


@pytest.mark.slow  # one training run through launch/train.py
def test_gpu_mfu_tiny_on_cpu_reports_the_built_models_flops(tmp_path):
    """One recipe (at --tiny every recipe is the same toy model; the tests above check each is
    valid), 2 steps, the first left out as warm-up: the reported numbers are the second step's,
    with the FLOPs torch counts in a forward and backward of the toy model on the GPT-2 vocabulary
    (unpadded: the 47 padding rows are no model FLOPs) and the peak given on the command line;
    tokens/s against the tokens the run drew and its train_batch time on the tests' own clock
    (tests/helpers/step_clock.py)."""
    steps, warmup = 2, 1
    peak_tflops = 1e-3  # an explicit peak makes MFU a number on CPU too
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu" / "gpu_mfu.py"), "--tiny", "--recipes", "gpt2-124m",
                           "--steps", str(steps), "--warmup", str(warmup), "--json"], cwd=REPO, capture_output=True,
                          text=True, timeout=900,
                          env=dict(os.environ, GPT3D_PEAK_TFLOPS=str(peak_tflops), **step_clock.env(tmp_path)))
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    lines = proc.stdout.strip().splitlines()
    (r,) = json.loads(lines[-1])["results"]
    assert f"MFU peak: {peak_tflops:g} TFLOP/s from GPT3D_PEAK_TFLOPS" in proc.stdout
    assert "error" not in r, r
    # --tiny: 2 blocks of 64, 32 tokens, micro-batch 2 x 2, the GPT-2 vocabulary.
    l, h, s, V, B = 2, 64, 32, 50257, 4
    assert (r["recipe"], r["n_layer"], r["n_embd"], r["seq_len"], r["vocab_size"], r["global_batch_size"]) \
        == ("gpt2-124m", l, h, s, V, B)
    model = GPT(GPTConfig(n_layer=l, n_head=4, n_embd=h, seq_len=s, vocab_size=V))
    assert r["params"] == sum(p.numel() for p in model.parameters())
    flops = B * counted_flops(model, torch.zeros(1, s, dtype=torch.long))  # per sample, times the batch
    assert len(r["step_times_s"]) == steps
    assert r["step"] == 2 and r["step_time_s"] == r["step_times_s"][1]  # the one step after warm-up
    (clock,) = step_clock.read(tmp_path, 1)
    assert len(clock) == steps and clock[1]["tokens"] == B * s
    assert step_clock.implied_step_time_fits(r["tokens_per_s"], B * s, clock[1]["seconds"]), (r, clock)
    assert r["tflops_per_device"] == pytest.approx(flops / r["step_time_s"] / 1e12, rel=1e-6)
    assert r["mfu"] == pytest.approx(flops / r["step_time_s"] / (peak_tflops * 1e12), rel=1e-6)
    assert math.isfinite(r["loss_last"])
    assert r["loss_first"] == pytest.approx(math.log(V), rel=0.05)  # untrained: near uniform
    # The table row shows the same numbers.
    row = next(line for line in lines if line.startswith(r["recipe"] + " "))
    assert f"{r['tokens_per_s']:,.0f}" in row and f"{r['mfu']:.1%}" in row and f"{r['params'] / 1e6:.1f}M" in row
    assert lines[-2].startswith("total ")
