"""Name and config maps between our mixture-of-experts models (the Llama layout with `model.moe`;
model/transformer/moe.py) and transformers' MixtralForCausalLM, Qwen3MoeForCausalLM and OlmoeForCausalLM.

The family is the model's `arch` (mixtral, qwen3_moe, olmoe); an `arch: llama` model with experts
is exported as the family whose q/k norm it has (none: Mixtral, per head: Qwen3-MoE, over the whole
projection: OLMoE), when that family can express the rest. Attention and norms map as for Llama
(model/hf/llama.py: q/k/v stacked by rows in `qkv_proj`), plus q_norm and k_norm; the router is
the family's `gate`. Our expert weights are transformers' in-memory layout already:
`experts.gate_up_proj` (E, 2f, h), each expert's rows [gate; up], and `experts.down_proj` (E, h, f).
On disk (save_pretrained, the hub) transformers stores one tensor per expert and projection
(Mixtral: `block_sparse_moe.experts.{e}.w1` gate, `w3` up, `w2` down; Qwen3-MoE and OLMoE:
`mlp.experts.{e}.gate_proj`, `up_proj`, `down_proj`) and fuses them when it loads; the export
writes that format and the import reads either (`moe_sources(config, fused_experts)`).

Routing: every family picks the k largest softmax probabilities; Mixtral always renormalises them
(our softmax_topk with norm_topk_prob, or topk_softmax: the same weights up to rounding);
Qwen3-MoE and OLMoE renormalise when `norm_topk_prob`. Qwen3-MoE's dense blocks
(`decoder_sparse_step`) are our `moe_every`. Nothing here has shared experts (DeepSeek-MoE's),
so a model with them is refused, as is any other switch the family cannot express
(`moe_incompatibilities`).
"""
import dataclasses
from typing import Any, Dict, List, Mapping, Optional, Tuple

from model.config import GPTConfig
from model.hf.source import Source, dense_tensor, stored_tensors
from model.moe_config import MoEConfig


@dataclasses.dataclass(frozen=True)
class Family:
    arch: str  # our arch preset
    model_type: str  # transformers' config.json model_type
    model_class: str  # transformers' class names
    config_class: str
    qk_norm: Optional[str]  # the q/k norm it has (model/transformer/llama.py)
    moe_prefix: str  # the MoE block's module on disk, inside model.layers.{i}
    expert_names: Tuple[str, str, str]  # gate, up, down of one expert on disk
    renormalises: Optional[bool] = None  # the top-k weights always (True), or as norm_topk_prob says (None)
    dense_blocks: bool = False  # has dense-MLP blocks between the MoE ones (decoder_sparse_step)
    head_size: bool = True  # head_dim may differ from hidden_size / num_attention_heads
    attention_bias: bool = True


FAMILIES = {
    "mixtral": Family("mixtral", "mixtral", "MixtralForCausalLM", "MixtralConfig", None, "block_sparse_moe",
                      ("w1", "w3", "w2"), renormalises=True, attention_bias=False),
    "qwen3_moe": Family("qwen3_moe", "qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", "head", "mlp",
                        ("gate_proj", "up_proj", "down_proj"), dense_blocks=True),
    "olmoe": Family("olmoe", "olmoe", "OlmoeForCausalLM", "OlmoeConfig", "projection", "mlp",
                    ("gate_proj", "up_proj", "down_proj"), head_size=False),
}
MODEL_TYPES = {family.model_type: family for family in FAMILIES.values()}
BY_QK_NORM = {family.qk_norm: family for family in FAMILIES.values()}


def family_of(config: GPTConfig) -> Family:
    """The transformers family of a mixture-of-experts model: its arch's, or for `arch: llama` the
    one whose q/k norm it has."""
    return FAMILIES[config.arch] if config.arch in FAMILIES else BY_QK_NORM[config.qk_norm]


def renormalised(moe: MoEConfig) -> bool:
    """Whether our router's k weights sum to 1 (topk_softmax always; softmax_topk with norm_topk_prob)."""
    return moe.router == "topk_softmax" or bool(moe.norm_topk_prob)


def has_dense_blocks(config: GPTConfig) -> bool:
    """Whether some block keeps the dense MLP (moe_every > 1: Qwen3-MoE's decoder_sparse_step)."""
    return any(not config.moe.is_moe_block(i) for i in range(config.n_layer))


