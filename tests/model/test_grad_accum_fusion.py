"""Gradient-accumulation fusion (`train.grad_accum_fusion`, launch/optim/main_grad.py):
in bf16 the linears' weight-gradient GEMMs add into DeepSpeed's fp32 gradient buffer, so a
micro-batch's backward and the engine's gradient handling after it make no element-wise pass over
those weights. Counted with torch.profiler against the same engine with the fusion switched off
(DeepSpeed's own accumulation), for 1F1B and ZB-H1; the losses and gradient norms of both agree
within bf16 rounding, and an fp32 run is unchanged to the bit. In process, every layer's path
(the padded head, the lookup, sequence parallelism, Llama's fused projections) against autograd's
bf16 gradients summed in fp32."""
from pathlib import Path

import pytest
import torch
from deepspeed.runtime.pipe import schedule

from helpers.distributed import run_distributed, uses_deepspeed
from launch.analysis.zero_bubble_schedule import BackwardInputPass, WeightPass

TINY = Path(__file__).resolve().parents[2] / "recipes" / "tiny.yaml"
# tests/helpers/parity_runs.py's BF16_RTOL: the layouts' bf16 agreement, for the step after the first update
BF16_RTOL = {"loss": 1e-3, "grad_norm": 2e-2}
# The first step's gradients differ only by the bf16 rounding of each micro-batch's weight gradient,
# which the fusion skips: at most bf16's unit roundoff, 2**-9, of each of its terms.
FIRST_NORM_RTOL = 2.0 ** -9
# The kernels that read or write every element of their tensor once: zeroing, casting (to -> copy_),
# adding. GEMMs (mm, addmm) and the embedding's scatter are not among them.
ELEMENTWISE = {"aten::add_", "aten::add", "aten::copy_", "aten::zero_", "aten::fill_", "aten::_foreach_zero_",
               "aten::_foreach_add_", "aten::mul_"}
MICRO_BATCH = 5  # b * T = 160 rows (80 per TP rank under SP): no (rows, h) activation has a weight's shape


def _shapes(shapes):
    """The tensor shapes in a profiler event's `input_shapes` (tensor lists nested)."""
    for shape in shapes:
        if shape and isinstance(shape[0], list):
            yield from _shapes(shape)
        elif shape:
            yield tuple(shape)


