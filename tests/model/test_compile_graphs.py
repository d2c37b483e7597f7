"""A compiled block with gradient-accumulation fusion (`main_grad`, model/parallel/weight_grad.py) is
one graph: dynamo traces the linears' autograd Functions, whose backward adds X^T G into the fp32 main
gradient through one opaque op (`gpt3d::add_product_into`) instead of a `torch.compiler.disable`d
call, which broke the graph at every linear. Counted with `torch._dynamo.explain` (dynamo only, no
inductor: cheap on CPU), and the compiled block's main gradients checked against eager autograd's
through AOT autograd (the mutation in the backward graph), to the bit."""
import pytest
import torch

from model.config import GPTConfig
from model.parallel import weight_grad
from model.parallel.weight_grad import WEIGHT_GRADS
from model.transformer.block import Block

DTYPES = [torch.float32, torch.bfloat16]


def _fused_block(arch: str, dtype: torch.dtype) -> Block:
    """Block 0 of a small dense model, every parameter with an fp32 main gradient that is a view of
    one flat buffer (as launch/optim/main_grad.py attaches DeepSpeed's)."""
    config = GPTConfig(n_layer=2, n_head=4, n_embd=32, seq_len=16, vocab_size=101, seed=3, arch=arch,
                       **({"n_kv_head": 2} if arch == "llama" else {}))
    block = Block(config, 0, None).to(dtype)
    flat = torch.zeros(sum(p.numel() for p in block.parameters()))
    offset = 0
    for param in block.parameters():
        param.main_grad = flat[offset:offset + param.numel()].view(param.shape)
        offset += param.numel()
    return block


def _input(dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(seed)).to(dtype).requires_grad_()


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_fused_dense_block_is_one_graph(arch, dtype):
    explained = torch._dynamo.explain(_fused_block(arch, dtype))(_input(dtype, 0))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), \
        [str(b.reason).splitlines()[0] for b in explained.break_reasons]


def test_the_gpu_branch_with_its_probe_stays_out_of_the_graph(monkeypatch):
    """On a GPU the add first probes which mixed-dtype GEMM this torch runs (try/except, torch.equal):
    untraceable, so it runs inside the op, at run time. Here the CPU takes the CUDA branch, probe
    not yet run."""
    monkeypatch.setattr(weight_grad, "runs_cuda_kernels", lambda tensor: True)
    monkeypatch.setattr(weight_grad, "_CHOSEN_PATH", {})
    explained = torch._dynamo.explain(_fused_block("llama", torch.bfloat16))(_input(torch.bfloat16, 0))
    assert explained.graph_count == 1, [str(b.reason).splitlines()[0] for b in explained.break_reasons]


@pytest.mark.slow  # 8 s: the deferred W pass traced apart
def test_zero_bubble_deferral_keeps_its_break(monkeypatch):
    """ZB-H1 (a run that defers) reads the B pass's flag when the backward runs, outside the graph:
    the linears break it, as docs/configuration.md says."""
    monkeypatch.setattr(WEIGHT_GRADS, "enabled", True)
    graphs = []  # through Block.compile, the product's one way in: it makes the deferral opaque first
    block = _fused_block("llama", torch.bfloat16)
    block.compile(backend=lambda graph, inputs: graphs.append(graph) or graph.forward)
    block(_input(torch.bfloat16, 0))
    assert len(graphs) > 1


@pytest.mark.parametrize("arch", [pytest.param("gpt2", marks=pytest.mark.slow), "llama"])  # each 4-5 s
def test_the_compiled_fused_block_adds_what_eager_adds(arch):
    """Two micro-batches through the compiled block (AOT autograd, which inductor takes) and through
    the eager one: the same main gradients to the bit, and no weight matrix's gradient in `.grad`."""
    eager, compiled = _fused_block(arch, torch.bfloat16), _fused_block(arch, torch.bfloat16)
    compiled.compile(backend="aot_eager")
    for seed in range(2):
        for block in (eager, compiled):
            block(_input(torch.bfloat16, seed)).float().square().sum().backward()
    for (name, want), got in zip(eager.named_parameters(), compiled.parameters()):
        assert torch.equal(got.main_grad, want.main_grad), name
        assert got.dim() == 1 or got.grad is None, name
    assert all(p.main_grad.any() for p in compiled.parameters() if p.dim() == 2)
