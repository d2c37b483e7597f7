"""The CUDA-only branches we ship, run on CPU on the meta device: torch's meta kernels
check dtypes, shapes and strides as the CUDA kernels do, and `runs_cuda_kernels`
(model/parallel/weight_grad.py) sends meta tensors down the CUDA branches. Each test runs a branch
forward and backward, in fp32 and bf16, with gradient-accumulation fusion (an fp32 `main_grad`) on
and off, and checks the dtypes and shapes that come out; where a probe picks the branch, every
outcome of the probe is forced in turn.

- the dense fused weight-gradient GEMM (`add_product_into`) through each of `_MIXED_GEMMS`, and the
  probe's choice among them;
- the experts' GEMMs (model/transformer/grouped_gemm.py): one grouped GEMM in bf16, a GEMM per
  expert in fp32 (meta's grouped GEMM takes bf16 only, as CUDA's own kernel; CUDA's fp32 fallback
  copies the offsets to the host), the weight gradient through each of `_GROUPED_MIXED_GEMMS`, and
  ZB-H1's deferred W pass. torch 2.13 refuses a grouped GEMM with fp32 output from bf16 operands
  ("If output dtype provided, it must be torch.bfloat16."), which a fused bf16 MoE backward
  would call;
- the router in fp32 and in the activations' dtype, route and both router losses;
- the chunked vocab-parallel loss (no CUDA-only branch: its dtypes and shapes);
- flex attention with our BlockMask, chosen on meta as on CUDA. flex_attention refuses the meta
  device by name (its `_validate_device`; its higher-order op has meta implementations), so that one
  check is lifted, and it runs eagerly (unfused), not through torch.compile.

Not on meta: MoEMLP as a whole (its one host read of the counts, `.tolist()`, needs values) and
the probes' value checks (`runs_right` takes "it runs" there). A CPU test with real tensors holds
each grouped weight-gradient path to autograd's bf16 expert gradients summed in fp32.
"""
import dataclasses
import functools
import warnings
from typing import List

import pytest
import torch
from torch.nn import functional

from model.config import GPTConfig
from model.parallel import weight_grad
from model.parallel.cross_entropy import vocab_parallel_cross_entropy
from model.parallel.weight_grad import WEIGHT_GRADS, DeferrableLinear, mixed_gemm_path
from model.transformer import documents, grouped_gemm
from model.transformer.attention_inputs import document_inputs
from model.transformer.grouped_gemm import expert_rows, grouped_gemm_path, grouped_mm_fits
from model.transformer.moe import ExpertMLPs, Router, route
from model.transformer.moe_losses import MoEStatistics, router_losses

META = torch.device("meta")
PRECISIONS = [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)]
PRECISION_IDS = ["fp32", "bf16", "bf16-fused"]
CONFIG = GPTConfig(arch="qwen3_moe", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, seq_len=256, vocab_size=64,
                   moe=dict(num_experts=8, experts_per_token=2, expert_ffn_hidden_size=16, z_loss_coef=0.01))


def _meta(*shape, dtype=torch.float32, grad=False):
    return torch.empty(*shape, device=META, dtype=dtype, requires_grad=grad)


def _fuse(param: torch.Tensor) -> None:
    param.main_grad = torch.zeros_like(param, dtype=torch.float32)


def _refused(*args, **kwargs):
    raise RuntimeError("this torch build has no such kernel")  # as torch refuses an overload


def _runs_on_meta(add) -> bool:
    try:
        add(_meta(24, 32), _meta(24, 40, dtype=torch.bfloat16), _meta(40, 32, dtype=torch.bfloat16))
        return True
    except (RuntimeError, TypeError, NotImplementedError):
        return False


@functools.lru_cache(maxsize=None)
def mixed_gemms_here() -> List[str]:
    """The ways this torch's meta kernels run: every one on torch 2.13 and later; on 2.11 and 2.12
    addmm.dtype_out is not decomposed for meta (TypeError), and the probe takes the next way.
    Asked by the tests, not at collection: running a meta decomposition imports torch._dynamo
    (1-2 s), in every worker that collects this module."""
    return [name for name, add in weight_grad._MIXED_GEMMS.items() if _runs_on_meta(add)]


