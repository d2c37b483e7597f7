"""Full weights <-> tensor-parallel shards, by parameter name; and the name maps between our
pipeline layers, our dense GPT (`model/gpt/model.py`, tp=1, one stage) and GPT-2 (transformers).

Used by export (merge the shards of a checkpoint), by `--init-from-hf` and by evaluation at
any layout (split full weights for this rank). No DeepSpeed engine, no files, no CLI.

A dense state dict here is keyed by our dense GPT's names (`embed.wte.weight`, `pos.wpe`,
`blocks.3.attn.c_attn.weight`, `ln_f.bias`) and holds the *real* vocabulary only: padding rows
depend on tp and `vocab_pad_multiple`, so they are stripped on merge and re-added on split.

Expert weights of a mixture-of-experts block (model/transformer/moe.py: `blocks.3.mlp.experts.gate_up_proj`,
(E, 2f, h), and `...down_proj`, (E, h, f), dense) are split over EP along dim 0, whole experts per
rank (`split_experts`, `merge_experts`), and each expert over TP like the dense MLP's weights.
"""
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from model.config import ModelConfig
from model.gpt.layer_table import dense_prefix, pipeline_layers
from model.hf.gpt2 import gpt2_name_pairs
from model.parallel.layers import split_rows
from model.transformer.llama import gate_up_sections, qkv_sections
from model.transformer.moe import BALANCE_STATE

StateDict = Dict[str, torch.Tensor]


@dataclass(frozen=True)
class Rule:
    """How one parameter is laid out across the TP ranks (Megatron's partition_dim/_stride)."""
    dim: Optional[int]  # the split dimension; None: replicated on every TP rank
    stride: int = 1     # equal blocks split separately (3 for GPT-2's fused [Q; K; V])
    experts: bool = False  # dim 0 holds the experts, split over EP (E/ep whole experts per rank)
    projection_norm: bool = False  # a q/k norm weight: split like its projection under qk_norm=projection only
    vocab: bool = False  # rows >= vocab_size are padding: stripped on merge, zeros on split
    # Blocks of these rows, each split separately (Llama's fused [Q; K; V] and [G; U]): they
    # depend on the model's shape, so merge and split need its config.
    sections: Optional[Callable[[ModelConfig], Tuple[int, ...]]] = None

    def blocks(self, name: str, config: Optional[ModelConfig]) -> Optional[Sequence[int]]:
        """The rows of each separately split block of parameter `name`, or None (equal blocks: stride)."""
        if self.sections is None:
            return None
        if config is None:
            raise ValueError(f"{name} is fused from parts whose rows depend on the model's shape: pass its config")
        return self.sections(config)


REPLICATED = Rule(None)
# The one table: name suffix -> rule; it mirrors the `partition_dim` / `partition_stride`
# attributes that model/parallel/layers.py puts on each parameter (tests/checkpoints/test_export.py checks both agree).
# Anything not listed is replicated: LayerNorms, wpe, and the row-parallel biases (added after
# the all-reduce).
RULES: Dict[str, Rule] = {
    "wte.weight": Rule(0, vocab=True),     # VocabParallelEmbedding: vocab rows
    "attn.c_attn.weight": Rule(0, stride=3),  # ColumnParallelLinear over [Q; K; V]: whole heads
    "attn.c_attn.bias": Rule(0, stride=3),
    "mlp.c_fc.weight": Rule(0),            # ColumnParallelLinear: output rows
    "mlp.c_fc.bias": Rule(0),
    "attn.c_proj.weight": Rule(1),         # RowParallelLinear: input columns
    "mlp.c_proj.weight": Rule(1),
    # The Llama family (model/transformer/llama.py): the fused projections split each part's rows on its
    # own, K and V too (also when tp exceeds n_kv_head: each rank then holds part of a head).
    "lm_head.weight": Rule(0, vocab=True),  # LMHead, the untied output head: vocab rows
    **{f"attn.qkv_proj.{kind}": Rule(0, sections=qkv_sections) for kind in ("weight", "bias")},
    **{f"mlp.gate_up_proj.{kind}": Rule(0, sections=gate_up_sections) for kind in ("weight", "bias")},
    **{f"mlp.up_proj.{kind}": Rule(0) for kind in ("weight", "bias")},  # the GELU MLP's, unfused
    "attn.o_proj.weight": Rule(1),
    "mlp.down_proj.weight": Rule(1),
    # Mixture of experts (model/transformer/moe.py): each expert's [G; U] rows and down columns, as the dense MLP's
    # (the shared experts are a dense MLP: the two rules above; the router is replicated).
    "mlp.experts.gate_up_proj": Rule(1, experts=True, sections=lambda m: gate_up_sections(m, m.expert_ffn_hidden_size)),
    "mlp.experts.down_proj": Rule(2, experts=True),
    "mlp.shared_experts.gate_up_proj.weight": Rule(0, sections=lambda m: gate_up_sections(
        m, m.moe.shared_experts * m.expert_ffn_hidden_size)),
    "mlp.shared_experts.down_proj.weight": Rule(1),
    # q/k RMSNorm over the whole projection (OLMoE): split like the projection's rows; per head: replicated.
    **{f"attn.{norm}.weight": Rule(0, projection_norm=True) for norm in ("q_norm", "k_norm")},
}


