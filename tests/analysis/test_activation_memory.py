"""The activations a block saves for backward, measured by bench/memory/activation_memory.py (every
tensor autograd saves, distinct storages, parameters excluded), equal Korthikanti et al. 2022's
tensor-by-tensor count (launch/analysis/memory_formulas.py) with fp32 elements, fp32 CPU dropout masks and the
LayerNorm statistics, to the byte: at tp=1 and tp=2, with and without sequence parallelism,
with no, selective and full recompute, with dropout (SDPA's math path, the s x s scores) and
without (its fused kernel, a logsumexp per row and head)."""
import pytest
import torch.distributed as dist

from bench.memory.activation_memory import MODES, block_saved_bytes
from helpers.distributed import run_distributed, uses_deepspeed
from launch.analysis.memory_formulas import activation_bytes_per_layer
from model.parallel.state import init_parallel_state

S, B, H, A = 16, 2, 32, 4
FP32 = dict(element_bytes=4, mask_bytes=4, layernorm_stat_bytes=4)


@uses_deepspeed
def _measure_all():
    """Dropout 0.1: SDPA's math path, which stores the scores (K22); dropout 0: its fused kernel,
    which stores a logsumexp instead and keeps no dropout masks (`fused_attention`)."""
    tp = dist.get_world_size()
    state = init_parallel_state(tp, 1)
    for dropout in (0.1, 0.0):
        for sp in (False, True):
            for mode in MODES:
                measured = block_saved_bytes(S, B, H, A, dropout, sp, mode, state)
                formula = activation_bytes_per_layer(S, B, H, A, tp, recompute=mode == "full", sequence_parallel=sp,
                                                     selective=mode == "selective", fused_attention=dropout == 0,
                                                     **dict(FP32, mask_bytes=4 if dropout else 0))
                assert measured == formula, (tp, dropout, sp, mode, measured, formula)


@pytest.mark.parametrize("tp", [1, 2])
def test_measured_activation_bytes_equal_the_formula(tp):
    run_distributed(_measure_all, tp)
