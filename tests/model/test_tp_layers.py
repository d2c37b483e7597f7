"""Every tensor-parallel layer and the vocab-parallel cross-entropy against its dense reference
(nn.Linear, functional.embedding, functional.cross_entropy): forward and every gradient, at tp=2 and tp=4.
Sequence parallelism: its collectives against slicing and summing, and a whole sequence-parallel
GPT (with selective recompute) against the single-process GPT: loss and every gradient."""
import pytest
import torch
import torch.distributed as dist
from torch.nn import functional

from helpers.distributed import run_distributed
from model.config import GPTConfig
from model.config import padded_vocab_size
from model.gpt.model import GPT
from model.hf.convert import rule_for
from model.parallel.cross_entropy import vocab_parallel_cross_entropy
from model.parallel.layers import ColumnParallelLinear, RowParallelLinear, allreduce_sequence_parallel_grads, shard_rows
from model.parallel.mappings import gather_from_sequence_parallel_region, reduce_scatter_to_sequence_parallel_region
from model.parallel.vocab_embedding import VocabParallelEmbedding

ATOL = 1e-5


def _world_group():
    return dist.new_group(list(range(dist.get_world_size())))


def _shard_last(t: torch.Tensor, group, stride: int = 1) -> torch.Tensor:
    return shard_rows(t.movedim(-1, 0), group, stride).movedim(0, -1)


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _check(name, got, want):
    assert got.shape == want.shape, (name, got.shape, want.shape)
    err = (got - want).abs().max().item()
    assert err <= ATOL, f"{name}: max abs error {err:.3g} (rank {dist.get_rank()})"


def _column_body(stride: int, gather_output: bool):
    group = _world_group()
    d_in, d_out = 16, 24
    layer = ColumnParallelLinear(d_in, d_out, group, torch.Generator().manual_seed(0), 0.5,
                                 gather_output=gather_output, stride=stride)
    dense = torch.nn.Linear(d_in, d_out)
    with torch.no_grad():
        dense.weight.copy_(torch.empty(d_out, d_in).normal_(0, 0.5, generator=torch.Generator().manual_seed(0)))
        dense.bias.copy_(_randn(d_out, seed=1))
        layer.bias.copy_(shard_rows(dense.bias, group, stride))
    x = _randn(3, 5, d_in, seed=2)
    x_dense, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    probe = _randn(3, 5, d_out, seed=3)  # loss = <y, probe>, so dL/dy = probe

    y_dense = dense(x_dense)
    (y_dense * probe).sum().backward()
    y_tp = layer(x_tp)
    if gather_output:
        _check("column output (gathered)", y_tp, y_dense)
        (y_tp * probe).sum().backward()
    else:
        _check("column output shard", y_tp, _shard_last(y_dense, group, stride))
        (y_tp * _shard_last(probe, group, stride)).sum().backward()
    _check("column dL/dx", x_tp.grad, x_dense.grad)
    _check("column dL/dW shard", layer.weight.grad, shard_rows(dense.weight.grad, group, stride))
    _check("column dL/db shard", layer.bias.grad, shard_rows(dense.bias.grad, group, stride))
    assert layer.weight.tensor_model_parallel and layer.bias.tensor_model_parallel


def _row_body():
    group = _world_group()
    d_in, d_out = 24, 16
    layer = RowParallelLinear(d_in, d_out, group, torch.Generator().manual_seed(0), 0.5)
    dense = torch.nn.Linear(d_in, d_out)
    with torch.no_grad():
        dense.weight.copy_(torch.empty(d_out, d_in).normal_(0, 0.5, generator=torch.Generator().manual_seed(0)))
        dense.bias.copy_(_randn(d_out, seed=1))
        layer.bias.copy_(dense.bias)
    x = _randn(3, 5, d_in, seed=2)
    x_dense = x.clone().requires_grad_()
    x_tp = _shard_last(x, group).requires_grad_()
    probe = _randn(3, 5, d_out, seed=3)

    y_dense = dense(x_dense)
    (y_dense * probe).sum().backward()
    y_tp = layer(x_tp)
    (y_tp * probe).sum().backward()
    _check("row output", y_tp, y_dense)
    _check("row dL/dx shard", x_tp.grad, _shard_last(x_dense.grad, group))
    _check("row dL/dW shard", layer.weight.grad, _shard_last(dense.weight.grad, group))
    _check("row dL/db", layer.bias.grad, dense.bias.grad)
    assert layer.weight.tensor_model_parallel
    assert not getattr(layer.bias, "tensor_model_parallel", False)  # replicated: counted once


