"""What a GPU run holds beyond the model states and the blocks' activations, and where expert
imbalance costs time, each term against an independent reference:

- torch's own allocations, read from torch.profiler's memory events (profile_memory=True records
  every CPU allocation and free of torch's allocator with its size: the peak of their running
  sum is the peak a step's code adds, what torch.cuda.max_memory_allocated would say on a GPU),
  for the loss's logits and fp32 chunk (model/parallel/cross_entropy.py, the run's call) and for
  AdamW's foreach step (torch's _multi_tensor_adam, forced with foreach=True: CPU defaults to
  the single-tensor path);
- for --expert-load, a hand computation from its definition (the busiest expert-parallel rank's
  tokens over the mean rank's) on the planner's own GEMM rate and link bandwidth.
Each test fails when its term is taken out of the planner."""
import dataclasses
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from launch.analysis import engine_memory, experts, memory_formulas
from launch.analysis.plan_setup import Hardware, Setup
from launch.analysis.planner import estimate_plan
from launch.config.recipe import load_recipe
from model.config import GPTConfig
from model.parallel import cross_entropy
from model.parallel.cross_entropy import vocab_parallel_cross_entropy

H100 = Hardware(989e12, 450e9, 50e9)
RECIPES = Path(__file__).resolve().parents[2] / "recipes"
STATES = ("weights", "gradients", "optimizer", "buffers")


