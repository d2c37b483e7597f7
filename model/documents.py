"""The document mask (`data.document_mask`): inside a packed window each token attends only to
earlier tokens of its own document, and positions restart at 0 at each document start. Each EOS
starts the next document, as a BOS would; no loss is masked. The (B, T) segment ids travel with
the hidden states (only tensors cross stages, docs/design.md contract 7); each stage derives the
positions and one mask per micro-batch from them (`DocumentMasks`). Kernels: flex_attention with a
BlockMask on CUDA with dropout 0, else SDPA with a boolean (B, 1, T, T) mask (`document_attention`).
Why each choice: docs/data.md, "Documents in a window"."""
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.nn import functional

_compiled_flex_attention = None


def document_ids(ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """(B, T) token ids -> (B, T) segment ids: the number of EOS tokens up to and including each."""
    return (ids == eos_token_id).cumsum(dim=-1)


def document_positions(segments: torch.Tensor) -> torch.Tensor:
    """(B, T) segment ids -> (B, T) position of each token inside its segment (0 at its start)."""
    index = torch.arange(segments.size(-1), device=segments.device).expand_as(segments)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=-1).values


def uses_flex_attention(device: torch.device, dropout: float) -> bool:
    """The kernel choice (module docstring): flex_attention on CUDA without dropout, else SDPA with a mask."""
    return device.type == "cuda" and dropout == 0.0


def dense_document_mask(segments: torch.Tensor) -> torch.Tensor:
    """(B, T) segment ids -> (B, 1, T, T) boolean: True where query i may attend key j."""
    T = segments.size(-1)
    causal = torch.ones(T, T, dtype=torch.bool, device=segments.device).tril()
    return (segments.unsqueeze(-1) == segments.unsqueeze(-2)).logical_and_(causal).unsqueeze(1)


def block_document_mask(segments: torch.Tensor) -> Any:
    """(B, T) segment ids -> flex_attention's BlockMask of the same rule (one for all heads)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def document_causal(b, h, q_index, kv_index):
        return (segments[b, q_index] == segments[b, kv_index]) & (q_index >= kv_index)
    B, T = segments.shape
    return create_block_mask(document_causal, B, None, T, T, device=segments.device)


@dataclass
class DocumentLayout:
    """What the blocks of one stage need for one micro-batch."""
    positions: torch.Tensor
    """(B, T) position of each token in its document."""
    mask: Any
    """The boolean (B, 1, T, T) mask, or a BlockMask on the flex_attention path."""


class DocumentMasks:
    """Positions and mask of the last micro-batch's segment ids, built once and shared by the
    blocks (and heads) of one stage. A different segment tensor rebuilds them: each micro-batch
    arrives as a new tensor (DeepSpeed clones what it receives), and the recomputation of full
    activation checkpointing gets a detached view of the same storage, which is recognised."""

    def __init__(self, dropout: float = 0.0):
        self.dropout = dropout
        self._segments: Optional[torch.Tensor] = None
        self._layout: Optional[DocumentLayout] = None

    def _is_cached(self, segments: torch.Tensor) -> bool:
        # Holding a reference keeps the cached storage alive, so an equal pointer is the same tensor.
        cached = self._segments
        return (cached is not None and segments.data_ptr() == cached.data_ptr()
                and segments.shape == cached.shape and segments.stride() == cached.stride()
                and segments._version == cached._version)

    def layout(self, segments: torch.Tensor) -> DocumentLayout:
        if not self._is_cached(segments):
            with torch.no_grad():
                mask = (block_document_mask(segments) if uses_flex_attention(segments.device, self.dropout)
                        else dense_document_mask(segments))
                self._layout = DocumentLayout(document_positions(segments), mask)
            self._segments = segments
        return self._layout


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, dropout_p: float,
                       enable_gqa: bool = False) -> torch.Tensor:
    """Attention of (B, heads, T, d) queries restricted by `mask` (a DocumentLayout's)."""
    if isinstance(mask, torch.Tensor):
        return functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                                       enable_gqa=enable_gqa)
    global _compiled_flex_attention
    if _compiled_flex_attention is None:  # compiled on first use: importing the model stays cheap
        from torch.nn.attention.flex_attention import flex_attention
        _compiled_flex_attention = torch.compile(flex_attention)
    return _compiled_flex_attention(q, k, v, block_mask=mask, enable_gqa=enable_gqa)
