"""Context parallelism's model side (DeepSpeed-Ulysses, Jacobs et al. 2023; model/parallel/mappings.py,
model/transformer/attention.py) against dense references, on CPU processes over gloo (no DeepSpeed engine):

- the two all-to-alls, forward and gradient, against slicing the full tensor (the dense map is
  the identity on the whole tensor, its gradient the probe);
- the segment ids of the whole sequence from each CP rank's shard against `document_ids` of all ids;
- a GPT-2 block and a Llama block (grouped-query; n_kv_head < tp x cp, so key/value heads are
  copied) at cp = 2 and 4, and at tp = 2 x cp = 2, causal and with the document mask, with sequence
  parallelism and selective recompute: each CP rank's output shard and input gradient against the
  same block run on the whole sequence in one process, and every parameter's gradient, summed over
  CP (as DeepSpeed's data-parallel reduction over dp x cp sums it), against the dense block's.
"""
import dataclasses

import pytest
import torch
import torch.distributed as dist

from helpers.distributed import run_distributed
from model.config import GPTConfig
from model.hf.convert import split
from model.parallel.all_to_all import all_to_all_heads_to_sequence, all_to_all_sequence_to_heads
from model.parallel.layers import allreduce_sequence_parallel_grads
from model.transformer.attention import check_context_heads, kv_copies
from model.transformer.block import Block
from model.transformer.documents import document_ids, full_sequence_segments

EOS = 0
GPT2 = GPTConfig(n_layer=2, n_head=8, n_embd=32, seq_len=16, vocab_size=97, seed=3)
LLAMA = GPTConfig(arch="llama", n_layer=2, n_head=8, n_kv_head=2, n_embd=32, ffn_hidden_size=48, seq_len=16,
                  vocab_size=97, seed=3)


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _layout_groups(tp: int, cp: int):
    """(tp_group, cp_group, tp_rank, cp_rank) with TP ranks adjacent, then CP (rank = cp_rank * tp +
    tp_rank), as the run's topology lays them out; a group of one is None."""
    rank = dist.get_rank()
    tp_group = cp_group = None
    for c in range(cp):
        group = dist.new_group([c * tp + t for t in range(tp)])  # collective: every rank creates every group
        if rank // tp == c and tp > 1:
            tp_group = group
    for t in range(tp):
        group = dist.new_group([c * tp + t for c in range(cp)])
        if rank % tp == t and cp > 1:
            cp_group = group
    return tp_group, cp_group, rank % tp, rank // tp


def _chunk(t: torch.Tensor, dim: int, index: int, count: int) -> torch.Tensor:
    return t.chunk(count, dim=dim)[index]


# ------------------------------------------------------------------ the mappings

