"""The attention core shared by GPT-2's attention (model/gpt.py) and the Llama family's
(model/llama.py), after their projections: RoPE on q and k (positions 0..T-1, or restarting at
each document under the document mask), causal or document-masked scaled-dot-product attention,
its dropout under the per-TP-rank RNG, and selective recompute (Korthikanti et al. 2022 sec. 5).
"""
from typing import Callable, ContextManager, Dict, Optional

import torch
import torch.utils.checkpoint
from torch.nn import functional

from model.config import GPTConfig
from model.documents import DocumentLayout, document_attention
from model.rotary import apply_rope, at_positions, rope_cos_sin


class AttentionCore:
    """softmax(q k^T / sqrt(d) + mask) v for one rank's heads; no parameters."""

    def __init__(self, config: GPTConfig, dropout_rng: Callable[[], ContextManager], enable_gqa: bool = False):
        self.rope_theta: Optional[float] = config.rope_theta if config.position == "rope" else None
        self.rope_scaling: Optional[Dict[str, float]] = config.rope_scaling
        self.dropout = config.dropout
        self.dropout_rng = dropout_rng
        self.recompute = config.recompute_attention
        self.enable_gqa = enable_gqa

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, training: bool,
                 documents: Optional[DocumentLayout] = None) -> torch.Tensor:
        """(B, heads, T, d) queries, (B, kv heads, T, d) keys and values -> (B, heads, T, d)."""
        if self.rope_theta is not None:
            T, d = q.shape[-2:]
            cos, sin = rope_cos_sin(T, d, self.rope_theta, q.device, q.dtype, self.rope_scaling)
            if documents is not None:
                cos, sin = at_positions(cos, sin, documents.positions)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        dropout_p = self.dropout if training else 0.0
        mask = None if documents is None else documents.mask
        # Attention probabilities are TP-sharded: their dropout mask must differ per TP rank.
        with self.dropout_rng():
            if self.recompute and training:
                # Selective recompute: store only q, k, v. The checkpoint runs inside the forked
                # RNG, so the state it saves and restores for the replay is the TP-rank stream
                # that drew the forward's dropout mask.
                return torch.utils.checkpoint.checkpoint(self._core, q, k, v, mask, dropout_p, use_reentrant=False,
                                                         preserve_rng_state=True)
            return self._core(q, k, v, mask, dropout_p)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, dropout_p: float) -> torch.Tensor:
        if mask is not None:  # the document mask (model/documents.py)
            return document_attention(q, k, v, mask, dropout_p, enable_gqa=self.enable_gqa)
        return functional.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p,
                                                       enable_gqa=self.enable_gqa)
