"""The attention core shared by GPT-2's attention (model/transformer/block.py) and the Llama family's
(model/transformer/llama.py), after their projections: RoPE on q and k (positions 0..T-1, or restarting at
each document under the document mask; the tables and the mask come built once per micro-batch
per stage, model/transformer/attention_inputs.py), causal or document-masked scaled-dot-product attention,
its dropout under the per-TP-rank RNG, and selective recompute (Korthikanti et al. 2022 sec. 5).

With context parallelism (`cp_group`, DeepSpeed-Ulysses: Jacobs et al. 2023) q, k and v arrive as
this CP rank's T/cp tokens of its TP rank's heads; an all-to-all each gives it the whole sequence
of 1/cp of those heads, the core attends over all T tokens (RoPE and the mask are the full
sequence's), and a last all-to-all returns the output to this rank's tokens of every head.
Attention is independent per head, so this computes exactly the unsplit attention
(docs/design.md, "Context parallelism").
"""
import math
from typing import Callable, ContextManager, Optional

import torch
import torch.utils.checkpoint
from torch.nn import functional

from model.config import GPTConfig
from model.parallel.all_to_all import all_to_all_heads_to_sequence, all_to_all_sequence_to_heads
from model.parallel.layers import group_size
from model.parallel.mappings import Group
from model.transformer.attention_inputs import AttentionInputs, causal_inputs
from model.transformer.documents import document_attention
from model.transformer.rotary import apply_rope


def check_context_heads(n_head: int, tp_size: int, cp_size: int) -> None:
    """Each of the tp x cp ranks attends with whole query heads (the run checks first, one line, exit 2)."""
    if n_head % (tp_size * cp_size) != 0:
        raise ValueError(f"model.n_head={n_head} must divide by tp x cp = {tp_size} x {cp_size}: "
                         f"pick tp and cp whose product divides the heads")


def kv_copies(n_kv_local: int, cp_size: int) -> int:
    """How many copies of each of a TP rank's key/value heads enter CP's all-to-all:
    cp / gcd(n_kv_local, cp), so that the n_kv_local * copies heads split evenly over CP and each
    CP rank receives exactly the key/value heads its query heads read (1 when cp divides them).
    repeat_interleave's backward sums the copies' gradients, as GQA's sharing already does."""
    return cp_size // math.gcd(n_kv_local, cp_size)


class AttentionCore:
    """softmax(q k^T / sqrt(d) + mask) v for one rank's heads; no parameters."""

    def __init__(self, config: GPTConfig, dropout_rng: Callable[[], ContextManager], enable_gqa: bool = False,
                 cp_group: Group = None):
        self.config = config
        self.cp_group = cp_group
        self.cp_size = group_size(cp_group)
        self.dropout = config.dropout
        self.dropout_rng = dropout_rng
        self.recompute = config.recompute_attention
        self.enable_gqa = enable_gqa

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, training: bool,
                 inputs: Optional[AttentionInputs] = None) -> torch.Tensor:
        """(B, heads, T, d) queries, (B, kv heads, T, d) keys and values -> (B, heads, T, d); with
        CP, T is this rank's T/cp tokens in and out. `inputs`: the stage's RoPE tables and mask for
        this micro-batch, of the whole sequence; None outside a Block (plain causal attention, its
        tables built here)."""
        q, k, v = self._to_heads(q, k, v)  # CP: (B, heads/cp, T, d), (B, kv copies/cp, T, d)
        return all_to_all_heads_to_sequence(self._attend(q, k, v, training, inputs), self.cp_group)

    def _to_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Ulysses' first all-to-alls: this rank's tokens of every head -> every token of its heads."""
        if self.cp_group is None:
            return q, k, v
        copies = kv_copies(k.size(1), self.cp_size)
        if copies > 1:  # (B, kv, T/cp, d) -> (B, kv * copies, T/cp, d)
            k, v = k.repeat_interleave(copies, dim=1), v.repeat_interleave(copies, dim=1)
        return tuple(all_to_all_sequence_to_heads(t, self.cp_group) for t in (q, k, v))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, training: bool,
                inputs: Optional[AttentionInputs]) -> torch.Tensor:
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
        if mask is not None:  # the document mask (model/transformer/documents.py)
            return document_attention(q, k, v, mask, dropout_p, enable_gqa=self.enable_gqa)
        return functional.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p,
                                                       enable_gqa=self.enable_gqa)
