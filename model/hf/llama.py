"""Name map between our dense model with `arch: llama` (tp=1, one stage) and transformers'
LlamaForCausalLM.

Both store nn.Linear (out, in) weights and the same RoPE layout (rotate_half, model/transformer/rotary.py),
so the map is a rename, no transpose and no permutation of q/k rows, except that our fused
projections are transformers' tensors stacked by rows: `attn.qkv_proj` is [q_proj; k_proj;
v_proj] and `mlp.gate_up_proj` is [gate_proj; up_proj] (`fused_parts`; each TP rank's shard
takes its rows of each part, model/hf/shards.py). The vocabulary padding rows are stripped. Used by
export, `--init-from-hf` and the tests.
"""
from typing import Dict, Iterator, List, Mapping, Optional, Tuple

import torch

from model.config import LLAMA3_SCALING_KEYS, GPTConfig
from model.transformer.llama import gate_up_sections, qkv_sections

# (our name inside blocks.{i}, transformers' inside model.layers.{i}): one parameter each.
LLAMA_BLOCK_NAMES = (("ln_1.weight", "input_layernorm.weight"), ("ln_2.weight", "post_attention_layernorm.weight"),
                     ("attn.o_proj", "self_attn.o_proj"), ("mlp.down_proj", "mlp.down_proj"))
# (our fused projection inside blocks.{i}, transformers' projections it stacks, in row order, its sections).
LLAMA_FUSED = (("attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), qkv_sections),
               ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"), gate_up_sections))


def llama_incompatibilities(config: GPTConfig) -> List[str]:
    """Switches LlamaForCausalLM cannot express, as `model.key=value` items (empty: exportable)."""
    wanted = dict(arch="llama", position="rope", norm="rmsnorm", mlp="swiglu", qk_norm=None)
    return [f"model.{key}={getattr(config, key)!r}" for key, value in wanted.items() if getattr(config, key) != value]


def rope_parameters(config: GPTConfig) -> Dict:
    """transformers' `rope_parameters` of our RoPE: its base, and Llama 3's scaling when set."""
    if config.rope_scaling is None:
        return {"rope_type": "default", "rope_theta": config.rope_theta}
    return {"rope_type": "llama3", "rope_theta": config.rope_theta, **config.rope_scaling}


def llama3_scaling(rope: Mapping) -> Optional[Dict[str, float]]:
    """Our model.rope_scaling of transformers' rope_parameters: Llama 3's four numbers, or None."""
    if rope.get("rope_type") != "llama3":
        return None
    return {key: float(rope[key]) if key != "original_max_position_embeddings" else int(rope[key])
            for key in LLAMA3_SCALING_KEYS}


def llama_config_kwargs(config: GPTConfig, rope_theta: Optional[float] = None) -> Dict:
    """Keyword arguments of `transformers.LlamaConfig` for the same architecture."""
    return dict(vocab_size=config.vocab_size, hidden_size=config.n_embd, intermediate_size=config.ffn_hidden_size,
                num_hidden_layers=config.n_layer, num_attention_heads=config.n_head,
                num_key_value_heads=config.n_kv_head, head_dim=config.head_dim, hidden_act="silu",
                max_position_embeddings=config.position_range, rms_norm_eps=config.norm_eps,
                rope_parameters=rope_parameters(config),
                tie_word_embeddings=config.tie_embeddings, attention_bias=config.bias, mlp_bias=config.bias,
                attention_dropout=config.dropout, initializer_range=config.init_std)


def _kinds(config: GPTConfig) -> Tuple[str, ...]:
    return ("weight", "bias") if config.bias else ("weight",)  # transformers' attention_bias and mlp_bias: ours


def _block_pairs(config: GPTConfig, i: int):
    """(our dense name, transformers' name) of every parameter of block i that is not fused."""
    for ours, theirs in LLAMA_BLOCK_NAMES:
        if ours.endswith(".weight"):
            yield f"blocks.{i}.{ours}", f"model.layers.{i}.{theirs}"
            continue
        for kind in _kinds(config):
            yield f"blocks.{i}.{ours}.{kind}", f"model.layers.{i}.{theirs}.{kind}"


def name_pairs(config: GPTConfig):
    """(our dense name, transformers' name) of every parameter that is a rename, in model order."""
    yield "embed.wte.weight", "model.embed_tokens.weight"
    for i in range(config.n_layer):
        yield from _block_pairs(config, i)
    yield "ln_f.weight", "model.norm.weight"
    if not config.tie_embeddings:
        yield "lm_head.weight", "lm_head.weight"


def fused_parts(config: GPTConfig) -> Iterator[Tuple[str, List[Tuple[str, int]]]]:
    """(our dense name, [(transformers' name, its rows), ...]) of every fused parameter: ours is
    those tensors stacked by rows in this order (qkv_proj: q, k, v; gate_up_proj: gate, up)."""
    for i in range(config.n_layer):
        for ours, theirs, sections in LLAMA_FUSED:
            for kind in _kinds(config):
                yield (f"blocks.{i}.{ours}.{kind}",
                       [(f"model.layers.{i}.{name}.{kind}", rows) for name, rows in zip(theirs, sections(config))])


def to_llama_state_dict(dense: Mapping[str, torch.Tensor], config: GPTConfig) -> Dict[str, torch.Tensor]:
    """Our dense state dict (real vocabulary, model/hf/convert.py names) -> LlamaForCausalLM's."""
    out = {theirs: dense[ours][: config.vocab_size] if ours in ("embed.wte.weight", "lm_head.weight") else dense[ours]
           for ours, theirs in name_pairs(config)}
    for ours, parts in fused_parts(config):
        out.update(zip([name for name, _ in parts], dense[ours].split([rows for _, rows in parts])))
    if config.tie_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def from_llama_state_dict(llama: Mapping[str, torch.Tensor], config: GPTConfig) -> Dict[str, torch.Tensor]:
    """Inverse of `to_llama_state_dict`: LlamaForCausalLM weights -> our dense state dict."""
    dense = {ours: llama[theirs].detach().contiguous().clone() for ours, theirs in name_pairs(config)}
    dense.update({ours: torch.cat([llama[name].detach() for name, _ in parts]) for ours, parts in fused_parts(config)})
    return dense
