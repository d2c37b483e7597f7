"""GPT-2 architecture (Radford et al. 2019) on tensor-parallel layers; no DeepSpeed here.

Learned positions, pre-LayerNorm blocks, GELU MLP of 4*n_embd, causal scaled-dot-product
attention with the heads split across TP, input embedding tied to the output head. Names
follow GPT-2 / nanoGPT (`wte`, `wpe`, `ln_f`, `c_attn`, `c_proj`, `c_fc`) so export is a
rename. Each module seeds its own full-size initialisation from (seed, module index), so the
weights do not depend on which stage or TP rank builds them.
"""
import contextlib
import math
from dataclasses import dataclass
from typing import Callable, ContextManager, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                          group_size, padded_vocab_size)
from model.mappings import Group

# Generator streams: blocks use their index; the embeddings use ids no block can have.
WTE_STREAM, WPE_STREAM = -1, -2


@dataclass
class GPTConfig:
    n_layer: int = 12
    """Transformer blocks."""
    n_head: int = 12
    """Attention heads; must divide by tp."""
    n_embd: int = 768
    """Hidden size; must divide by n_head."""
    seq_len: int = 1024
    """Positions the model has (GPT-2's n_positions); every batch uses exactly this length."""
    vocab_size: int = 50257
    """Real vocabulary; padded to `vocab_pad_multiple * tp` inside, stripped on export."""
    vocab_pad_multiple: int = 1
    """Pad the vocabulary to a multiple of this times tp (128 keeps GPU matmuls aligned)."""
    dropout: float = 0.0
    """Dropout on embeddings, attention probabilities and residual branches."""
    init_std: float = 0.02
    """GPT-2 init N(0, 0.02); residual output projections use init_std / sqrt(2 * n_layer)."""
    seed: int = 1234
    """Seed of the weight initialisation."""

    def padded_vocab_size(self, tp_size: int) -> int:
        return padded_vocab_size(self.vocab_size, tp_size, self.vocab_pad_multiple)


def init_generator(config: GPTConfig, stream: int) -> torch.Generator:
    """A generator private to one module, so its init is the same wherever it is built."""
    return torch.Generator().manual_seed(config.seed * 1_000_003 + stream + 10)


class CausalSelfAttention(nn.Module):
    """Heads split across TP: c_attn is column-parallel (whole heads per rank, stride 3 over
    [Q; K; V]), c_proj row-parallel; one all-reduce in forward, one in backward."""

    def __init__(self, config: GPTConfig, tp_group: Group, generator: torch.Generator,
                 dropout_rng: Callable[[], ContextManager]):
        super().__init__()
        h = config.n_embd
        self.n_head_local = config.n_head // group_size(tp_group)
        self.head_dim = h // config.n_head
        self.dropout = config.dropout
        self.dropout_rng = dropout_rng
        self.c_attn = ColumnParallelLinear(h, 3 * h, tp_group, generator, config.init_std, stride=3)
        self.c_proj = RowParallelLinear(h, h, tp_group, generator,
                                        config.init_std / math.sqrt(2 * config.n_layer))
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.c_attn(x).split(self.n_head_local * self.head_dim, dim=-1)
        q, k, v = (t.view(B, T, self.n_head_local, self.head_dim).transpose(1, 2)
                   for t in (q, k, v))  # (B, nh/p, T, hs)
        # Attention probabilities are TP-sharded: their dropout mask must differ per TP rank.
        with self.dropout_rng():
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(B, T, self.n_head_local * self.head_dim)  # (B, T, h/p)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """c_fc column-parallel (h -> 4h/p), GELU, c_proj row-parallel (4h/p -> h)."""

    def __init__(self, config: GPTConfig, tp_group: Group, generator: torch.Generator):
        super().__init__()
        h = config.n_embd
        self.c_fc = ColumnParallelLinear(h, 4 * h, tp_group, generator, config.init_std)
        self.c_proj = RowParallelLinear(4 * h, h, tp_group, generator,
                                        config.init_std / math.sqrt(2 * config.n_layer))
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # GPT-2's "gelu_new" is the tanh approximation.
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: GPTConfig, layer_index: int, tp_group: Group,
                 dropout_rng: Callable[[], ContextManager] = contextlib.nullcontext):
        super().__init__()
        generator = init_generator(config, layer_index)
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config, tp_group, generator, dropout_rng)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config, tp_group, generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, h) -> (B, T, h)
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TokenEmbedding(nn.Module):
    """wte: vocab-parallel token embedding; also the output head (tied weights)."""

    def __init__(self, config: GPTConfig, tp_group: Group):
        super().__init__()
        self.wte = VocabParallelEmbedding(config.vocab_size, config.padded_vocab_size(group_size(tp_group)),
                                          config.n_embd, tp_group, init_generator(config, WTE_STREAM),
                                          config.init_std)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, h)
        return self.wte(ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (B, T, h) -> (B, T, V_pad/p)
        return self.wte.logits(hidden)


class PositionEmbedding(nn.Module):
    """Adds wpe[0:T] (replicated) and applies embedding dropout; positions derived here, so
    only the hidden states cross pipeline stages (DESIGN.md contract 7)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        full = torch.empty(config.seq_len, config.n_embd)
        self.wpe = nn.Parameter(full.normal_(0.0, config.init_std,
                                             generator=init_generator(config, WPE_STREAM)))
        self.drop = nn.Dropout(config.dropout)

    def forward(self, tok_emb: torch.Tensor) -> torch.Tensor:  # (B, T, h) -> (B, T, h)
        return self.drop(tok_emb + self.wpe[: tok_emb.size(1)])


class GPT(nn.Module):
    """The whole model on one pipeline stage: the dense reference for tests and evaluation.

    Training uses the same modules split into stages by `model/pipe.py`.
    """

    def __init__(self, config: GPTConfig, tp_group: Optional[Group] = None):
        super().__init__()
        self.config = config
        self.tp_group = tp_group
        self.embed = TokenEmbedding(config, tp_group)
        self.pos = PositionEmbedding(config)
        self.blocks = nn.ModuleList(Block(config, i, tp_group) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, T) ids -> (B, T, V_pad/p) vocab-sharded logits."""
        x = self.pos(self.embed(ids))
        for block in self.blocks:
            x = block(x)
        return self.embed.logits(self.ln_f(x))
