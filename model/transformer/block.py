"""The transformer block (pre-norm: x + attn(ln_1(x)), then x + mlp(ln_2(x))) and GPT-2's attention
and MLP (Radford et al. 2019) on tensor-parallel layers; with `arch: llama` and the MoE archs the
block holds model/transformer/llama.py's attention and MLP or model/transformer/moe.py's experts.
No DeepSpeed here; the whole model is model/gpt/model.py.

GPT-2: pre-LayerNorm blocks, GELU MLP of 4*n_embd, causal scaled-dot-product attention with the
heads split across TP; names follow GPT-2 / nanoGPT (`c_attn`, `c_proj`, `c_fc`, `ln_1`, `ln_2`),
so export is a rename. Each module seeds its own full-size init from (seed, module index): the
weights do not depend on which stage or TP rank builds them. `sequence_parallel` and
`recompute_attention` change memory, never the maths (Korthikanti et al. 2022; docs/design.md,
"Activation memory")."""
import contextlib
import math
from typing import Callable, ContextManager, Optional, Tuple, Union

import torch
import torch.nn as nn
from torch.nn import functional

from model.config import GPTConfig
from model.parallel.compile_boundary import make_marked_methods_opaque
from model.parallel.layers import ColumnParallelLinear, RowParallelLinear, group_size
from model.parallel.mappings import Group
from model.transformer.attention import AttentionCore, check_context_heads
from model.transformer.attention_inputs import AttentionInputs, StageAttentionInputs
from model.transformer.llama import GroupedQueryAttention, LlamaMLP
from model.transformer.moe import MoEMLP
from model.transformer.moe_losses import MoEStatistics
from model.transformer.norms import LayerNorm, RMSNorm

# Generator streams: blocks use their index; the embeddings and the head use ids no block can have.
WTE_STREAM, WPE_STREAM, HEAD_STREAM = -1, -2, -3


def init_generator(config: GPTConfig, stream: int) -> torch.Generator:
    """A generator private to one module, so its init is the same wherever it is built."""
    return torch.Generator().manual_seed(config.seed * 1_000_003 + stream + 10)


def norm_class(config: GPTConfig) -> type:
    return LayerNorm if config.norm == "layernorm" else RMSNorm


def make_norm(config: GPTConfig, tp_group: Group) -> nn.Module:
    """The block's and the final norm: LayerNorm or RMSNorm, replicated, SP-aware."""
    return norm_class(config)(config.n_embd, config.sequence_parallel_group(tp_group), eps=config.norm_eps)


def sequence_dropout_rng(config: GPTConfig, tp_group: Group,
                         dropout_rng: Callable[[], ContextManager]) -> Callable[[], ContextManager]:
    """The RNG of dropout on residual-stream activations: shared by the TP ranks when they hold
    the same (B, T, h) tensor, the per-TP-rank stream when each holds its own sequence chunk
    (docs/design.md contract 10; Megatron forks the same tracker under SP)."""
    return dropout_rng if config.sequence_parallel_group(tp_group) is not None else contextlib.nullcontext


class CausalSelfAttention(nn.Module):
    """Heads split across TP: c_attn is column-parallel (whole heads per rank, stride 3 over
    [Q; K; V]), c_proj row-parallel; one all-reduce in forward, one in backward (with sequence
    parallelism an all-gather before c_attn and a reduce-scatter after c_proj instead). With
    `cp_group` the core exchanges sequence shards for head shards around attention (model/transformer/attention.py)."""

    def __init__(self, config: GPTConfig, tp_group: Group, generator: torch.Generator,
                 dropout_rng: Callable[[], ContextManager],
                 residual_dropout_rng: Callable[[], ContextManager], *, cp_group: Group = None):
        super().__init__()
        h = config.n_embd
        sp = config.sequence_parallel
        check_context_heads(config.n_head, group_size(tp_group), group_size(cp_group))
        self.n_head_local = config.n_head // group_size(tp_group)
        self.head_dim = h // config.n_head
        self.core = AttentionCore(config, dropout_rng, cp_group=cp_group)
        self.residual_dropout_rng = residual_dropout_rng
        self.c_attn = ColumnParallelLinear(h, 3 * h, tp_group, generator, config.init_std, stride=3,
                                           bias=config.bias, sequence_parallel=sp)
        self.c_proj = RowParallelLinear(h, h, tp_group, generator,
                                        config.init_std / math.sqrt(2 * config.n_layer), bias=config.bias,
                                        sequence_parallel=sp)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, inputs: Optional[AttentionInputs] = None) -> torch.Tensor:
        """(B, T, h), or (B, T/t, h) with SP (T: this CP rank's tokens); `inputs`: the stage's RoPE
        tables and mask for this micro-batch."""
        q, k, v = self.c_attn(x).split(self.n_head_local * self.head_dim, dim=-1)  # (B, T, h/p) each
        B, T, _ = q.shape
        q, k, v = (t.view(B, T, self.n_head_local, self.head_dim).transpose(1, 2)
                   for t in (q, k, v))  # (B, nh/p, T, hs)
        y = self.core(q, k, v, self.training, inputs)  # (B, nh/p, T, hs)
        y = y.transpose(1, 2).reshape(B, T, self.n_head_local * self.head_dim)  # (B, T, h/p)
        y = self.c_proj(y)  # (B, T, h), or (B, T/t, h) with SP
        with self.residual_dropout_rng():
            return self.resid_dropout(y)