def rule_for(name: str, config: Optional[ModelConfig] = None) -> Rule:
    """The rule of a dense, pipeline or layer-file parameter name (matched by suffix); `config`
    tells a q/k norm over the whole projection (split) from one per head (replicated)."""
    for suffix, rule in RULES.items():
        if name == suffix or name.endswith("." + suffix):
            if rule.projection_norm and (config is None or config.qk_norm != "projection"):
                return REPLICATED
            return rule
    return REPLICATED


def merge_rows(shards: List[torch.Tensor], stride: int = 1, sections: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Inverse of `split_rows` / `shard_rows`: shards in TP-rank order -> the full tensor.

    With stride s each shard is [b_1; ...; b_s] (e.g. [Q_r; K_r; V_r]); block i of the full
    tensor is the concatenation of every rank's b_i. With `sections` (the full blocks' rows)
    each shard holds 1/tp of each block."""
    if sections:
        per_rank = [s.split([n // len(shards) for n in sections], dim=0) for s in shards]
    else:
        per_rank = [s.chunk(stride, dim=0) for s in shards]
    blocks = len(per_rank[0])
    return torch.cat([torch.cat([parts[i] for parts in per_rank], dim=0) for i in range(blocks)], dim=0)


def merge(name: str, shards: List[torch.Tensor], vocab_size: int, config: Optional[ModelConfig] = None) -> torch.Tensor:
    """The full tensor of parameter `name` from its shards in TP-rank order, padding stripped;
    `config` (the model's shape) is needed by the fused Llama projections only."""
    rule = rule_for(name, config)
    if rule.dim is None:
        # Replicated parameters see identical inputs and all-reduced gradients on every TP
        # rank, so every shard holds the same values; rank 0's is the one DeepSpeed reloads too.
        return shards[0].clone()
    if rule.dim > 0:  # columns of a matrix, or an expert's rows or columns: split dim brought first
        moved = [s.movedim(rule.dim, 0) for s in shards]
        return merge_rows(moved, rule.stride, rule.blocks(name, config)).movedim(0, rule.dim).contiguous()
    full = merge_rows(shards, rule.stride, rule.blocks(name, config))
    return full[:vocab_size].clone() if rule.vocab else full


def split(name: str, full: torch.Tensor, tp_rank: int, tp_size: int, padded_vocab_size: int,
          config: Optional[ModelConfig] = None) -> torch.Tensor:
    """Rank `tp_rank`'s shard of the full tensor of parameter `name` at tensor-parallel size
    `tp_size`; a vocab-split tensor is first padded with zero rows to `padded_vocab_size`
    (the padding of this layout, `GPTConfig.padded_vocab_size(tp_size)`), as at init.
    `config` (the model's shape) is needed by the fused Llama projections only."""
    rule = rule_for(name, config)
    if rule.dim is None:
        return full.clone()
    if rule.vocab:
        full = torch.cat([full, full.new_zeros(padded_vocab_size - full.size(0), *full.shape[1:])])
    if rule.dim > 0:
        moved = split_rows(full.movedim(rule.dim, 0), tp_rank, tp_size, rule.stride, rule.blocks(name, config))
        return moved.movedim(0, rule.dim).contiguous()
    return split_rows(full, tp_rank, tp_size, rule.stride, rule.blocks(name, config))


def split_experts(name: str, full: torch.Tensor, ep_rank: int, ep_size: int) -> torch.Tensor:
    """EP rank `ep_rank`'s experts of parameter `name` (dim 0: experts [r E/ep, (r+1) E/ep)); any
    other parameter whole."""
    return full.chunk(ep_size, dim=0)[ep_rank].clone() if rule_for(name).experts else full


def merge_experts(name: str, per_ep_rank: List[torch.Tensor]) -> torch.Tensor:
    """Inverse of `split_experts`: the EP ranks' experts of `name`, in EP-rank order -> all E."""
    return torch.cat(per_ep_rank, dim=0) if rule_for(name).experts else per_ep_rank[0]


# ------------------------------------------------------------------ pipeline <-> dense names

def dense_name(pipe_name: str, layers: ModelConfig) -> str:
    """A PipelineModule parameter name ("tied_modules.embed.wte.weight", "1.wpe",
    "5.attn.c_attn.weight") or a layer-file key prefixed by its layer index ("0.wte.weight")
    -> the dense GPT name, through the layer table (model/gpt/layer_table.py) of the resolved config `layers`."""
    if pipe_name.startswith("tied_modules.embed."):
        return "embed." + pipe_name[len("tied_modules.embed."):]
    index_text, rest = pipe_name.split(".", 1)
    return f"{dense_prefix(*pipeline_layers(layers)[int(index_text)])}.{rest}"


def merge_layer_states(layer_states: Mapping[int, List[StateDict]], layers: ModelConfig, vocab_size: int) -> StateDict:
    """{pipeline layer index: [its state dict on TP rank 0, 1, ...]} -> the dense state dict."""
    dense: StateDict = {}
    for index, per_rank in sorted(layer_states.items()):
        for key in per_rank[0]:
            name = dense_name(f"{index}.{key}", layers)
            dense[name] = merge(name, [sd[key] for sd in per_rank], vocab_size, layers)
    return dense


@torch.no_grad()
def load_dense_into(module: nn.Module, dense: StateDict, layers: Optional[ModelConfig], tp_rank: int, tp_size: int,
                    padded_vocab_size: int, ep_rank: int = 0, ep_size: int = 1) -> None:
    """Copy this rank's shard of every parameter of `module` (a PipelineModule stage when
    `layers` is given, else a dense GPT, whose own config then gives the model's shape) from the
    dense state dict, in place; expert weights: EP rank `ep_rank`'s experts of `ep_size`, then their TP shard."""
    config = layers if layers is not None else module.config
    for name, param in module.named_parameters():
        key = dense_name(name, layers) if layers is not None else name
        if key not in dense:
            raise KeyError(f"no weights for {key} (parameter {name})")
        shard = split(key, split_experts(key, dense[key], ep_rank, ep_size), tp_rank, tp_size, padded_vocab_size, config)
        if shard.shape != param.shape:
            raise ValueError(f"{key}: the weights give a shard of {tuple(shard.shape)} on tp rank {tp_rank} "
                             f"of {tp_size}, the model has {tuple(param.shape)}")
        param.copy_(shard)
    for name, buffer in module.named_buffers():  # the routers' balancing state: replicated, fp32
        key = dense_name(name, layers) if layers is not None else name
        if name.rsplit(".", 1)[-1] in BALANCE_STATE and key in dense:  # absent in transformers' weights: a fresh start
            buffer.copy_(dense[key])


# ------------------------------------------------------------------ GPT-2 (transformers) -> dense

def from_gpt2_state_dict(gpt2: Mapping[str, torch.Tensor], n_layer: int) -> StateDict:
    """Inverse of `model.hf_gpt2.to_gpt2_state_dict`: GPT2LMHeadModel weights -> dense state
    dict (Conv1D (in, out) back to nn.Linear (out, in); lm_head is wte, tied)."""
    return {ours: (gpt2[theirs].t() if conv1d else gpt2[theirs]).detach().contiguous().clone()
            for ours, theirs, conv1d in gpt2_name_pairs(n_layer)}
