"""The document mask (`data.document_mask`, model/transformer/documents.py) against an independent reference:
each document of a packed window gives, token for token, the losses it has when the model runs on
it alone from position 0 with plain causal attention (no mask; fp32, relative 1e-5).

- in process, the dense model at (1,1,1): GPT-2 (learned positions) and Llama (RoPE, grouped-query
  attention), two rows with different boundaries, with and without selective recompute;
- at (tp, pp, dp) = (2,2,2) with sequence parallelism through DeepSpeed's pipeline engine (8
  forked ranks), both architectures (GPT-2's learned positions taken per rank's sequence chunk),
  one under each recompute mode: the per-token losses the last stage computes at step-0 weights
  (the same at every layout: docs/design.md contract 2), and the gradient of every shard against
  the dense masked model's; and one mask build per micro-batch per stage, also under full recompute;
- the GPU path: its BlockMask, built from the document starts, allows exactly the boolean mask's
  pairs, and compiled flex_attention with it (forward only on CPU) gives each document's losses alone.
The packed windows are synthetic, so that each holds several documents: in the embedded corpus
only 3% of the 33-token windows of the tiny recipes hold a document boundary. For the same reason
tests/e2e/test_llama_parity.py, whose runs train with the mask on, shows mostly that the mask's
plumbing (segment ids across stages, DeepSpeed's partitioned sends, both recompute modes,
resume) keeps layout parity: in its 5 steps one window holds a boundary.
RoPE's restart at each document is invisible in losses (RoPE scores depend on offsets only, which
the mask keeps within a document); learned positions' restart is not, and is checked.
"""
import dataclasses
import warnings

import pytest
import torch

from helpers.distributed import run_distributed, sgd_engine, uses_deepspeed
from model.config import GPTConfig
from model.gpt.model import GPT
from model.hf.convert import dense_name, split
from model.parallel.cross_entropy import vocab_parallel_cross_entropy
from model.parallel.state import init_parallel_state
from model.transformer.block import Block
from model.transformer.documents import block_document_mask, dense_document_mask, document_ids, document_positions

RTOL = 1e-5
EOS = 0
GPT2 = GPTConfig(n_layer=2, n_head=4, n_embd=32, seq_len=32, vocab_size=97, seed=3)
LLAMA = GPTConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden_size=48, seq_len=32,
                  vocab_size=97, seed=3)


def _masked(config: GPTConfig, **changes) -> GPTConfig:
    return dataclasses.replace(config, document_mask=True, eos_token_id=EOS, **changes)


def _windows(config: GPTConfig, seed: int = 5) -> torch.Tensor:
    """Two packed windows of seq_len + 1 tokens: a cut document's tail, then whole documents, each
    starting with the EOS that ended the one before; other boundaries in each row."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for cuts in ([5, 15], [2, 11, 20, 21]):  # row 2 also has an empty document (EOS EOS)
        row = torch.randint(1, config.vocab_size, (config.seq_len + 1,), generator=generator)
        row[cuts] = EOS
        rows.append(row)
    return torch.stack(rows)


def _segments(ids_row: torch.Tensor) -> list:
    """[(start, stop)) of each segment of one row: a new one at every EOS."""
    starts = [0] + [i for i in range(1, len(ids_row)) if ids_row[i] == EOS]
    return list(zip(starts, starts[1:] + [len(ids_row)]))


def _token_losses(model: GPT, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return vocab_parallel_cross_entropy(model(ids), labels, model.tp_group)


def _assert_documents_alone(windows: torch.Tensor, losses: torch.Tensor, plain: GPT) -> None:
    """Each segment's losses in `losses` (B, T) equal `plain` (no mask) on the segment alone."""
    ids, labels = windows[:, :-1], windows[:, 1:]
    checked = 0
    with torch.no_grad():
        for b in range(ids.size(0)):
            for start, stop in _segments(ids[b]):
                alone = _token_losses(plain, ids[b:b + 1, start:stop], labels[b:b + 1, start:stop])[0]
                torch.testing.assert_close(losses[b, start:stop], alone, rtol=RTOL, atol=0,
                                           msg=lambda m: f"row {b}, document [{start}, {stop}): {m}")
                checked += 1
    assert checked >= 5


def test_segments_and_positions_restart_at_each_eos():
    ids = torch.tensor([[7, 8, EOS, 5, 6, 9, EOS, EOS, 4]])
    segments = document_ids(ids, EOS)
    assert segments.tolist() == [[0, 0, 1, 1, 1, 1, 2, 3, 3]]
    assert document_positions(segments).tolist() == [[0, 1, 0, 1, 2, 3, 0, 0, 1]]
    mask = dense_document_mask(segments)[0, 0]
    for i in range(9):
        for j in range(9):
            assert mask[i, j] == (j <= i and segments[0, i] == segments[0, j]), (i, j)