class MLP(nn.Module):
    """c_fc column-parallel (h -> f/p), GELU, c_proj row-parallel (f/p -> h); f = 4h in GPT-2."""

    def __init__(self, config: GPTConfig, tp_group: Group, generator: torch.Generator,
                 residual_dropout_rng: Callable[[], ContextManager]):
        super().__init__()
        h = config.n_embd
        sp = config.sequence_parallel
        f = config.ffn_hidden_size
        self.c_fc = ColumnParallelLinear(h, f, tp_group, generator, config.init_std, bias=config.bias,
                                         sequence_parallel=sp)
        self.c_proj = RowParallelLinear(f, h, tp_group, generator,
                                        config.init_std / math.sqrt(2 * config.n_layer), bias=config.bias,
                                        sequence_parallel=sp)
        self.dropout = nn.Dropout(config.dropout)
        self.residual_dropout_rng = residual_dropout_rng

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # GPT-2's "gelu_new" is the tanh approximation.
        y = self.c_proj(functional.gelu(self.c_fc(x), approximate="tanh"))
        with self.residual_dropout_rng():
            return self.dropout(y)


def query_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype of the attention's queries: the hidden states', or autocast's (bench/step/throughput.py)."""
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype


Carried = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]
"""What flows between the layers: the hidden states, or with the document mask (hidden states,
(B, T) segment ids) until the last block (model/transformer/documents.py)."""


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x)). GPT-2's attention
    and MLP for arch gpt2, model/transformer/llama.py's for arch llama; ln_1 and ln_2 as `config.norm` says.

    `dropout_rng` enters the per-TP-rank dropout RNG (model/gpt/pipe.py); the dense reference
    leaves it a no-op. With the document mask a block takes (hidden, segment ids) and passes the
    segment ids on, except the last block, whose output is the hidden states alone (ln_f and
    the head are unchanged). `attention_inputs` (RoPE's tables, the document mask) is built once
    per micro-batch and shared by the blocks of one stage (model/transformer/attention_inputs.py).

    With `cp_group` (context parallelism) the input is this CP rank's contiguous shard of the
    sequence, (B, T/cp, h) (rank r: tokens [r T/cp, (r+1) T/cp)), and so are the segment ids
    (`document_ids` of its shard of the ids); everything but the attention core runs on these
    tokens, the core on the whole sequence of its heads (model/transformer/attention.py).

    In a mixture-of-experts model (`config.moe`) the MLP of every moe_every-th block is an MoEMLP
    (model/transformer/moe.py), its experts split over `ep_group`; the stage's blocks share `moe_statistics`."""

    def __init__(self, config: GPTConfig, layer_index: int, tp_group: Group,
                 dropout_rng: Callable[[], ContextManager] = contextlib.nullcontext,
                 attention_inputs: Optional[StageAttentionInputs] = None, *, cp_group: Group = None,
                 ep_group: Group = None, moe_statistics: Optional[MoEStatistics] = None):
        super().__init__()
        self.cp_group = cp_group
        self.attention_inputs = attention_inputs or StageAttentionInputs(config)
        self.document_mask = config.document_mask
        self.last = layer_index == config.n_layer - 1
        # The sequence attention sees is this many times a block's input: SP's TP chunks, CP's shards.
        self.sequence_chunks = group_size(config.sequence_parallel_group(tp_group)) * group_size(cp_group)
        generator = init_generator(config, layer_index)
        residual_rng = sequence_dropout_rng(config, tp_group, dropout_rng)
        llama = config.llama_layout
        self.ln_1 = make_norm(config, tp_group)
        attention = GroupedQueryAttention if llama else CausalSelfAttention
        self.attn = attention(config, tp_group, generator, dropout_rng, residual_rng, cp_group=cp_group)
        self.ln_2 = make_norm(config, tp_group)
        if config.moe.is_moe_block(layer_index):
            self.mlp = MoEMLP(config, layer_index, tp_group, generator, residual_rng, ep_group=ep_group,
                              cp_group=cp_group, statistics=moe_statistics)
        else:
            self.mlp = (LlamaMLP if llama else MLP)(config, tp_group, generator, residual_rng)

    def compile(self, *args, **kwargs) -> None:
        """`nn.Module.compile`, after the methods dynamo must not trace are made opaque
        (model/parallel/compile_boundary.py)."""
        make_marked_methods_opaque()
        super().compile(*args, **kwargs)

    def forward(self, x: Carried) -> Carried:  # (B, T, h) -> (B, T, h); (B, T/t, h) with SP; / cp with CP
        hidden, segments = x if self.document_mask else (x, None)
        inputs = self.attention_inputs(segments, hidden.size(1) * self.sequence_chunks, hidden.device,
                                       query_dtype(hidden), self.cp_group)
        hidden = hidden + self.attn(self.ln_1(hidden), inputs)
        hidden = hidden + self.mlp(self.ln_2(hidden))
        return hidden if self.last or not self.document_mask else (hidden, segments)
