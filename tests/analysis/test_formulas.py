"""launch/analysis/formulas.py against published numbers (GPT-2, Narayanan 2021 table 1, the ZeRO paper,
NVIDIA's datasheets) and against the built model (torch's parameter count and FLOP counter)."""
import pytest
import torch

from helpers.flop_count import counted_flops
from launch.analysis import formulas, memory_formulas, partition
from model.config import GPTConfig
from model.config import ModelConfig
from model.gpt.model import GPT
from model.transformer.block import Block

# Narayanan et al. 2021, table 1: (published billions, layers, hidden, heads); V=51200, s=2048.
NARAYANAN_TABLE_1 = [(1.7, 24, 2304, 24), (3.6, 30, 3072, 32), (7.5, 36, 4096, 32), (18.4, 40, 6144, 48),
                     (39.1, 48, 8192, 64), (76.1, 60, 10240, 80), (145.6, 80, 12288, 96),
                     (310.1, 96, 16384, 128), (529.6, 105, 20480, 128), (1008.0, 128, 25600, 160)]


def test_gpt2_small_parameters():
    assert round(formulas.params_formula(12, 768, 50257, 1024) / 1e6, 1) == 124.4
    assert formulas.params_exact(12, 768, 50257, 1024) == 124_439_808
    # The formula is the exact count without the final LayerNorm.
    assert formulas.params_formula(12, 768, 50257, 1024) == pytest.approx(124_439_808 - 2 * 768, abs=1e-3)


@pytest.mark.parametrize("published,layers,hidden,heads", NARAYANAN_TABLE_1)
def test_narayanan_table_1_parameter_counts(published, layers, hidden, heads):
    count = formulas.params_formula(layers, hidden, 51200, 2048)
    # The table rounds to 0.1B; at 1.7B and 3.6B that rounding is itself more than 1%.
    assert round(count / 1e9, 1) == published
    assert count == pytest.approx(published * 1e9, rel=0.03)