def _runs_here(dense: str) -> None:
    if dense not in mixed_gemms_here():
        pytest.skip(f"{dense} does not run on torch {torch.__version__}'s meta kernels (it does from 2.13)")


def _forced_probe(monkeypatch, module, table: str, chosen: str, outcome: str) -> None:
    """The probe of `module.<table>` runs afresh, and every way before `outcome` is refused ("none": all)."""
    names = list(getattr(module, table))
    first = names.index(outcome) if outcome in names else len(names)
    monkeypatch.setattr(module, table, {n: (_refused if i < first else f)
                                        for i, (n, f) in enumerate(getattr(module, table).items())})
    monkeypatch.setattr(module, chosen, {})


def _check_grads(param, x, dtype, fused):
    if fused:  # added into the fp32 main gradient, no .grad
        assert param.grad is None and param.main_grad.dtype == torch.float32
        assert param.main_grad.shape == param.shape
    else:
        assert param.grad.dtype == dtype and param.grad.shape == param.shape
    assert x.grad.dtype == x.dtype and x.grad.shape == x.shape


# ------------------------------------------------------------------ dense fused weight gradient

@pytest.mark.parametrize("outcome", list(weight_grad._MIXED_GEMMS) + ["none"])
def test_dense_fused_weight_gradient_takes_every_outcome_of_its_probe(monkeypatch, outcome):
    if outcome != "none":
        _runs_here(outcome)
    _forced_probe(monkeypatch, weight_grad, "_MIXED_GEMMS", "_CHOSEN_PATH", outcome)
    if outcome == "none":
        with pytest.raises(RuntimeError, match="grad_accum_fusion: false"):
            mixed_gemm_path(META)
        return
    assert mixed_gemm_path(META) == outcome
    x, weight = _meta(2, 40, 32, dtype=torch.bfloat16, grad=True), _meta(24, 32, dtype=torch.bfloat16, grad=True)
    _fuse(weight)
    DeferrableLinear.apply(x, weight, None).sum().backward()
    _check_grads(weight, x, torch.bfloat16, True)


def test_every_dense_way_passes_meta_and_the_probe_takes_the_first():
    """From torch 2.13 the meta kernels accept each way (addmm.dtype_out into an fp32 `self`
    included), so the probe's first choice is the one GEMM that writes fp32; on an older torch the
    probe takes the first way that runs."""
    for name in mixed_gemms_here():
        main = _meta(24, 32)
        weight_grad._MIXED_GEMMS[name](main, _meta(24, 40, dtype=torch.bfloat16), _meta(40, 32, dtype=torch.bfloat16))
        assert main.dtype == torch.float32 and main.shape == (24, 32), name
    if tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 13):
        assert mixed_gemms_here() == list(weight_grad._MIXED_GEMMS)
    assert mixed_gemm_path(META) == mixed_gemms_here()[0]


@pytest.mark.parametrize("dtype,fused", PRECISIONS, ids=PRECISION_IDS)
def test_deferrable_linear_on_meta(dtype, fused):
    x, weight = _meta(2, 40, 32, dtype=dtype, grad=True), _meta(24, 32, dtype=dtype, grad=True)
    if fused:
        _fuse(weight)
    y = DeferrableLinear.apply(x, weight, None)
    assert y.dtype == dtype and y.shape == (2, 40, 24)
    y.sum().backward()
    _check_grads(weight, x, dtype, fused)


# ------------------------------------------------------------------ the experts' GEMMs

def _experts(dtype, fused):
    experts = ExpertMLPs(CONFIG, 0, None, 0, 8, 1).to(device=META, dtype=dtype)
    if fused:
        for param in experts.parameters():
            _fuse(param)
    return experts


def _run_experts(experts, dtype):
    sizes = [40, 0, 16, 8, 24, 0, 32, 8]  # an expert without rows included
    x = _meta(sum(sizes), 32, dtype=dtype, grad=True)
    y = experts(x, expert_rows(_meta(8, dtype=torch.int64), sizes))
    assert y.dtype == dtype and y.shape == x.shape
    y.sum().backward()
    return x