def moe_incompatibilities(config: GPTConfig) -> List[str]:
    """What the model's transformers family cannot express, as `model.key=value (why)` items
    (empty: exportable)."""
    family, moe = family_of(config), config.moe
    problems = [f"model.{key}={getattr(config, key)!r} (it has {want})"
                for key, want in (("position", "rope"), ("norm", "rmsnorm"), ("mlp", "swiglu"))
                if getattr(config, key) != want]
    if config.qk_norm != family.qk_norm:
        problems.append(f"model.qk_norm={config.qk_norm!r} (its q/k norm is {family.qk_norm!r})")
    if moe.balance == "bias":
        problems.append("model.moe.balance='bias' (its router has no per-expert bias)")
    if moe.shared_experts:
        problems.append(f"model.moe.shared_experts={moe.shared_experts} (it has no shared experts)")
    if family.renormalises and not renormalised(moe):
        problems.append(f"model.moe.norm_topk_prob={moe.norm_topk_prob!r} (it renormalises the top-k router "
                        f"weights)")
    if moe.moe_every != 1 and not family.dense_blocks:
        problems.append(f"model.moe.moe_every={moe.moe_every} (it has experts in every block)")
    if config.bias and (not family.attention_bias or has_dense_blocks(config)):
        which = "MLP biases" if family.attention_bias else "biases"
        problems.append(f"model.bias=True (it has no {which})")
    if not family.head_size and config.head_dim * config.n_head != config.n_embd:
        problems.append(f"model.head_size={config.head_size} (its head size is hidden_size / "
                        f"num_attention_heads)")
    return problems


def moe_config_kwargs(config: GPTConfig) -> Dict[str, Any]:
    """Keyword arguments of the family's transformers config for the same model."""
    from model.hf.llama import rope_parameters
    family, moe = family_of(config), config.moe
    kwargs = dict(vocab_size=config.vocab_size, hidden_size=config.n_embd, num_hidden_layers=config.n_layer,
                  num_attention_heads=config.n_head, num_key_value_heads=config.n_kv_head, hidden_act="silu",
                  max_position_embeddings=config.position_range, rms_norm_eps=config.norm_eps,
                  rope_parameters=rope_parameters(config), tie_word_embeddings=config.tie_embeddings,
                  attention_dropout=config.dropout, initializer_range=config.init_std,
                  num_experts_per_tok=moe.experts_per_token, router_aux_loss_coef=moe.aux_loss_coef,
                  output_router_logits=False)
    if family.arch == "mixtral":
        return dict(kwargs, num_local_experts=moe.num_experts, intermediate_size=config.expert_ffn_hidden_size,
                    head_dim=config.head_dim, sliding_window=None, router_jitter_noise=0.0)
    kwargs.update(num_experts=moe.num_experts, norm_topk_prob=renormalised(moe), attention_bias=config.bias)
    if family.arch == "qwen3_moe":
        return dict(kwargs, moe_intermediate_size=config.expert_ffn_hidden_size,
                    intermediate_size=config.ffn_hidden_size, head_dim=config.head_dim,
                    decoder_sparse_step=moe.moe_every, mlp_only_layers=[], use_sliding_window=False)
    return dict(kwargs, intermediate_size=config.expert_ffn_hidden_size, clip_qkv=None)


def hf_config(config: GPTConfig, **ids):
    """The family's transformers config object (ids: bos_token_id, eos_token_id, ...), naming its
    model class (`architectures`, which vLLM and others read)."""
    import transformers
    family = family_of(config)
    return getattr(transformers, family.config_class)(**moe_config_kwargs(config), **ids,
                                                      architectures=[family.model_class])


def hf_model_class(config: GPTConfig):
    import transformers
    return getattr(transformers, family_of(config).model_class)


# ------------------------------------------------------------------ names