def _embedding_body():
    group = _world_group()
    tp = dist.get_world_size()
    vocab, dim = 50, 8
    padded = padded_vocab_size(vocab, tp, multiple=3)  # padding lands in the last shard(s)
    layer = VocabParallelEmbedding(vocab, padded, dim, group, torch.Generator().manual_seed(0), 0.5)
    full = torch.zeros(padded, dim)
    full[:vocab].normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    dense_weight = full.clone().requires_grad_()
    ids = torch.randint(0, vocab, (4, 7), generator=torch.Generator().manual_seed(1))
    probe = _randn(4, 7, dim, seed=2)

    _check("embedding shard init", layer.weight.detach(), shard_rows(full, group))
    emb_dense = functional.embedding(ids, dense_weight)
    (emb_dense * probe).sum().backward()
    emb_tp = layer(ids)
    _check("embedding output", emb_tp, emb_dense)
    (emb_tp * probe).sum().backward()
    _check("embedding dL/dE shard", layer.weight.grad, shard_rows(dense_weight.grad, group))

    # The same weight as output head: logits shard, padded columns masked to -inf.
    layer.weight.grad = None
    hidden = _randn(4, 7, dim, seed=3)
    h_dense, h_tp = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    w_dense = full.clone().requires_grad_()
    logits_dense = h_dense @ w_dense.t()
    logits_dense = logits_dense.masked_fill(torch.arange(padded) >= vocab, float("-inf"))
    probe = _randn(4, 7, padded, seed=4)
    logits_tp = layer.logits(h_tp)
    _check("logits shard", logits_tp.nan_to_num(neginf=-1e30), _shard_last(logits_dense, group).nan_to_num(neginf=-1e30))
    real = torch.isfinite(logits_dense)
    (logits_dense.masked_fill(~real, 0) * probe).sum().backward()
    (logits_tp.masked_fill(~_shard_last(real, group), 0) * _shard_last(probe, group)).sum().backward()
    _check("logits dL/dh", h_tp.grad, h_dense.grad)
    _check("logits dL/dE shard", layer.weight.grad, shard_rows(w_dense.grad, group))


def _cross_entropy_body():
    group = _world_group()
    tp = dist.get_world_size()
    vocab = 37
    padded = padded_vocab_size(vocab, tp, multiple=4)
    logits = _randn(3, 6, padded, seed=0) * 3
    logits[..., vocab:] = float("-inf")  # padding as the head produces it
    target = torch.randint(0, vocab, (3, 6), generator=torch.Generator().manual_seed(1))
    weights = _randn(3, 6, seed=2)  # a non-uniform dL/dloss per token

    l_dense = logits[..., :vocab].clone().requires_grad_()
    loss_dense = functional.cross_entropy(l_dense.reshape(-1, vocab), target.reshape(-1), reduction="none").view(3, 6)
    (loss_dense * weights).sum().backward()

    l_tp = _shard_last(logits, group).clone().requires_grad_()
    loss_tp = vocab_parallel_cross_entropy(l_tp, target, group)
    (loss_tp * weights).sum().backward()
    _check("cross-entropy per token", loss_tp, loss_dense)
    grad_full = torch.cat([l_dense.grad, torch.zeros(3, 6, padded - vocab)], dim=-1)
    _check("cross-entropy dL/dlogits shard", l_tp.grad, _shard_last(grad_full, group))


def _sequence_chunk(t: torch.Tensor, group) -> torch.Tensor:
    return t.chunk(dist.get_world_size(group), dim=1)[dist.get_rank(group)]