@pytest.mark.parametrize("dtype,fused", PRECISIONS, ids=PRECISION_IDS)
def test_expert_gemms_on_meta(monkeypatch, dtype, fused):
    """bf16: one grouped GEMM per product (forward, input and weight gradients); fp32: a GEMM per
    expert. Fused: the weight gradient through the probed way (the grouped GEMM's red case)."""
    calls = []
    grouped_mm = functional.grouped_mm
    monkeypatch.setattr(functional, "grouped_mm", lambda *a, **k: calls.append(k) or grouped_mm(*a, **k))
    experts = _experts(dtype, fused)
    assert grouped_mm_fits(_meta(1, 32, dtype=dtype), experts.down_proj) == (dtype == torch.bfloat16)
    x = _run_experts(experts, dtype)
    for param in experts.parameters():
        _check_grads(param, x, dtype, fused)
    assert all(k.get("out_dtype") is None for k in calls)
    assert len(calls) == (0 if dtype == torch.float32 else 4 + (0 if fused else 2))  # fused: a GEMM per expert


@pytest.mark.parametrize("outcome", list(grouped_gemm._GROUPED_MIXED_GEMMS) + ["none"])
def test_grouped_weight_gradient_takes_every_outcome_of_its_probe(monkeypatch, outcome):
    _forced_probe(monkeypatch, grouped_gemm, "_GROUPED_MIXED_GEMMS", "_CHOSEN_GROUPED_PATH", outcome)
    if outcome == "none":
        with pytest.raises(RuntimeError, match="grad_accum_fusion: false"):
            grouped_gemm_path(META)
        return
    assert grouped_gemm_path(META) == outcome
    experts = _experts(torch.bfloat16, True)
    x = _run_experts(experts, torch.bfloat16)
    for param in experts.parameters():
        _check_grads(param, x, torch.bfloat16, True)


@pytest.mark.parametrize("dense", list(weight_grad._MIXED_GEMMS))
def test_a_gemm_per_expert_runs_each_dense_way(monkeypatch, dense):
    _runs_here(dense)
    monkeypatch.setattr(grouped_gemm, "_CHOSEN_GROUPED_PATH", {"meta": "gemm-per-expert"})
    monkeypatch.setattr(weight_grad, "_CHOSEN_PATH", {"meta": dense})
    experts = _experts(torch.bfloat16, True)
    x = _run_experts(experts, torch.bfloat16)
    for param in experts.parameters():
        _check_grads(param, x, torch.bfloat16, True)


def test_the_real_grouped_probe_on_meta_accumulates_per_expert_in_fp32():
    assert grouped_gemm_path(META) == "gemm-per-expert"


def test_deferred_w_pass_on_meta(monkeypatch):
    """ZB-H1: the B pass queues the experts' and a linear's weight gradients, the W pass adds them."""
    monkeypatch.setattr(WEIGHT_GRADS, "enabled", True)
    experts = _experts(torch.bfloat16, True)
    linear_x, weight = _meta(40, 32, dtype=torch.bfloat16, grad=True), _meta(24, 32, dtype=torch.bfloat16, grad=True)
    _fuse(weight)
    with WEIGHT_GRADS.deferring():
        x = _run_experts(experts, torch.bfloat16)
        DeferrableLinear.apply(linear_x, weight, None).sum().backward()
    WEIGHT_GRADS.seal_microbatch()
    assert WEIGHT_GRADS.compute_oldest() == 3 and not WEIGHT_GRADS.pending
    for param in list(experts.parameters()) + [weight]:
        _check_grads(param, x if param is not weight else linear_x, torch.bfloat16, True)


# ------------------------------------------------------------------ router, loss, attention

@pytest.mark.parametrize("router_dtype", ["fp32", "activations"])
@pytest.mark.parametrize("dtype,fused", PRECISIONS, ids=PRECISION_IDS)
def test_router_and_its_losses_on_meta(dtype, fused, router_dtype):
    config = dataclasses.replace(CONFIG, moe=dataclasses.replace(CONFIG.moe, router_dtype=router_dtype))
    router = Router(config, torch.Generator().manual_seed(0)).to(device=META, dtype=dtype)
    if fused:
        _fuse(router.weight)
    x = _meta(2, 8, 32, dtype=dtype, grad=True)
    logits = router(x).reshape(-1, 8)
    assert logits.dtype == (torch.float32 if router_dtype == "fp32" else dtype)
    weights, experts, probs = route(logits, 2, "softmax_topk", True)
    assert weights.dtype == probs.dtype == torch.float32 and experts.shape == (16, 2)
    statistics = MoEStatistics(config)
    losses = router_losses(logits, probs, experts, statistics, 0, None, None)
    assert losses.dtype == torch.float32 and statistics.records.device == META
    (weights.to(dtype).sum() + losses).backward()
    _check_grads(router.weight, x, dtype, fused)


