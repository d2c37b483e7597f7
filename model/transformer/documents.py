"""The document mask (`data.document_mask`): inside a packed window each token attends only to
earlier tokens of its own document, and positions restart at 0 at each document start. Each EOS
starts the next document, as a BOS would; no loss is masked. The (B, T) segment ids travel with
the hidden states (only tensors cross stages, docs/design.md contract 7); each stage derives the
positions and one mask per micro-batch from them (model/transformer/attention_inputs.py). Kernels:
flex_attention with a BlockMask on CUDA with dropout 0, else SDPA with a boolean (B, 1, T, T) mask
(`document_attention`). Why each choice: docs/data.md, "Documents in a window"."""
from typing import Any, Tuple

import torch
from torch.nn import functional

from model.parallel.all_to_all import all_gather_context
from model.parallel.mappings import Group

_compiled_flex_attention = None

FLEX_BLOCK = 128
"""flex_attention's tile: create_block_mask's and the kernels' default block size."""


def document_ids(ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """(B, T) token ids -> (B, T) segment ids: the number of EOS tokens up to and including each."""
    return (ids == eos_token_id).cumsum(dim=-1)


def full_sequence_segments(segments: torch.Tensor, cp_group: Group) -> torch.Tensor:
    """(B, T/cp) segment ids of this CP rank's shard, counted inside the shard (`document_ids` of
    its ids) -> (B, T) those of the whole sequence, equal to `document_ids` of all the ids: each
    shard's ids plus the EOS tokens of the shards before it (the last id of a shard is its EOS
    count). One all-gather of integers over CP; the identity without CP."""
    if cp_group is None:
        return segments
    shards = all_gather_context(segments, cp_group)  # (cp, B, T/cp)
    eos_in_shard = shards[:, :, -1:]  # (cp, B, 1)
    eos_before = eos_in_shard.cumsum(dim=0) - eos_in_shard
    return (shards + eos_before).movedim(0, 1).reshape(segments.size(0), -1)  # (B, T)


def document_positions(segments: torch.Tensor) -> torch.Tensor:
    """(B, T) segment ids -> (B, T) position of each token inside its segment (0 at its start)."""
    index = torch.arange(segments.size(-1), device=segments.device).expand_as(segments)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=-1).values


def uses_flex_attention(device: torch.device, dropout: float) -> bool:
    """The kernel choice (module docstring): flex_attention on CUDA without dropout, else SDPA with a
    mask. (On CPU torch 2.13's flex_attention has a forward only: it refuses inputs that need grad.)
    The meta device counts as CUDA: tests/model/test_cuda_contracts.py checks the CUDA path there."""
    return device.type in ("cuda", "meta") and dropout == 0.0


def dense_document_mask(segments: torch.Tensor) -> torch.Tensor:
    """(B, T) segment ids -> (B, 1, T, T) boolean: True where query i may attend key j."""
    T = segments.size(-1)
    causal = torch.ones(T, T, dtype=torch.bool, device=segments.device).tril()
    return (segments.unsqueeze(-1) == segments.unsqueeze(-2)).logical_and_(causal).unsqueeze(1)


def _ordered_blocks(member: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(B, n, n) boolean [query block, key block] -> BlockMask's (B, 1, n) counts and (B, 1, n, n)
    indices: each row's member key blocks first, in increasing order."""
    counts = member.sum(dim=-1, dtype=torch.int32)
    indices = member.to(torch.int8).argsort(dim=-1, descending=True, stable=True).to(torch.int32)
    return counts.unsqueeze(1), indices.unsqueeze(1)


def block_document_mask(segments: torch.Tensor, block_size: int = FLEX_BLOCK) -> Any:
    """(B, T) segment ids -> flex_attention's BlockMask of the same rule (one for all heads), from
    the document starts alone: (B, T) integers and (B, T/block, T/block) block tables, never a
    (T, T) tensor (create_block_mask evaluates the rule on every (q, kv) pair: 5.6 GiB at 8 x 8192)."""
    from torch.nn.attention.flex_attention import BlockMask
    B, T = segments.shape
    n = -(-T // block_size)
    # starts[b, i]: the first token of token i's document. Nondecreasing along T (segment ids are a
    # running count), so a block row's first query has the row's lowest start and its last the highest.
    starts = torch.arange(T, device=segments.device) - document_positions(segments)  # (B, T)
    blocks = torch.arange(n, device=segments.device)
    first_query = blocks * block_size
    last_query = (first_query + block_size - 1).clamp(max=T - 1)
    lowest_seen = starts[:, first_query] // block_size  # (B, n): no query of the row sees a key block below
    first_full = -(-starts[:, last_query] // block_size)  # (B, n): every query of the row sees these whole
    q_block, kv_block = blocks.view(1, n, 1), blocks.view(1, 1, n)
    full = (kv_block >= first_full.unsqueeze(-1)) & (kv_block < q_block)  # (B, n, n); never the diagonal
    partial = (kv_block >= lowest_seen.unsqueeze(-1)) & (kv_block <= q_block) & ~full

    def document_causal(b, h, q_index, kv_index):  # the rule inside the partial blocks
        return (kv_index >= starts[b, q_index]) & (kv_index <= q_index)
    return BlockMask.from_kv_blocks(*_ordered_blocks(partial), *_ordered_blocks(full), BLOCK_SIZE=block_size,
                                    mask_mod=document_causal, seq_lengths=(T, T))


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, dropout_p: float,
                       enable_gqa: bool = False) -> torch.Tensor:
    """Attention of (B, heads, T, d) queries, (B, kv heads, T, d) keys and values restricted by
    `mask` (dense_document_mask's or block_document_mask's)."""
    if isinstance(mask, torch.Tensor):
        if enable_gqa and k.size(-3) != q.size(-3):
            # On CUDA SDPA has no flash or memory-efficient kernel for a mask with enable_gqa: it would
            # take the math kernel and its (B, heads, T, T) scores (the CPU flash kernel
            # takes either). Query head i reads key/value head i // groups, as enable_gqa does.
            # (B, kv, T, d) -> (B, heads, T, d)
            groups = q.size(-3) // k.size(-3)
            k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
        return functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
    global _compiled_flex_attention
    if _compiled_flex_attention is None:  # compiled on first use: importing the model stays cheap
        from torch.nn.attention.flex_attention import flex_attention
        _compiled_flex_attention = torch.compile(flex_attention)
    return _compiled_flex_attention(q, k, v, block_mask=mask, enable_gqa=enable_gqa)