def _sequence_mappings_body():
    """Each SP collective and its backward against what it means on full tensors."""
    group = _world_group()
    rank, tp = dist.get_rank(), dist.get_world_size()
    full = _randn(2, 4 * tp, 3, seed=0)
    probe = _randn(2, 4 * tp, 3, seed=1)  # loss = <y, probe>, so dL/dy = probe

    x = _sequence_chunk(full, group).clone().requires_grad_()
    y = gather_from_sequence_parallel_region(x, group)
    _check("gather forward", y, full)
    (y * probe * (rank + 1)).sum().backward()  # rank r's consumer sees a partial gradient
    _check("gather backward = reduce-scatter", x.grad, _sequence_chunk(probe, group) * tp * (tp + 1) / 2)

    x = (full * (rank + 1)).requires_grad_()  # partial sums: their total is full * tp(tp+1)/2
    y = reduce_scatter_to_sequence_parallel_region(x, group)
    _check("reduce-scatter forward", y, _sequence_chunk(full, group) * tp * (tp + 1) / 2)
    (y * _sequence_chunk(probe, group)).sum().backward()
    _check("reduce-scatter backward = all-gather", x.grad, probe)


def _dense_shard(full: torch.Tensor, name: str, group) -> torch.Tensor:
    rule = rule_for(name)
    if rule.dim is None:
        return full
    if rule.dim == 0:
        return shard_rows(full, group, rule.stride)
    return _shard_last(full, group)


def _sequence_parallel_gpt_body():
    """A sequence-parallel GPT with selective recompute: embedding reduce-scatter, wpe offsets,
    LayerNorm and row-bias gradients summed over TP, gathered logits. Same loss and gradients."""
    group = _world_group()
    tp = dist.get_world_size()
    config = GPTConfig(n_layer=2, n_head=4, n_embd=16, seq_len=4 * tp, vocab_size=96, seed=3)
    sp = GPT(GPTConfig(**dict(vars(config), sequence_parallel=True, recompute_attention=True)), group)
    dense = GPT(config)
    ids = torch.randint(0, 96, (2, config.seq_len + 1), generator=torch.Generator().manual_seed(4))
    losses = [vocab_parallel_cross_entropy(model(ids[:, :-1]), ids[:, 1:], g).mean()
              for model, g in ((dense, None), (sp, group))]
    for loss in losses:
        loss.backward()
    allreduce_sequence_parallel_grads(sp, group)  # the once-per-step sum (model/parallel/layers.py)
    _check("SP GPT loss", losses[1].detach(), losses[0].detach())
    dense_params = dict(dense.named_parameters())
    for name, param in sp.named_parameters():
        _check(f"SP GPT dL/d{name}", param.grad, _dense_shard(dense_params[name].grad, name, group))


def _all_layers(tp_size):
    for stride in (1, 3):
        _column_body(stride, gather_output=False)
    _column_body(1, gather_output=True)
    _row_body()
    _embedding_body()
    _cross_entropy_body()
    _sequence_mappings_body()
    _sequence_parallel_gpt_body()


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_layers_match_dense(tp):
    run_distributed(_all_layers, tp, tp)


def test_cross_entropy_single_rank_matches_torch():
    logits = _randn(2, 5, 11, seed=0).requires_grad_()
    target = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))
    ours = vocab_parallel_cross_entropy(logits, target, None).mean()
    ref = functional.cross_entropy(logits.view(-1, 11), target.view(-1))
    assert torch.allclose(ours, ref, atol=1e-6)
    (g_ours,) = torch.autograd.grad(ours, logits)
    (g_ref,) = torch.autograd.grad(ref, logits)
    assert torch.allclose(g_ours, g_ref, atol=1e-7)


