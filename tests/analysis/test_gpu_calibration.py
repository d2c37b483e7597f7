"""The calibration's GPU path, run on CPU through the same code (launch/autotune/calibrate.py): no
GPU is needed for what is checked here, only the properties a GPU's numbers depend on.

- GEMMs are timed back to back: one synchronize per batch of calls, not one per call (a sync per
  call adds a kernel launch's latency to each, so small expert GEMMs looked slow).
- An expert GEMM is timed as all of a rank's local experts in one call through the model's own
  grouped GEMM: the call computes every expert's product, and its FLOPs are E times one expert's.
- The device's fixed memory has one home (memory_formulas.process_fixed_bytes): the planner's
  usable memory is the total less 5% and that figure.
- MFU's peak comes from the planner's datasheet table, names matched whole.
"""
import pytest
import torch

from launch.analysis import memory_formulas, plan_setup
from launch.analysis.plan_setup import GIB
from launch.autotune import calibrate
from launch.autotune.calibrate_timing import back_to_back_rate
from launch.config.recipe import load_recipe
from launch.errors import REPO_ROOT
from launch.instruments import metrics


def test_gemm_timer_synchronizes_once_per_batch_of_calls():
    """A fake device: each call takes 1 ms of a fake clock; synchronize is counted. The rate is the
    work over the time of the batch that lasted MIN_SECONDS, and the syncs are one per batch (a
    handful), where a sync per call would be as many as the calls."""
    state = {"now": 0.0, "calls": 0, "syncs": 0}

    def call():
        state["calls"] += 1
        state["now"] += 1e-3

    def synchronize():
        state["syncs"] += 1
    rate = back_to_back_rate(call, 2.0, synchronize, min_seconds=0.05, clock=lambda: state["now"])
    assert rate == pytest.approx(2.0 / 1e-3)
    assert state["calls"] >= 50  # the last batch alone lasted 50 ms
    assert state["syncs"] <= 6 and state["syncs"] * 10 < state["calls"], state


def test_the_expert_gemm_computes_every_local_expert_in_one_call():
    """4 experts of 24 rows, 16 in, 32 out (fp32, CPU): the timed call's output holds each expert's
    rows through its own weight (against torch.mm per expert), and its FLOPs are 4 x one expert's."""
    experts, (m, k, n) = 4, (24, 16, 32)
    call, flops, x, weight = calibrate.expert_gemm((m, k, n), experts, "fp32")
    out = call()
    reference = torch.cat([x[e * m:(e + 1) * m] @ weight[e].t() for e in range(experts)])
    assert out.shape == (experts * m, n)
    torch.testing.assert_close(out, reference)
    assert flops == experts * 2 * m * k * n == experts * calibrate.gemm_call((m, k, n), "fp32")[1]


def test_each_expert_shape_is_timed_at_the_experts_a_rank_holds():
    """moe-tiny's cases at ep 1 and 2: the planner's expert shape of each (planner.gemm_shapes) with
    E / ep experts; a shape two cases share takes the fewer (the slower, on a GPU)."""
    from launch.analysis.planner import gemm_shapes
    model = load_recipe(REPO_ROOT / "recipes" / "moe-tiny.yaml", []).model
    experts = model.resolved().moe.num_experts
    shape = lambda ep, b: tuple(gemm_shapes(model, plan_setup.Setup(  # noqa: E731
        gpus=ep, tp=1, pp=1, micro_batch=b, global_batch=b, ep=ep))["expert"])
    counts = calibrate.expert_counts(model, [(1, 1, 2, model.seq_len), (1, 2, 2, model.seq_len)])
    assert counts == {shape(1, 2): experts, shape(2, 2): experts // 2}
    # ep 2 at micro-batch 1 routes the rows per expert of ep 1 at micro-batch 2: the fewer experts
    counts = calibrate.expert_counts(model, [(1, 1, 2, model.seq_len), (1, 2, 1, model.seq_len)])
    assert shape(1, 2) == shape(2, 1) and counts == {shape(1, 2): experts // 2}


def test_usable_memory_is_the_total_less_the_one_fixed_figure():
    """plan_setup's headroom is memory_formulas.process_fixed_bytes (CUDA context, cuBLAS
    workspaces, NCCL buffers of the rank's communicators) and 5% for fragmentation, nowhere else."""
    fixed = memory_formulas.process_fixed_bytes(plan_setup.RANK_COMMUNICATORS)
    total = 81004 * 2 ** 20  # an H100 SXM's total_memory
    assert plan_setup.usable_memory_bytes(total) == total * (1 - plan_setup.HEADROOM_FRACTION) - fixed
    hardware, _ = plan_setup.device_hardware("NVIDIA H100 80GB HBM3", total, None, 8)
    assert hardware.memory_bytes == total * 0.95 - fixed
    assert round(hardware.memory_bytes / GIB, 1) == 73.1


@pytest.mark.parametrize("name,label,tflops", [("NVIDIA H100 80GB HBM3", "H100", 989),
                                               ("NVIDIA H100 PCIe", "H100-PCIe", 756),
                                               ("NVIDIA GH200 480GB", None, None)])
def test_mfu_peak_is_the_planners_datasheet_matched_whole(name, label, tflops):
    """The H100 datasheet's dense bf16 (SXM 989, PCIe 756 TFLOP/s); a GH200 is no H200: no peak."""
    peak, source = metrics.peak_flops(name, None)
    assert peak == (tflops * 1e12 if tflops else None)
    assert (label in source) if label else "unknown device" in source
    if label:
        assert peak == plan_setup.GPUS[label].peak_flops
