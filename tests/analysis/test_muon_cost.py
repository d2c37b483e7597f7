"""Muon in the planner (launch/analysis/muon_cost.py), in process: the logical matrices it
counts are those the optimizer finds in the built model (launch/optim/muon_matrices.py) for GPT-2,
Llama (grouped-query attention) and an MoE recipe, and its Newton-Schulz FLOPs are what torch's
FLOP counter counts in launch/optim/newton_schulz.py."""
from collections import Counter

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from helpers.launcher import LLAMA_TINY, MOE_TINY, TINY
from launch.analysis.muon_cost import FP32, dense_matrices, expert_matrices, muon_stage_cost, newton_schulz_flops
from launch.config.recipe import load_recipe
from launch.optim.muon_matrices import matrix_layout, muon_matrices
from launch.optim.newton_schulz import orthogonalise
from model.gpt.model import GPT


@pytest.mark.parametrize("recipe", [TINY, LLAMA_TINY, MOE_TINY], ids=lambda p: p.stem)
def test_planner_counts_the_matrices_muon_finds(recipe):
    config = load_recipe(recipe, []).gpt_config(vocab_size=256)
    found = Counter()
    for p in muon_matrices(GPT(config)):
        layout = matrix_layout(p, tp_size=1)
        rows_dim = layout.partition_dim  # the parts split this dim; the other is the matrix's other side
        for size in layout.parts:
            shape = list(p.shape)
            shape[rows_dim] = size
            found[tuple(shape[-2:])] += p.shape[0] if layout.experts else 1
    counted = Counter()
    for i in range(config.n_layer):
        for rows, cols, k in dense_matrices(config, i) + expert_matrices(config, i):
            counted[(rows, cols)] += k
    assert found == counted
    elements = sum(r * c * k for (r, c), k in counted.items())
    assert muon_stage_cost(config, range(config.n_layer), tp=1, data_axis=1).momentum_bytes == FP32 * elements
    # tp 2 x data 2 (ep 2: the experts over EP instead of their data group): a quarter of it per rank
    quarter = muon_stage_cost(config, range(config.n_layer), tp=2, data_axis=2, ep=2 if config.moe.enabled else 1)
    assert abs(quarter.momentum_bytes - FP32 * elements / 4) <= FP32 * 2 * config.n_layer


@pytest.mark.parametrize("shape", [(48, 16), (16, 40)])
def test_newton_schulz_flops_are_what_torch_counts(shape):
    with FlopCounterMode(display=False) as counter:
        orthogonalise(torch.randn(*shape))
    assert counter.get_total_flops() == newton_schulz_flops(*shape)