def _chunked_cross_entropy_body():
    """The chunked loss against functional.cross_entropy on the dense (unpadded) logits, at this
    world's tp: chunk sizes that do not divide the 5 x 7 tokens, ignored labels, both gradient
    buffers, fp32 (1e-6 relative) and bf16 (its rounding); and 3 all-reduces per loss call, as
    before chunking (max, sum of exponentials, target logit)."""
    tp = dist.get_world_size() if dist.is_initialized() else 1
    group = _world_group() if tp > 1 else None
    vocab = 53
    padded = padded_vocab_size(vocab, tp, multiple=8)
    logits = _randn(5, 7, padded, seed=0) * 4
    logits[..., vocab:] = float("-inf")
    target = torch.randint(0, vocab, (5, 7), generator=torch.Generator().manual_seed(1))
    target[0, 3] = target[4, 6] = -100  # functional.cross_entropy's ignore_index
    weights = _randn(5, 7, seed=2)

    def dense(dtype):
        l_dense = logits[..., :vocab].to(dtype).float().requires_grad_()
        loss = functional.cross_entropy(l_dense.flatten(0, 1), target.flatten(), reduction="none").view(5, 7)
        (loss * weights).sum().backward()
        grad = torch.cat([l_dense.grad, torch.zeros(5, 7, padded - vocab)], dim=-1)
        return loss.detach(), grad if group is None else _shard_last(grad, group)

    calls = []
    all_reduce = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return all_reduce(*args, **kwargs)
    for dtype, rtol, atol in ((torch.float32, 1e-6, 1e-7), (torch.bfloat16, 1e-2, 1e-2)):
        loss_want, grad_want = dense(dtype)
        for chunk in (1, 4, 6, 35, 100, None):
            for consume in (False, True):
                shard = (logits if group is None else _shard_last(logits, group)).to(dtype)
                l_tp = shard.clone().requires_grad_()
                dist.all_reduce = counting
                try:
                    calls.clear()
                    loss = vocab_parallel_cross_entropy(l_tp * 1, target, group, chunk_tokens=chunk,
                                                        consume_logits=consume)
                    (loss * weights).sum().backward()
                finally:
                    dist.all_reduce = all_reduce
                assert calls == ([torch.Size([35])] * 3 if group is not None else []), calls
                where = f"{dtype} chunk {chunk} consume {consume} tp {tp}"
                torch.testing.assert_close(loss.float(), loss_want, rtol=rtol, atol=atol, msg=where)
                torch.testing.assert_close(l_tp.grad.float(), grad_want, rtol=rtol, atol=atol, msg=where)
                assert (loss[0, 3] == 0).item() and (l_tp.grad[0, 3] == 0).all().item()


def test_chunked_cross_entropy_matches_torch_tp1():
    _chunked_cross_entropy_body()
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        vocab_parallel_cross_entropy(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), None, chunk_tokens=0)


def test_chunked_cross_entropy_matches_torch_tp2():
    run_distributed(_chunked_cross_entropy_body, 2)


def _overlap_body():
    """The order of the ops a column-parallel backward dispatches: the all-reduce of dL/dX is issued
    before the GEMM of dL/dW (which then runs while the all-reduce is in flight), for a single
    linear, for q/k/v-style projections of one input, and for the vocab-parallel head (with and
    without padding rows in the shard)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from model.parallel.layers import column_parallel_projections

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    group, gen = _world_group(), torch.Generator().manual_seed(0)
    linear = ColumnParallelLinear(16, 24, group, gen, 0.02)
    head = VocabParallelEmbedding(32, 32, 16, group, gen, 0.02)
    padded = VocabParallelEmbedding(30, 32, 16, group, gen, 0.02)  # rank 1's shard holds 2 padding rows
    extra = torch.nn.Parameter(torch.randn(8, 16))
    cases = {"linear": lambda x: linear(x),
             "projections": lambda x: sum(y.sum() for y in column_parallel_projections(
                 x, [(linear.weight, linear.bias), (extra, None)], group, sequence_parallel=False)),
             "head": lambda x: head.logits(x),
             "padded head": lambda x: padded.logits(x).clamp(min=-1e4)}  # -inf columns summed would be -inf
    for name, forward in cases.items():
        x = torch.randn(2, 5, 16, requires_grad=True)
        out = forward(x).sum()
        with Ops() as ops:
            out.backward()
        gemms = [i for i, op in enumerate(ops.names) if op in ("mm.default", "mm.out", "matmul.default", "bmm.default")]
        reduce = ops.names.index("allreduce_.default")
        assert gemms and reduce < gemms[-1], (name, ops.names)  # dL/dW's GEMM after the all-reduce started


def test_column_parallel_backward_all_reduces_while_it_computes_the_weight_gradient():
    run_distributed(_overlap_body, 2)


def _sequence_mappings_without_the_2_13_names():
    """As on torch 2.11 and 2.12, which have only all_gather_into_tensor / reduce_scatter_tensor."""
    for name in ("all_gather_single", "reduce_scatter_single"):
        if hasattr(dist, name):  # absent already on torch 2.11 and 2.12
            delattr(dist, name)
    _sequence_mappings_body()


def test_sequence_collectives_run_on_a_torch_without_the_2_13_names():
    run_distributed(_sequence_mappings_without_the_2_13_names, 2)