def _mappings_body():
    cp, rank = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(cp)))
    B, H, T, d = 2, 2 * cp, 3 * cp, 5
    full = _randn(B, H, T, d, seed=0)  # every rank builds the same whole tensor
    probe = _randn(B, H, T, d, seed=1)  # loss = <y, probe>: the gradient of the whole map is the probe

    x = _chunk(full, 2, rank, cp).clone().requires_grad_()  # this rank's tokens of every head
    y = all_to_all_sequence_to_heads(x, group)
    torch.testing.assert_close(y, _chunk(full, 1, rank, cp), rtol=0, atol=0)  # every token of its heads
    (y * _chunk(probe, 1, rank, cp)).sum().backward()
    torch.testing.assert_close(x.grad, _chunk(probe, 2, rank, cp), rtol=0, atol=0)

    x = _chunk(full, 1, rank, cp).clone().requires_grad_()
    y = all_to_all_heads_to_sequence(x, group)
    torch.testing.assert_close(y, _chunk(full, 2, rank, cp), rtol=0, atol=0)
    (y * _chunk(probe, 2, rank, cp)).sum().backward()
    torch.testing.assert_close(x.grad, _chunk(probe, 1, rank, cp), rtol=0, atol=0)

    # The segment ids of the whole sequence from the shards: documents cross shard boundaries,
    # a shard may start with an EOS, and row 2 has none at all.
    ids = torch.randint(1, 50, (3, T), generator=torch.Generator().manual_seed(2))
    ids[0, [1, T // cp, T - 2]] = EOS
    ids[1, [0, T // cp - 1, T // cp + 1]] = EOS
    local = document_ids(_chunk(ids, 1, rank, cp), EOS)
    torch.testing.assert_close(full_sequence_segments(local, group), document_ids(ids, EOS), rtol=0, atol=0)


@pytest.mark.parametrize("cp", [2, 4])
def test_all_to_alls_and_segments_match_slicing_the_full_tensor(cp):
    run_distributed(_mappings_body, cp)


def test_identity_without_a_group_and_head_checks():
    x = _randn(2, 4, 6, 3, seed=0)
    assert all_to_all_sequence_to_heads(x, None) is x and all_to_all_heads_to_sequence(x, None) is x
    segments = document_ids(torch.tensor([[3, EOS, 4]]), EOS)
    assert full_sequence_segments(segments, None) is segments
    # Each CP rank must receive whole key/value heads for its query heads: (kv per TP rank, cp) -> copies
    assert [kv_copies(kv, cp) for kv, cp in [(4, 2), (2, 2), (1, 2), (2, 4), (3, 2), (1, 4)]] == [1, 1, 2, 2, 2, 4]
    with pytest.raises(ValueError, match=r"model.n_head=4 must divide by tp x cp = 2 x 4"):
        check_context_heads(4, 2, 4)


# ------------------------------------------------------------------ blocks against the dense block

def _ids(config: GPTConfig, B: int) -> torch.Tensor:
    """Windows whose documents cross the shard boundaries of every cp (and tp chunks under SP)."""
    T = config.seq_len
    ids = torch.randint(1, config.vocab_size, (B, T), generator=torch.Generator().manual_seed(7))
    ids[0, [3, 7, 8, 13]] = EOS
    ids[1, [4, 11]] = EOS
    return ids


def _check_block(config: GPTConfig, tp_group, cp_group, tp_rank: int, cp_rank: int, tp: int, cp: int) -> None:
    B, T, h = 2, config.seq_len, config.n_embd
    name = f"{config.arch} tp={tp} cp={cp} doc={config.document_mask} sp={config.sequence_parallel}"
    x = _randn(B, T, h, seed=11)
    probe = _randn(B, T, h, seed=12)
    ids = _ids(config, B)

    dense = Block(config, 0, None)  # block 0 of 2: with the document mask it passes the segment ids on
    x_dense = x.clone().requires_grad_()
    out = dense((x_dense, document_ids(ids, EOS)) if config.document_mask else x_dense)
    out = out[0] if config.document_mask else out
    (out * probe).sum().backward()

    # This rank's tokens: CP shard cp_rank, and under SP its TP chunk of that shard.
    sp_chunks = tp if config.sequence_parallel else 1
    def local(t):
        return _chunk(_chunk(t, 1, cp_rank, cp), 1, tp_rank if sp_chunks > 1 else 0, sp_chunks)
    block = Block(config, 0, tp_group, cp_group=cp_group)
    block.train()
    x_local = local(x).clone().requires_grad_()
    segments = document_ids(_chunk(ids, 1, cp_rank, cp), EOS)  # the shard's own count, as TokenEmbedding gives
    out_local = block((x_local, segments) if config.document_mask else x_local)
    out_local = out_local[0] if config.document_mask else out_local
    (out_local * local(probe)).sum().backward()
    torch.testing.assert_close(out_local, local(out.detach()), rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"{name} output: {m}")
    torch.testing.assert_close(x_local.grad, local(x_dense.grad), rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"{name} dL/dx: {m}")

    allreduce_sequence_parallel_grads(block, tp_group)  # SP's TP sum (model/parallel/layers.py)
    dense_params = dict(dense.named_parameters())
    for param_name, param in block.named_parameters():
        grad = param.grad.clone()
        if cp_group is not None:  # weights are replicated over CP: their gradients sum over it
            dist.all_reduce(grad, group=cp_group)
        want = split(f"blocks.0.{param_name}", dense_params[param_name].grad, tp_rank, tp,
                     config.padded_vocab_size(tp), config)
        torch.testing.assert_close(grad, want, rtol=1e-4, atol=2e-6, msg=lambda m: f"{name} dL/d{param_name}: {m}")


def _blocks_body(tp: int, cp: int, cases):
    tp_group, cp_group, tp_rank, cp_rank = _layout_groups(tp, cp)
    for config in cases:
        _check_block(config, tp_group, cp_group, tp_rank, cp_rank, tp, cp)


def _cases(tp: int, cp: int):
    document = dict(document_mask=True, eos_token_id=EOS)
    sp = dict(sequence_parallel=True) if tp > 1 else {}
    # 3 key/value heads at cp = 2: neither divides the other, each CP rank gets copies of two of them
    uneven = [dataclasses.replace(LLAMA, n_head=6, n_kv_head=3, n_embd=48)] if 6 % (tp * cp) == 0 else []
    return uneven + [
        GPT2, dataclasses.replace(GPT2, **document, **sp, recompute_attention=True),
        LLAMA,  # 2 key/value heads: copied at cp = 4, and per TP rank at tp x cp = 4
        dataclasses.replace(LLAMA, **document, **sp),
        dataclasses.replace(LLAMA, n_kv_head=1, recompute_attention=True, **document),  # multi-query: copied at any cp
    ]


@pytest.mark.parametrize("tp,cp", [(1, 2), (1, 4), (2, 2)], ids=["cp2", "cp4", "tp2-cp2"])
def test_context_parallel_blocks_match_the_dense_block(tp, cp):
    run_distributed(_blocks_body, tp * cp, tp, cp, _cases(tp, cp))