def moe_sources(config: GPTConfig, fused_experts: bool = False) -> Dict[str, Source]:
    """Our dense name -> the transformers tensors it is made of (model/hf/shards.py: Source), in
    model order. `fused_experts`: transformers' in-memory names (`mlp.gate`, one (E, ., .) tensor
    per expert weight); else its on-disk format, one tensor per expert and projection."""
    from model.transformer.llama import qkv_sections
    family, moe = family_of(config), config.moe
    kinds = ("weight", "bias") if config.bias else ("weight",)
    f, E = config.expert_ffn_hidden_size, moe.num_experts
    gate, up, down = family.expert_names
    sources: Dict[str, Source] = {"embed.wte.weight": Source(("model.embed_tokens.weight",))}
    for i in range(config.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        sources[ours + "ln_1.weight"] = Source((theirs + "input_layernorm.weight",))
        for kind in kinds:
            sources[f"{ours}attn.qkv_proj.{kind}"] = Source(
                tuple(f"{theirs}self_attn.{p}_proj.{kind}" for p in "qkv"), rows=qkv_sections(config))
            sources[f"{ours}attn.o_proj.{kind}"] = Source((f"{theirs}self_attn.o_proj.{kind}",))
        if config.qk_norm is not None:
            for norm in ("q_norm", "k_norm"):
                sources[f"{ours}attn.{norm}.weight"] = Source((f"{theirs}self_attn.{norm}.weight",))
        sources[ours + "ln_2.weight"] = Source((theirs + "post_attention_layernorm.weight",))
        if not moe.is_moe_block(i):  # Qwen3-MoE's dense blocks (decoder_sparse_step)
            sources[ours + "mlp.gate_up_proj.weight"] = Source(
                (theirs + "mlp.gate_proj.weight", theirs + "mlp.up_proj.weight"), rows=(config.ffn_hidden_size,) * 2)
            sources[ours + "mlp.down_proj.weight"] = Source((theirs + "mlp.down_proj.weight",))
            continue
        if fused_experts:
            sources[ours + "mlp.router.weight"] = Source((theirs + "mlp.gate.weight",))
            sources[ours + "mlp.experts.gate_up_proj"] = Source((theirs + "mlp.experts.gate_up_proj",))
            sources[ours + "mlp.experts.down_proj"] = Source((theirs + "mlp.experts.down_proj",))
            continue
        block = f"{theirs}{family.moe_prefix}."
        sources[ours + "mlp.router.weight"] = Source((block + "gate.weight",))
        sources[ours + "mlp.experts.gate_up_proj"] = Source(
            tuple(f"{block}experts.{e}.{p}.weight" for e in range(E) for p in (gate, up)), rows=(f, f), experts=E)
        sources[ours + "mlp.experts.down_proj"] = Source(
            tuple(f"{block}experts.{e}.{down}.weight" for e in range(E)), experts=E)
    sources["ln_f.weight"] = Source(("model.norm.weight",))
    if not config.tie_embeddings:
        sources["lm_head.weight"] = Source(("lm_head.weight",))
    return sources


def to_moe_state_dict(dense: Mapping[str, Any], config: GPTConfig, fused_experts: bool = False) -> Dict[str, Any]:
    """Our dense state dict (model/hf/convert.py names, all experts) -> the family's tensors: its
    on-disk names, or with `fused_experts` the names of its module's state_dict (which
    `load_state_dict` takes). The vocabulary padding rows are stripped."""
    out = {}
    for ours, source in moe_sources(config, fused_experts).items():
        full = dense[ours][: config.vocab_size] if ours in ("embed.wte.weight", "lm_head.weight") else dense[ours]
        out.update(stored_tensors(source, full.detach()))
    if config.tie_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return {k: v.contiguous().clone() for k, v in out.items()}


def from_moe_state_dict(hf: Mapping[str, Any], config: GPTConfig) -> Dict[str, Any]:
    """Inverse of `to_moe_state_dict`, from either format (a module's state_dict or the files')."""
    fused = any(name.endswith(".mlp.experts.gate_up_proj") for name in hf)
    return {ours: dense_tensor(source, lambda name: hf[name].detach())
            for ours, source in moe_sources(config, fused).items()}


# ------------------------------------------------------------------ import: config.json -> model fields

class MoEFields(dict):
    """The `model.moe` fields a transformers config fixes, as a mapping (a recipe's `--set` items);
    equal to a MoEConfig with these values (launch/evaluation/evaluation.py compares the recipe's
    `model.moe` with the weights')."""

    def __eq__(self, other):
        if isinstance(other, MoEConfig):
            return all(getattr(other, key) == value for key, value in self.items())
        return dict.__eq__(self, other)

    def __ne__(self, other):
        return not self == other

    __hash__ = None


def moe_model_fields(hf) -> Dict[str, Any]:
    """The recipe's `model:` fields a Mixtral, Qwen3-MoE or OLMoE config fixes (the weights'
    shapes and what they compute); training-only settings (the aux loss weight) stay the recipe's."""
    from model.hf.llama import llama3_scaling
    family = MODEL_TYPES[hf.model_type]
    rope = hf.rope_parameters or {}
    heads, hidden = hf.num_attention_heads, hf.hidden_size
    head_dim = (getattr(hf, "head_dim", None) or hidden // heads) if family.head_size else hidden // heads
    width = hf.moe_intermediate_size if family.arch == "qwen3_moe" else hf.intermediate_size
    renormalise = True if family.renormalises else bool(hf.norm_topk_prob)
    moe = MoEFields(num_experts=hf.num_local_experts if family.arch == "mixtral" else hf.num_experts,
                    experts_per_token=hf.num_experts_per_tok, expert_ffn_hidden_size=width, shared_experts=0,
                    moe_every=getattr(hf, "decoder_sparse_step", 1) or 1, router="softmax_topk",
                    norm_topk_prob=renormalise)
    return dict(arch=family.arch, max_positions=hf.max_position_embeddings, n_layer=hf.num_hidden_layers,
                n_head=heads, n_embd=hidden, head_size=head_dim if head_dim * heads != hidden else None,
                n_kv_head=hf.num_key_value_heads, ffn_hidden_size=hf.intermediate_size, vocab_size=hf.vocab_size,
                rope_theta=float(rope.get("rope_theta", 10000.0)), rope_scaling=llama3_scaling(rope),
                norm_eps=hf.rms_norm_eps, tie_embeddings=hf.tie_word_embeddings,
                bias=bool(getattr(hf, "attention_bias", False)), qk_norm=family.qk_norm, moe=moe)


def moe_import_problems(hf, config: GPTConfig) -> List[str]:
    """`key=value (...; fix)` items for each way a Mixtral, Qwen3-MoE or OLMoE config differs from
    the run's model (empty: its weights load into it and compute the same function)."""
    family = MODEL_TYPES[hf.model_type]
    if not config.moe.enabled:
        return [f"model_type={hf.model_type!r} where this run's model has no experts; set model.arch={family.arch} "
                f"and model.moe"]
    if family_of(config) is not family:
        return [f"model_type={hf.model_type!r} where this run's model has model.arch={config.arch!r}; set "
                f"model.arch={family.arch}"]
    fields = moe_model_fields(hf)
    built, moe = fields.pop("max_positions"), fields.pop("moe")
    del fields["arch"]
    head_dim = fields.pop("head_size") or config.n_embd // config.n_head
    if not has_dense_blocks(config):
        del fields["ffn_hidden_size"]  # the dense MLP's width: no block has one (else moe_every differs)
    problems = []
    if head_dim != config.head_dim:
        problems.append(f"head_dim={head_dim} where this run's model has a head size of {config.head_dim}; set "
                        f"model.head_size={head_dim}")
    problems += [f"{key}={value!r} where this run's model has model.{key}={getattr(config, key)!r}; set "
                 f"model.{key}={value!r}" for key, value in fields.items() if getattr(config, key) != value]
    del moe["router"]  # compared as what it computes: renormalised top-k weights or not
    have = dict(dataclasses.asdict(config.moe), expert_ffn_hidden_size=config.expert_ffn_hidden_size,
                norm_topk_prob=renormalised(config.moe))
    problems += [f"{key}={value!r} where this run's model has model.moe.{key}={have[key]!r}; set "
                 f"model.moe.{key}={value!r}" for key, value in moe.items() if have[key] != value]
    if built > config.position_range:  # else the export would shrink the range the weights are built for
        problems.append(f"max_position_embeddings={built} where this run's model is built for "
                        f"{config.position_range} positions; set model.max_positions={built}")
    for key, want in (("position", "rope"), ("norm", "rmsnorm"), ("mlp", "swiglu")):
        if getattr(config, key) != want:
            problems.append(f"a {family.model_class} model where this run's model has model.{key}="
                            f"{getattr(config, key)!r}; set model.{key}={want}")
    rope_type = (hf.rope_parameters or {}).get("rope_type", "default")
    extras = [("hidden_act", hf.hidden_act, "silu", "our experts use SiLU"),
              ("rope_type", "default" if rope_type == "llama3" else rope_type, "default",
               "RoPE scalings other than Llama 3's are not implemented"),
              ("sliding_window", getattr(hf, "sliding_window", None), None, "our attention is not windowed"),
              ("mlp_only_layers", list(getattr(hf, "mlp_only_layers", None) or []), [],
               "our dense blocks are those between each moe_every-th"),
              ("clip_qkv", getattr(hf, "clip_qkv", None), None, "our attention does not clip q, k and v")]
    problems += [f"{key}={have!r} ({why})" for key, have, want, why in extras if have != want]
    return problems