def _train(tp: int, pp: int, overrides: list, steps: int):
    """(losses, grad norms, {weight shape: element-wise ops over it per micro-batch}, params) of
    `steps` steps of tiny.yaml on this rank's engine. The counts cover every backward instruction
    (1F1B's backward; ZB-H1's B and W passes), DeepSpeed's gradient handling inside them included,
    over this stage's weight matrices and token embeddings (multiplied or looked up; not the learned
    positions, added), each matched by its shape and by its flattened shape (DeepSpeed's fp32
    views) where no other parameter has it."""
    import torch.distributed as dist

    from launch.config.layout import check_and_derive_layout
    from launch.config.recipe import load_recipe
    from launch.engine.engine import build_engine
    from launch.optim.grad_norm import last_grad_norm
    from model.parallel.state import init_parallel_state

    dp = dist.get_world_size() // (tp * pp)
    recipe = load_recipe(TINY, [f"train.micro_batch_size={MICRO_BATCH}", f"train.global_batch_size={MICRO_BATCH * 2 * dp}"]
                         + overrides)
    layout = check_and_derive_layout(recipe, dist.get_world_size(), tp, pp, True)
    config = recipe.gpt_config(4096)
    engine, own_norm = build_engine(recipe, layout, init_parallel_state(tp, pp), config)
    params = dict(engine.module.named_parameters())
    multiplied = {name: p for name, p in params.items() if p.dim() == 2 and "wpe" not in name}
    others = {shape for name, p in params.items() if name not in multiplied for shape in (tuple(p.shape), (p.numel(),))}
    counts = {shape: 0 for p in multiplied.values() for shape in (tuple(p.shape), (p.numel(),)) if shape not in others}
    handlers = dict(engine._INSTRUCTION_MAP)
    for kind in (schedule.BackwardPass, BackwardInputPass, WeightPass):
        if kind in handlers:
            handlers[kind] = _profiled(handlers[kind], counts)
    engine._INSTRUCTION_MAP = handlers
    tokens = torch.randint(0, 4096, (steps * layout.grad_accum_steps, MICRO_BATCH, config.seq_len + 1),
                           generator=torch.Generator().manual_seed(dist.get_rank() // tp))
    losses, norms = [], []
    for step in range(steps):
        chunk = tokens[step * layout.grad_accum_steps:(step + 1) * layout.grad_accum_steps]
        losses.append(engine.train_batch(iter([(t[:, :-1], t[:, 1:]) for t in chunk])).item())
        norms.append(last_grad_norm(engine, own_norm))  # ZeRO-0 at dp 1: ours
    micro_batches = steps * layout.grad_accum_steps
    return losses, norms, {shape: n / micro_batches for shape, n in counts.items()}, params


def _profiled(handler, counts):
    """`handler` (an instruction's), adding to `counts` the element-wise ops it runs over each shape."""
    def run(engine, **kwargs):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            handler(engine, **kwargs)
        for event in prof.events():
            if event.name in ELEMENTWISE:
                for shape in set(_shapes(event.input_shapes)) & counts.keys():
                    counts[shape] += 1
    return run


def _close(fused: float, unfused: float, rtol: float) -> bool:
    return abs(fused - unfused) <= rtol * abs(unfused)


@uses_deepspeed
def _fusion_makes_no_pass_and_trains_the_same(tp: int, pp: int, overrides: list, schedules: list):
    for name in schedules:
        run = [f"train.schedule={name}", "train.precision=bf16"] + overrides
        losses, norms, passes, _ = _train(tp, pp, run + ["train.grad_accum_fusion=false"], 2)
        fused_losses, fused_norms, fused_passes, params = _train(tp, pp, run, 2)
        assert all(p.main_grad.dtype == torch.float32 for p in params.values())
        # DeepSpeed's accumulation passes over every weight each micro-batch; the fused GEMMs over none.
        assert passes and all(n > 0 for n in passes.values()), (name, passes)
        assert not any(fused_passes.values()), (name, fused_passes)
        # The same weights and batch: the same forward, to the bit; the gradients within their rounding.
        assert fused_losses[0] == losses[0] and _close(fused_norms[0], norms[0], FIRST_NORM_RTOL), \
            (name, fused_losses, losses, fused_norms, norms)
        assert _close(fused_losses[1], losses[1], BF16_RTOL["loss"]) \
            and _close(fused_norms[1], norms[1], BF16_RTOL["grad_norm"]), (name, fused_losses, losses, fused_norms, norms)


@uses_deepspeed
def _fp32_is_unchanged():
    """fp32 keeps each gradient in `.grad` (no separate buffer): nothing to fuse, the same run to the bit."""
    (losses, norms, _, _), (on_losses, on_norms, _, params) = [
        _train(1, 1, ["train.precision=fp32", f"train.grad_accum_fusion={on}"], 2) for on in ("false", "true")]
    assert on_losses == losses and on_norms == norms and not any(hasattr(p, "main_grad") for p in params.values())


def test_fp32_runs_are_unchanged():
    run_distributed(_fp32_is_unchanged, 1)


@pytest.mark.parametrize("tp,pp,overrides,schedules", [
    (1, 1, [], ["1f1b"]),
    (1, 2, [], ["1f1b", "zb-h1"]),
    # ZB-H1 only (1F1B's backward is the 1-2-1 case's): its deferred weight passes under SP's
    # gathers and full recompute, the least travelled path; both schedules took 48 s of the suite.
    pytest.param(2, 2, ["model.sequence_parallel=true", "train.recompute=full"], ["zb-h1"], marks=pytest.mark.slow),
], ids=["1-1-1", "1-2-1", "2-2-2-sp-full-recompute"])
def test_fused_accumulation_makes_no_pass_over_the_weights_and_trains_the_same(tp, pp, overrides, schedules):
    world = tp * pp * (2 if tp > 1 else 1)
    run_distributed(_fusion_makes_no_pass_and_trains_the_same, world, tp, pp, overrides, schedules)


def _every_path_adds_into_main_grad(arch: str, tp_group=None, sequence_parallel: bool = False, n_kv_head: int = 2):
    """Two micro-batches through the bf16 model with a main gradient on every parameter, against
    the same model through autograd (each micro-batch's bf16 `.grad` summed in fp32, what DeepSpeed
    does). Each weight matrix and token embedding gets its gradient only in `main_grad` (no `.grad`),
    within the bf16 rounding of each micro-batch's gradient; the padded vocabulary rows stay zero.
    Key/value weights gathered from other TP ranks (tp > n_kv_head) are the exception: their
    gradient flows back through the gather into `.grad`, and their `main_grad` stays zero."""
    from model.config import GPTConfig
    from model.gpt.model import GPT
    from model.parallel.cross_entropy import vocab_parallel_cross_entropy

    config = GPTConfig(n_layer=2, n_head=4, n_embd=32, seq_len=16, vocab_size=101, vocab_pad_multiple=4, seed=3,
                       arch=arch, sequence_parallel=sequence_parallel, **({"n_kv_head": n_kv_head} if arch == "llama" else {}))
    plain, fused = GPT(config, tp_group).bfloat16(), GPT(config, tp_group).bfloat16()  # the same seeded weights
    for param in fused.parameters():
        param.main_grad = torch.zeros(param.shape, dtype=torch.float32)
    summed = {name: torch.zeros(p.shape) for name, p in plain.named_parameters()}
    bound = {name: torch.zeros(p.shape) for name, p in plain.named_parameters()}  # sum of |each micro-batch's|
    for ids in torch.randint(0, config.vocab_size, (2, 3, config.seq_len + 1), generator=torch.Generator().manual_seed(0)):
        for model in (plain, fused):
            vocab_parallel_cross_entropy(model(ids[:, :-1]), ids[:, 1:], tp_group).mean().backward()
        for name, param in plain.named_parameters():
            summed[name] += param.grad.float()
            bound[name] += param.grad.float().abs()
            param.grad = None
    fused_params = dict(fused.named_parameters())
    matrices = [name for name, p in fused_params.items() if p.dim() == 2 and "wpe" not in name]
    through_grad = [name for name in matrices if fused_params[name].grad is not None]
    tp = 1 if tp_group is None else torch.distributed.get_world_size(tp_group)
    assert matrices and (through_grad == [] if arch == "gpt2" or tp <= n_kv_head else
                         0 < len(through_grad) <= 2 * config.n_layer), through_grad  # the gathered k, v
    for name in matrices:
        param = fused_params[name]
        assert name not in through_grad or not param.main_grad.any(), name
        got = param.main_grad if param.grad is None else param.grad.float()
        error = (got - summed[name]).norm()
        assert error <= 2.0 ** -8 * bound[name].norm() + 1e-6, (name, error.item(), summed[name].norm().item())
    padded = fused.embed.wte
    real = max(0, min(padded.vocab_size - padded.vocab_start, padded.rows_per_partition))
    assert not padded.weight.main_grad[real:].any()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_every_layer_adds_its_weight_gradient_into_main_grad(arch):
    _every_path_adds_into_main_grad(arch)


def _every_path_at_tp2():
    from model.parallel.state import init_parallel_state
    group = init_parallel_state(2, 1).tp_group
    for arch, n_kv_head in (("gpt2", 2), ("llama", 2), ("llama", 1)):
        for sequence_parallel in (False, True):
            _every_path_adds_into_main_grad(arch, group, sequence_parallel, n_kv_head)


def test_every_layer_adds_its_weight_gradient_into_main_grad_at_tp2():
    """The same per TP rank, with and without sequence parallelism (the gathered linears), and with
    one key/value head shared by both ranks."""
    run_distributed(_every_path_at_tp2, 2)


def test_mixed_gemm_falls_back_to_what_this_torch_can_run():
    """On a GPU the fused GEMM needs aten::addmm.dtype_out with an fp32 `self`, which not every
    torch build accepts: the probe takes the first way that runs and gives the right sum. On CPU
    neither dtype overload exists (CUDA only), so the probe must fall through to the last way, and
    that way must add the product exactly as an fp32 GEMM of the same bf16 operands does."""
    from model.parallel.weight_grad import _MIXED_GEMMS, mixed_gemm_path
    path = mixed_gemm_path(torch.device("cpu"))
    assert path == list(_MIXED_GEMMS)[-1]
    a = torch.randn(8, 16).bfloat16()
    b = torch.randn(16, 4).bfloat16()
    main = torch.randn(8, 4)
    want = main + a.float() @ b.float()
    _MIXED_GEMMS[path](main, a, b)
    torch.testing.assert_close(main, want, rtol=2 ** -7, atol=2 ** -7 * want.abs().max().item())