@pytest.mark.parametrize("consume", [False, True], ids=["keep-logits", "consume-logits"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chunked_loss_on_meta(dtype, consume):
    logits = _meta(2, 8, 64, dtype=dtype, grad=True)
    loss = vocab_parallel_cross_entropy(logits * 1, _meta(2, 8, dtype=torch.int64), None, chunk_tokens=5,
                                        consume_logits=consume)
    assert loss.dtype == torch.float32 and loss.shape == (2, 8)
    loss.sum().backward()
    assert logits.grad.dtype == dtype and logits.grad.shape == logits.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_flex_attention_with_our_block_mask_on_meta(monkeypatch, dtype):
    from torch.nn.attention import flex_attention as flex
    assert documents.uses_flex_attention(META, 0.0) and not documents.uses_flex_attention(META, 0.1)
    inputs = document_inputs(CONFIG, _meta(2, 256, dtype=torch.int64), dtype)
    assert isinstance(inputs.mask, flex.BlockMask) and inputs.rope[0].shape == (2, 1, 256, CONFIG.head_dim)
    monkeypatch.setattr(flex, "_validate_device", lambda *tensors: None)
    monkeypatch.setattr(documents, "_compiled_flex_attention", flex.flex_attention)
    q, k, v = _meta(2, 4, 256, 8, dtype=dtype, grad=True), _meta(2, 2, 256, 8, dtype=dtype, grad=True), \
        _meta(2, 2, 256, 8, dtype=dtype, grad=True)
    with warnings.catch_warnings():  # "flex_attention called without torch.compile()"
        warnings.simplefilter("ignore", UserWarning)
        out = documents.document_attention(q, k, v, inputs.mask, 0.0, enable_gqa=True)
    assert out.dtype == dtype and out.shape == q.shape
    out.sum().backward()
    assert all(t.grad.dtype == dtype and t.grad.shape == t.shape for t in (q, k, v))


# ------------------------------------------------------------------ the grouped paths' numbers, on CPU

@pytest.mark.parametrize("path", list(grouped_gemm._GROUPED_MIXED_GEMMS))
def test_each_grouped_path_sums_the_bf16_expert_gradients_in_fp32(path):
    """Real tensors: three micro-batches of bf16 expert products added into an fp32 main gradient by
    `path` equal autograd's bf16 expert gradients summed in fp32, within their bf16 rounding; the
    fp32-accumulating way equals the fp32 sum of the exact products to fp32 rounding."""
    sizes = [24, 0, 16, 8]
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    generator = torch.Generator().manual_seed(0)
    main, summed, exact = torch.zeros(4, 16, 32), torch.zeros(4, 16, 32), torch.zeros(4, 16, 32)
    for _ in range(3):
        x = torch.randn(48, 32, generator=generator).bfloat16()
        grad = torch.randn(48, 16, generator=generator).bfloat16()  # dL/dY of Y = X W^T
        grouped_gemm._GROUPED_MIXED_GEMMS[path](main, grad.t(), x, offsets, sizes)
        weight = torch.zeros(4, 16, 32, dtype=torch.bfloat16, requires_grad=True)
        y = torch.cat([functional.linear(x_g, w_g) for x_g, w_g in zip(x.split(sizes), weight)])
        y.backward(grad)
        summed += weight.grad.float()  # autograd's bf16 gradient of each expert, summed in fp32
        exact += torch.stack([g.float().t() @ x_g.float() for g, x_g in zip(grad.split(sizes), x.split(sizes))])
    assert main[1].abs().max() == 0  # no rows: no gradient
    assert (main - summed).norm() <= 2.0 ** -8 * summed.norm()
    if path == "gemm-per-expert":  # on CPU add_product_into multiplies the exact bf16 values in fp32
        torch.testing.assert_close(main, exact, rtol=1e-6, atol=1e-5)