@pytest.mark.parametrize("stage,published_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_7_5b_on_64_gpus(stage, published_gb):
    states = memory_formulas.model_state_bytes(7.5e9, dp=64, zero_stage=stage)
    assert round(sum(states.values()) / 1e9, 1) == published_gb


def test_zero_1_is_4_plus_12_over_d_bytes_per_param():
    states = memory_formulas.model_state_bytes(1.0, dp=8, zero_stage=1)
    assert states == {"weights": 2.0, "gradients": 2.0, "optimizer": 12 / 8}
    assert sum(memory_formulas.model_state_bytes(1.0, dp=8, zero_stage=0).values()) == 16


def test_128_gpu_example():
    """72 layers, hidden 10240, tp=4, pp=4, micro 8, global 256 on 128 GPUs: dp = 8 and
    m = 4 micro-batches per pipeline (the planner derives them: tests/analysis/test_plan.py, 128_gpu_example)."""
    pp, m = 4, 4
    gpt2 = ModelConfig(n_layer=72).resolved()
    assert partition.blocks_per_stage(gpt2, partition.stage_partition(gpt2, pp, "blocks")) == [18, 18, 18, 18]
    assert formulas.bubble_fraction(pp, m) == pytest.approx(3 / 7)
    assert memory_formulas.inflight_microbatches(pp, m) == 4


def test_partition_follows_deepspeed_type_block():
    """Embeddings stay on the first stage, ln_f and the head on the last; extra blocks go first."""
    five, four = ModelConfig(n_layer=5).resolved(), ModelConfig(n_layer=4).resolved()
    assert partition.stage_partition(five, 2, "blocks") == [0, 5, 9]  # [embed, wpe, b0, b1, b2] [b3, b4, ln_f, head]
    assert partition.blocks_per_stage(five, partition.stage_partition(five, 3, "blocks")) == [2, 2, 1]
    assert partition.blocks_per_stage(four, partition.stage_partition(four, 3, "blocks")) == [2, 1, 1]


@pytest.mark.parametrize("pad_multiple", [1, 4])
def test_parameter_counts_are_the_built_models(pad_multiple):
    """torch counts the parameters of model/gpt/model.py's GPT: params_exact is it (unpadded vocabulary);
    the one-stage, one-rank count of the planner includes the padded rows (101 -> 104)."""
    config = GPTConfig(n_layer=3, n_head=4, n_embd=32, seq_len=16, vocab_size=101, vocab_pad_multiple=pad_multiple)
    built = sum(p.numel() for p in GPT(config).parameters())
    l, h, V, s = config.n_layer, config.n_embd, config.vocab_size, config.seq_len
    padding = (config.padded_vocab_size(1) - V) * h
    assert formulas.params_exact(l, h, V, s) == built - padding
    assert formulas.stage_params_per_rank(l, h, V, s, tp=1, pp=1, stage=0, pad_multiple=pad_multiple,
                                           parts=partition.stage_partition(config, 1, "blocks")) == built


def test_flops_are_what_torch_counts_in_the_built_model():
    """[N21]'s 72Bslh^2(1 + s/6h + V/12lh) against torch's FLOP counter over a forward and backward
    of our GPT: every matmul, attention's included (the formula counts the full s x s scores; the
    math kernel computes them). Per block: 72bsh^2 + 12bs^2h, 4/3 of it with recompute."""
    b, s, l, h, V = 3, 32, 2, 64, 101
    config = GPTConfig(n_layer=l, n_head=4, n_embd=h, seq_len=s, vocab_size=V)
    ids = torch.randint(0, V, (b, s), generator=torch.Generator().manual_seed(0))
    model = counted_flops(GPT(config), ids)
    assert model == pytest.approx(formulas.model_flops_per_step(b, s, l, h, V))
    hidden = torch.randn(b, s, h, requires_grad=True)
    block, block_recomputed = (counted_flops(Block(config, 0, None), hidden, recompute) for recompute in (False, True))
    assert block == pytest.approx(formulas.layer_flops_per_microbatch(b, s, h))
    assert block_recomputed == pytest.approx(formulas.layer_flops_per_microbatch(b, s, h, recompute=True))
    assert model - l * block == pytest.approx(formulas.logits_flops_per_microbatch(b, s, h, V))


def test_activation_memory():
    s, b, h, a = 2048, 1, 4096, 32
    assert memory_formulas.activation_bytes_per_layer(s, b, h, a) == pytest.approx(s * b * h * (34 + 5 * a * s / h))
    assert memory_formulas.activation_bytes_per_layer(s, b, h, a, tp=8) == pytest.approx(s * b * h * (10 + 3 + 5 * a * s / (h * 8)))
    assert memory_formulas.activation_bytes_per_layer(s, b, h, a, tp=8, recompute=True) == 2 * s * b * h
    per_stage = memory_formulas.activation_bytes_per_stage(s, b, h, a, 8, layers=4, inflight=3)
    assert per_stage == pytest.approx(12 * memory_formulas.activation_bytes_per_layer(s, b, h, a, 8))
    assert [memory_formulas.inflight_microbatches(4, 8, k) for k in range(4)] == [4, 3, 2, 1]
    assert memory_formulas.inflight_microbatches(4, 2) == 2


def test_activation_memory_sequence_parallel_and_selective():
    """K22 table 2 per layer: TP+SP s*b*h*(34/t + 5as/(ht)); selective recompute drops the
    5as/h terms; at tp=1 SP changes nothing; full recompute with SP keeps a 1/t input chunk."""
    s, b, h, a, t = 2048, 1, 12288, 96, 8  # GPT-3 175B: 5as/h = 80, K22 sec. 5
    sbh = s * b * h
    act = memory_formulas.activation_bytes_per_layer
    assert act(s, b, h, a, t, sequence_parallel=True) == pytest.approx(sbh * (34 / t + 80 / t))
    assert act(s, b, h, a, t, selective=True) == pytest.approx(sbh * (10 + 24 / t))
    assert act(s, b, h, a, t, sequence_parallel=True, selective=True) == pytest.approx(sbh * 34 / t)
    assert act(s, b, h, a, selective=True) == pytest.approx(sbh * 34)
    assert act(s, b, h, a, 1, sequence_parallel=True) == act(s, b, h, a)
    assert act(s, b, h, a, t, recompute=True, sequence_parallel=True) == 2 * sbh / t
    # The element and mask sizes scale their terms: fp32 elements and masks double everything.
    assert act(s, b, h, a, t, element_bytes=4, mask_bytes=2) == pytest.approx(2 * act(s, b, h, a, t))


def test_communication_and_mfu():
    """Hand arithmetic; the TP and PP volumes are measured in a real run by tests/runtime/test_comm_volume.py."""
    assert formulas.dp_allreduce_bytes_per_step(1000) == 2000  # bf16 gradients
    assert formulas.ring_allreduce_factor(8) == pytest.approx(1.75)  # 2 * 7/8
    # Half the peak's FLOPs for 10 s on one GPU, or all of them over 2 GPUs for 10 s: 50%.
    assert formulas.mfu(989e12 * 10 * 0.5, 10.0, 989e12, 1) == pytest.approx(0.5)
    assert formulas.mfu(989e12 * 10, 10.0, 989e12, 2) == pytest.approx(0.5)


def test_peak_flops_are_the_datasheets_dense_numbers():
    """NVIDIA's datasheets give bf16 tensor-core TFLOP/s with 2:4 sparsity, twice the dense rate MFU
    divides by: H100 SXM and H200 1,979, A100 624. The A100 whitepaper's arithmetic gives the same
    dense rate: 108 SMs x 1,024 dense FP16/BF16 FMAs per clock x 2 FLOPs x 1,410 MHz boost."""
    sparse_datasheet = {"H100": 1979e12, "H200": 1979e12, "A100": 624e12}
    assert formulas.PEAK_FLOPS_BF16.keys() == sparse_datasheet.keys()
    for gpu, sparse in sparse_datasheet.items():
        assert formulas.PEAK_FLOPS_BF16[gpu] == pytest.approx(sparse / 2, rel=1e-3), gpu
    assert formulas.PEAK_FLOPS_BF16["A100"] == pytest.approx(108 * 1024 * 2 * 1410e6, rel=1e-3)
