"""The attention core shared by GPT-2's attention (model/gpt.py) and the Llama family's
(model/llama.py), after their projections: RoPE on q and k (positions 0..T-1, or restarting at
each document under the document mask; the tables and the mask come built once per micro-batch
per stage, model/attention_inputs.py), causal or document-masked scaled-dot-product attention,
its dropout under the per-TP-rank RNG, and selective recompute (Korthikanti et al. 2022 sec. 5).
"""
from typing import Callable, ContextManager, Optional

import torch
import torch.utils.checkpoint
from torch.nn import functional

from model.config import GPTConfig
from model.attention_inputs import AttentionInputs, causal_inputs
from model.documents import document_attention
from model.rotary import apply_rope


class AttentionCore:
    """softmax(q k^T / sqrt(d) + mask) v for one rank's heads; no parameters."""

    def __init__(self, config: GPTConfig, dropout_rng: Callable[[], ContextManager], enable_gqa: bool = False):
        self.config = config
        self.dropout = config.dropout
        self.dropout_rng = dropout_rng
        self.recompute = config.recompute_attention
        self.enable_gqa = enable_gqa

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, training: bool,
                 inputs: Optional[AttentionInputs] = None) -> torch.Tensor:
        """(B, heads, T, d) queries, (B, kv heads, T, d) keys and values -> (B, heads, T, d).
        `inputs`: the stage's RoPE tables and mask for this micro-batch; None outside a Block
        (plain causal attention, its tables built here)."""
        if inputs is None:
            inputs = causal_inputs(self.config, q.size(-2), q.device, q.dtype)
        if inputs.rope is not None:
            cos, sin = inputs.rope
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        dropout_p = self.dropout if training else 0.0
        mask = inputs.mask
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