def peak_bytes(fn) -> int:
    """The peak of the bytes torch's allocator handed out while `fn` ran, over what was live before."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("chunk_bytes", [cross_entropy.CHUNK_BYTES, 2 ** 20])
def test_logits_and_the_losss_chunk_are_what_the_loss_allocates(monkeypatch, chunk_bytes):
    """The head's (b, s, V_pad) bf16 output and the loss's forward and backward (consume_logits, as
    model/gpt/pipe.py calls it): the peak is the logits plus one fp32 chunk and the per-token
    vectors, at the default chunk (all 1,024 tokens in one) and at 1 MiB (64 tokens a chunk)."""
    monkeypatch.setattr(cross_entropy, "CHUNK_BYTES", chunk_bytes)
    config = GPTConfig(vocab_size=4000, n_embd=64, n_head=2, n_layer=1, seq_len=512, vocab_pad_multiple=128)
    b, s, vocab = 2, config.seq_len, 4096  # 4000 padded to a multiple of 128
    torch.manual_seed(0)
    head_output = torch.randn(b, s, vocab, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, config.vocab_size, (b, s))

    def step():
        logits = head_output.clone()  # a new (b, s, V) bf16 tensor, as the head's matmul makes one
        loss = vocab_parallel_cross_entropy(logits, target, None, consume_logits=True)
        logits.data = logits.new_empty(0)  # model/gpt/pipe.py: TokenMeanLoss
        loss.sum().backward()
    measured = peak_bytes(step)
    planned = memory_formulas.logits_bytes(config, s, b, 1, 2) + memory_formulas.loss_temporary_bytes(config, s, b, 1)
    assert memory_formulas.logits_bytes(config, s, b, 1, 2) == 2 * b * s * vocab
    # The rest: the loss's scalar, its gradient's (n,) copies (a few bytes a token).
    assert planned <= measured <= 1.03 * planned, (measured, planned)


@pytest.mark.parametrize("zero,dp", [(0, 1), (1, 4)])
def test_adamw_foreach_step_holds_4_bytes_per_element_of_its_largest_group(zero, dp):
    """torch's AdamW(foreach=True) over two groups, as DeepSpeed's torch_adam steps them: at ZeRO-0
    the parameters, at ZeRO-1 each group's flat fp32 partition (padded to 2d, split over d). After
    a first step (the moments exist), a second step's peak is one fp32 tensor per element of the
    largest group, the square roots of its second moments."""
    sizes = [(30_011, dp), (5_003, dp)]
    stepped = [engine_memory.padded_group(n, d) // d if zero else n for n, d in sizes]
    params = [torch.nn.Parameter(torch.randn(n)) for n in stepped]
    optimizer = torch.optim.AdamW([{"params": [p]} for p in params], lr=1e-3, foreach=True)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    measured = peak_bytes(optimizer.step)
    planned = engine_memory.adamw_step_temporary_bytes(zero, sizes)
    assert planned == 4 * max(stepped)
    assert planned <= measured <= planned + 64, (measured, planned)  # + AdamW's 0-d step increment


def _stage(plan, stage=-1):
    memory = plan["memory_per_stage_bytes"][stage]
    return memory, sum(memory[k] for k in STATES)


def test_the_plans_total_holds_the_logits_the_losss_chunk_and_the_optimizer_step():
    """llama3.2-1b at micro-batch 8 on one GPU: the last stage's total is the states plus the larger
    of the forward's peak (activations, the (8, 2048, 128,256) bf16 logits: 3.9 GiB, the fp32 chunk)
    and the step's (AdamW's 4 bytes per element of the largest group); at micro-batch 1 with full
    recompute the step's temporaries are the larger."""
    model = load_recipe(RECIPES / "llama3.2-1b.yaml", []).model
    setup = Setup(gpus=1, tp=1, pp=1, micro_batch=8, global_batch=8)
    memory, states = _stage(estimate_plan(model, setup, H100))
    padded = engine_memory.padded_group(memory["weights"] // 2, 1)
    assert memory["logits"] == 2 * 8 * model.seq_len * 128_256 and memory["logits"] / 2 ** 30 == pytest.approx(3.91, abs=0.01)
    assert memory["loss_temporaries"] > 0
    assert memory["total"] == states + memory["activations"] + memory["logits"] + memory["loss_temporaries"]
    small = dataclasses.replace(setup, micro_batch=1, recompute="full")
    memory, states = _stage(estimate_plan(model, small, H100))
    assert 0.9 * 4 * padded < memory["optimizer_step_temporaries"] <= 4 * padded  # the matrices' group
    assert memory["optimizer_step_temporaries"] > memory["activations"] + memory["logits"] + memory["loss_temporaries"]
    assert memory["total"] == states + memory["optimizer_step_temporaries"]


def test_only_the_last_stage_holds_the_logits():
    model = load_recipe(RECIPES / "llama3.2-1b.yaml", []).model
    plan = estimate_plan(model, Setup(gpus=2, tp=1, pp=2, micro_batch=2, global_batch=8), H100)
    first, last = plan["memory_per_stage_bytes"]
    assert first["logits"] == first["loss_temporaries"] == 0 and last["logits"] > 0


def test_process_fixed_bytes_are_the_documented_defaults():
    """The CUDA context, cuBLAS's two 32 MiB Hopper workspaces, and per communicator NCCL's send and
    receive buffers of NCCL_BUFFSIZE (4 MiB) per channel: stated, for the device's usable memory."""
    assert memory_formulas.process_fixed_bytes(0) == (512 + 64) * 2 ** 20
    assert memory_formulas.process_fixed_bytes(4) - memory_formulas.process_fixed_bytes(3) == 2 * 4 * 2 ** 20 * 32


QWEN = load_recipe(RECIPES / "qwen3-30b-a3b.yaml", []).model


def _moe_plan(ep: int, load: float):
    setup = Setup(gpus=32, tp=1, pp=1, micro_batch=1, global_batch=32, ep=ep, expert_load=load)
    return estimate_plan(QWEN, setup, H100)


def test_expert_load_costs_nothing_at_ep_1():
    """A rank holding every expert computes and receives all its routed rows whatever the routing."""
    assert _moe_plan(1, 2.0)["step_time_parts_s"] == _moe_plan(1, 1.0)["step_time_parts_s"]


@pytest.mark.parametrize("ep", [8, 32])
def test_expert_load_scales_the_busiest_ranks_gemms_and_all_to_alls(ep):
    """At ep > 1 the busiest rank receives load x the mean rank's rows: its experts' GEMMs and the
    four row all-to-alls grow by (load - 1) x their balanced time, by hand from the definition:
    per MoE block per micro-batch 3 x 2 b s k (3 h f_e) FLOPs at the expert GEMM's rate, and
    4 b s k h bf16 elements, (ep - 1)/ep of them off the rank, at the EP link."""
    load = 2.0
    balanced, skewed = _moe_plan(ep, 1.0), _moe_plan(ep, load)
    arch = QWEN.resolved()
    m, moe_blocks = balanced["microbatches_per_pipeline"], balanced["moe_blocks_per_stage"][0]
    assert not balanced["memory_bound_stages"]
    b, s, k, h, f = 1, QWEN.seq_len, arch.moe.experts_per_token, arch.n_embd, arch.expert_ffn_hidden_size
    rate = H100.device_profile().gemm_rate(*balanced["gemm_shapes"]["expert"])
    gemm = m * moe_blocks * 3 * 2 * b * s * k * 3 * h * f / rate
    assert skewed["step_time_parts_s"]["compute"] - balanced["step_time_parts_s"]["compute"] \
        == pytest.approx((load - 1) * gemm, rel=1e-9)
    bandwidth = H100.intra_node_bw if ep <= 8 else H100.inter_node_bw
    rows = m * moe_blocks * 4 * b * s * k * h * 2 * (ep - 1) / ep / bandwidth
    assert skewed["step_time_parts_s"]["ep"] - balanced["step_time_parts_s"]["ep"] == pytest.approx((load - 1) * rows, rel=1e-9)
    assert experts.busiest_rank_load(load, ep) == load and experts.busiest_rank_load(load, 1) == 1.0