def _block_mask_elements(block_mask, B: int, T: int, block_size: int) -> torch.Tensor:
    """A BlockMask as flex_attention reads it, element by element: (B, 1, T, T) boolean, True in its
    full blocks and, in its partial blocks, where its mask_mod says so."""
    n = block_mask.kv_num_blocks.size(-1)
    tables = []
    for counts, indices in ((block_mask.kv_num_blocks, block_mask.kv_indices),
                            (block_mask.full_kv_num_blocks, block_mask.full_kv_indices)):
        table = torch.zeros(B, n, n, dtype=torch.bool)
        for b in range(B):
            for i in range(n):
                table[b, i, indices[b, 0, i, :counts[b, 0, i]].long()] = True
        tables.append(table)
    partial, full = tables
    assert not (partial & full).any()
    q, kv = torch.arange(T).view(T, 1), torch.arange(T).view(1, T)
    rows = []
    for b in range(B):
        rule = block_mask.mask_mod(torch.tensor(b), torch.tensor(0), q, kv)
        rows.append(full[b][q // block_size, kv // block_size] | (partial[b][q // block_size, kv // block_size] & rule))
    return torch.stack(rows).unsqueeze(1)


@pytest.mark.parametrize("T,block_size", [(100, 16), (96, 16), (33, 128), (384, 128)])
def test_block_mask_from_boundaries_is_the_dense_mask(T, block_size):
    """The BlockMask built from document starts (no (T, T) tensor) allows exactly the pairs of the
    boolean mask, and marks full only blocks the rule fills: T a multiple of the block or not,
    documents shorter and longer than a block, empty documents, a row with one boundary."""
    generator = torch.Generator().manual_seed(T)
    for trial in range(3):
        ids = torch.randint(0, 6, (3, T), generator=generator)  # EOS = 0: documents of ~6 tokens
        ids[1] = torch.randint(1, 6, (T,), generator=generator)
        ids[1, T // 2] = EOS
        ids[2] = torch.randint(1, 6, (T,), generator=generator)  # no boundary: plain causal
        segments = document_ids(ids, EOS)
        got = _block_mask_elements(block_document_mask(segments, block_size), 3, T, block_size)
        assert torch.equal(got, dense_document_mask(segments)), (T, block_size, trial)


@pytest.mark.slow  # 5 s: flex_attention's first use
def test_flex_block_mask_matches_the_dense_mask():
    """The GPU kernel's BlockMask (flex_attention; on CPU forward only, unfused) against the
    boolean mask of the CPU path, on a sequence of several 128-token blocks."""
    from torch.nn.attention.flex_attention import flex_attention
    from torch.nn import functional
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 50, (2, 384), generator=generator)
    ids[0, [100, 130, 300]] = EOS
    ids[1, [255, 256]] = EOS
    segments = document_ids(ids, EOS)
    q = torch.randn(2, 4, 384, 8, generator=generator)
    k, v = (torch.randn(2, 2, 384, 8, generator=generator) for _ in range(2))
    want = functional.scaled_dot_product_attention(q, k, v, attn_mask=dense_document_mask(segments), enable_gqa=True)
    # Eager flex_attention warns that it runs unfused, once per process (torch's _warn_once): which
    # test calls it first depends on the workers' order, so the warning is silenced, not expected.
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        got = flex_attention(q, k, v, block_mask=block_document_mask(segments), enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("config", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_packed_documents_match_each_document_alone(config):
    windows = _windows(config)
    masked, plain = GPT(_masked(config)), GPT(config)  # the same weights: seeded per layer
    with torch.no_grad():
        losses = _token_losses(masked, windows[:, :-1], windows[:, 1:])
        unmasked = _token_losses(plain, windows[:, :-1], windows[:, 1:])
    _assert_documents_alone(windows, losses, plain)
    assert (losses - unmasked).abs().max() > 1e-3  # the mask changes what documents see


@pytest.mark.slow  # 15-25 s: compiles flex_attention (inductor) on CPU
def test_flex_attention_path_matches_each_document_alone(monkeypatch):
    """The GPU path, compiled flex_attention with the BlockMask from boundaries, run on CPU: torch
    2.13's flex_attention has a forward only there (it refuses inputs that need grad), so this is
    the dense Llama model in no_grad on the same windows, against each document alone."""
    import model.transformer.attention_inputs
    config = dataclasses.replace(LLAMA, n_embd=64)  # head_dim 16: flex's CPU kernel wants at least 16
    monkeypatch.setattr(model.transformer.attention_inputs, "uses_flex_attention", lambda device, dropout: True)
    windows = _windows(config)
    masked, plain = GPT(_masked(config)).eval(), GPT(config).eval()
    from torch.nn.attention.flex_attention import BlockMask
    masks = []
    masked.blocks[0].attn.register_forward_pre_hook(lambda module, args: masks.append(args[1].mask))
    with torch.no_grad():
        losses = _token_losses(masked, windows[:, :-1], windows[:, 1:])
    assert len(masks) == 1 and isinstance(masks[0], BlockMask)
    _assert_documents_alone(windows, losses, plain)


@pytest.mark.parametrize("config", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_selective_recompute_with_the_mask_gives_the_same_gradients(config):
    windows = _windows(config)
    grads = []
    for recompute in (False, True):
        model = GPT(_masked(config, recompute_attention=recompute)).train()
        _token_losses(model, windows[:, :-1], windows[:, 1:]).mean().backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


MICRO, N_MICRO = 2, 2


@uses_deepspeed
def _pipeline_body():
    """At tp=2 pp=2 dp=2 with sequence parallelism, one SGD step (lr 1) through DeepSpeed's
    pipeline engine. The last stage records each micro-batch's per-token losses and compares every
    document in it with the dense model alone; every rank compares its update (the gradient
    averaged over micro-batches and DP ranks) with its shard of the dense masked model's gradient.
    GPT-2 (learned positions per rank's sequence chunk, tied head) under full recompute
    (DeepSpeed's checkpointing of blocks), Llama (RoPE, GQA) under selective recompute."""
    state = init_parallel_state(2, 2)
    for config, full_recompute in ((_masked(GPT2, sequence_parallel=True), True),
                                   (_masked(LLAMA, sequence_parallel=True, recompute_attention=True), False)):
        engine = sgd_engine(config, state, MICRO, N_MICRO, full_recompute=full_recompute)
        pipe = engine.module
        before = {name: param.detach().clone() for name, param in pipe.named_parameters()}
        recorded = []

        def loss_fn(logits, labels):  # the engine's loss, keeping the per-token values
            losses = vocab_parallel_cross_entropy(logits, labels, state.tp_group)
            recorded.append(losses.detach().clone())
            return losses.mean()
        pipe.loss_fn = loss_fn  # read by the engine at each last-stage forward
        # DP rank r's micro-batches (the same on its first and last stage); every rank knows all.
        windows = {(r, m): _windows(config, seed=10 * r + m) for r in range(state.dp_size) for m in range(N_MICRO)}
        mine = [windows[(state.dp_rank, m)] for m in range(N_MICRO)]
        engine.train_batch(iter([(w[:, :-1], w[:, 1:]) for w in mine]))
        # One build of the mask (and RoPE's tables) per micro-batch per stage, shared by its blocks:
        # full recompute's replay of micro-batch 0, after 1F1B ran micro-batch 1's forward, reuses it.
        stage_inputs = {id(m.attention_inputs): m.attention_inputs for m in pipe.modules() if isinstance(m, Block)}
        assert [s.built for s in stage_inputs.values()] == [N_MICRO], (config.arch, [s.built for s in stage_inputs.values()])

        plain = GPT(dataclasses.replace(config, document_mask=False, sequence_parallel=False,
                                        recompute_attention=False))
        if state.pp_rank == 1 and state.tp_rank == 0:  # the TP ranks hold the same reduced losses
            assert len(recorded) == N_MICRO
            for w, losses in zip(mine, recorded):
                _assert_documents_alone(w, losses, plain)
        dense = GPT(dataclasses.replace(config, sequence_parallel=False, recompute_attention=False))
        torch.stack([_token_losses(dense, w[:, :-1], w[:, 1:]).mean() for w in windows.values()]).mean().backward()
        dense_grads = {name: param.grad for name, param in dense.named_parameters()}
        for name, param in pipe.named_parameters():
            key = dense_name(name, config)
            want = split(key, dense_grads[key], state.tp_rank, state.tp_size, config.padded_vocab_size(state.tp_size),
                         config)
            torch.testing.assert_close(before[name] - param.detach(), want, rtol=1e-4, atol=2e-6,
                                       msg=lambda m: f"{config.arch} {name}: {m}")


@pytest.mark.slow  # 8 forked ranks
def test_packed_documents_at_tp2_pp2_dp2_with_sequence_parallelism():
    run_distributed(_pipeline_body, 8)
