"""`--init-from-hf DIR_OR_NAME`: start from GPT-2-, Llama-, Mixtral-, Qwen3-MoE- or OLMoE-format
(transformers) weights at any layout.

Two halves, because bad input must fail before any process group or engine starts:
`check_hf_source` reads only config.json (and the safetensors headers' names) and compares it
with the recipe's model; `init_from_hf` runs after `build_pipeline` and overwrites each local
parameter with this rank's shard of the weights (split by `model/hf/convert.py`'s rules), so the
first step trains exactly those weights whatever (tp, pp, dp, ep) is. Each rank reads only the
slices it holds, lazily from safetensors (launch/checkpoints/hf_safetensors.py): of a mixture of
experts, only its EP rank's experts. Nothing from
the source executes code: the model class is fixed by the config's model_type (never
trust_remote_code) and weights are safetensors.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Tuple

from launch.errors import ConfigError
from model.config import GPTConfig

if TYPE_CHECKING:  # annotations only: no import cost at run time
    from deepspeed.pipe import PipelineModule
    from model.parallel.state import ParallelState

# (GPT2Config attribute, the values our model computes the same function with, the fix):
# every field that changes what the weights compute; dropout does not, and the recipe sets it.
_REQUIREMENTS: List[Tuple[str, Callable[[GPTConfig], Tuple[Any, ...]], str]] = [
    ("n_layer", lambda c: (c.n_layer,), "set model.n_layer to the source's"),
    ("n_head", lambda c: (c.n_head,), "set model.n_head to the source's"),
    ("n_embd", lambda c: (c.n_embd,), "set model.n_embd to the source's"),
    # wpe has model.seq_len rows, all of them imported; train shorter samples with data.seq_len.
    ("n_positions", lambda c: (c.seq_len,), "set model.seq_len to the source's n_positions"),
    ("vocab_size", lambda c: (c.vocab_size,),
     "set model.vocab_size to the source's (at least the tokenizer's size)"),
    ("n_inner", lambda c: (None, 4 * c.n_embd), "our MLP is 4*n_embd wide"),
    ("activation_function", lambda c: ("gelu_new", "gelu_pytorch_tanh"), "our MLP uses tanh-GELU"),
    ("layer_norm_epsilon", lambda c: (1e-5,), "our LayerNorms use eps 1e-5"),
    ("scale_attn_by_inverse_layer_idx", lambda c: (False,), "our attention scales by 1/sqrt(head_dim) only"),
    ("tie_word_embeddings", lambda c: (True,), "our output head is wte"),
]


# The sizes and counts of the families' config.json (GPT-2's names, then Llama's and the mixtures
# of experts'): transformers checks their type, not their sign, and 0 heads divides by zero
# (LlamaConfig.validate_architecture's hidden_size % num_attention_heads). Those a config may leave
# null transformers derives (num_key_value_heads: num_attention_heads).
_SIZES = ("n_layer", "n_head", "n_embd", "n_positions", "n_inner", "vocab_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "hidden_size", "intermediate_size", "head_dim",
          "max_position_embeddings", "num_local_experts", "num_experts", "num_experts_per_tok",
          "moe_intermediate_size", "decoder_sparse_step")
_NULLABLE_SIZES = ("n_inner", "num_key_value_heads", "head_dim")


def read_hf_config(source: str):
    """The GPT2Config, LlamaConfig, MixtralConfig, Qwen3MoeConfig or OlmoeConfig of a model
    directory or hub id (config.json only, no weights)."""
    import transformers

    from model.hf.moe import MODEL_TYPES
    raw = _config_dict(source)
    model_type = raw.get("model_type")
    if model_type not in ("gpt2", "llama", *MODEL_TYPES):  # a tuple: a list's model_type is unhashable
        known = ", ".join(repr(t) for t in ("gpt2", "llama", *MODEL_TYPES))
        raise ConfigError(f"--init-from-hf {source!r} is a {model_type!r} model, not GPT-2, Llama, "
                          f"Mixtral, Qwen3-MoE or OLMoE (model_type {known}); only those formats can be imported")
    _check_sizes(source, raw)
    # GPT2Config.from_pretrained would read any model type's config.json (with a warning).
    classes = {"gpt2": "GPT2Config", "llama": "LlamaConfig",
               **{family: MODEL_TYPES[family].config_class for family in MODEL_TYPES}}
    hf = _from_dict(source, getattr(transformers, classes[model_type]), raw)
    _check_rope(source, getattr(hf, "rope_parameters", None) or {})
    return hf


def _config_dict(source: str) -> Dict[str, Any]:
    """config.json of `source` as a dict; a local one's shape checked before transformers indexes it."""
    from transformers import GPT2Config

    from data.hub import hub_errors_only
    from launch.checkpoints.hf_safetensors import read_hf_json
    local = source if os.path.isfile(source) else os.path.join(source, "config.json")  # as transformers reads
    if os.path.exists(local):
        read_hf_json(source, Path(local))
    try:
        with hub_errors_only():
            raw, _ = GPT2Config.get_config_dict(source)
    except (OSError, ValueError, TypeError, RecursionError) as e:  # TypeError: a hub copy's null
        raw, why = {}, f" ({type(e).__name__})"
    else:
        why = ""  # transformers 5 returns {} for a local directory without config.json
    if not raw or not isinstance(raw, dict):
        raise ConfigError(f"--init-from-hf {source!r}: no readable config.json{why}; pass a transformers "
                          f"model directory (or a hub id that is cached)")
    return raw


def _check_sizes(source: str, raw: Dict[str, Any]) -> None:
    for key in _SIZES:
        value = raw.get(key)
        if key not in raw or (value is None and key in _NULLABLE_SIZES):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"--init-from-hf {source!r}: config.json has {key}={repr(value)[:60]}, not a positive "
                              f"integer; the file is damaged: download the whole model directory again")


def _from_dict(source: str, config_class, raw: Dict[str, Any]):
    """`config_class.from_dict(raw)`; the errors of its validation (of the fields' types, strictly:
    huggingface_hub's StrictDataclassFieldValidationError; of RoPE's parameters) as a ConfigError."""
    from huggingface_hub.errors import StrictDataclassError

    from data.json_files import one_line
    try:
        return config_class.from_dict(raw)
    except (StrictDataclassError, TypeError, ValueError, KeyError, AttributeError, ArithmeticError) as e:
        raise ConfigError(f"--init-from-hf {source!r}: config.json is not a valid {config_class.__name__} "
                          f"({type(e).__name__}: {one_line(e)}); download the whole model directory again") from None


def _check_rope(source: str, rope: Dict[str, Any]) -> None:
    """RoPE's numbers, which transformers checks by key, not by type (hf_model_fields' float() of
    rope_theta "x" would raise ValueError)."""
    from model.config import LLAMA3_SCALING_KEYS
    for key in ("rope_theta", *LLAMA3_SCALING_KEYS):
        value = rope.get(key)
        if key in rope and (isinstance(value, bool) or not isinstance(value, (int, float))
                            or not 0 < value < float("inf")):
            raise ConfigError(f"--init-from-hf {source!r}: config.json has rope_parameters {key}="
                              f"{repr(value)[:60]}, not a positive number; the file is damaged: download the whole "
                              f"model directory again")


def hf_model_fields(hf) -> Dict[str, Any]:
    """The recipe's `model:` fields that a transformers config fixes (its weights' shape and
    the switches that change what they compute)."""
    from model.hf.llama import llama3_scaling
    from model.hf.moe import MODEL_TYPES, moe_model_fields
    if hf.model_type == "gpt2":
        return dict(n_layer=hf.n_layer, n_head=hf.n_head, n_embd=hf.n_embd, seq_len=hf.n_positions,
                    vocab_size=hf.vocab_size)
    if hf.model_type in MODEL_TYPES:  # the mixture-of-experts families: `moe` a mapping of model.moe's fields
        return moe_model_fields(hf)
    rope = hf.rope_parameters or {}
    return dict(arch="llama", max_positions=hf.max_position_embeddings, n_layer=hf.num_hidden_layers,
                n_head=hf.num_attention_heads, n_embd=hf.hidden_size,
                n_kv_head=hf.num_key_value_heads, ffn_hidden_size=hf.intermediate_size, vocab_size=hf.vocab_size,
                rope_theta=float(rope.get("rope_theta", 10000.0)), rope_scaling=llama3_scaling(rope),
                norm_eps=hf.rms_norm_eps,
                tie_embeddings=hf.tie_word_embeddings, bias=hf.attention_bias)


def _llama_problems(hf, config: GPTConfig) -> List[str]:
    """`key=value (needs X: fix)` items for each way a Llama config differs from the run's model."""
    fields = hf_model_fields(hf)
    built = fields.pop("max_positions")
    problems = [f"{key}={value!r} where this run's model has model.{key}={getattr(config, key)!r}; set "
                f"model.{key}={value!r}" for key, value in fields.items() if getattr(config, key) != value]
    if built > config.position_range:  # else the export would shrink the range the weights are built for
        problems.append(f"max_position_embeddings={built} where this run's model is built for "
                        f"{config.position_range} positions; set model.max_positions={built}")
    for key, have, want in (("position", config.position, "rope"), ("norm", config.norm, "rmsnorm"),
                            ("mlp", config.mlp, "swiglu"), ("qk_norm", config.qk_norm, None),
                            ("moe.num_experts", config.moe.num_experts, 0)):
        if have != want:
            problems.append(f"a Llama model where this run's model has model.{key}={have!r}; set model.{key}="
                            f"{'null' if want is None else want}")
    rope_type = (hf.rope_parameters or {}).get("rope_type", "default")
    rope_type = "default" if rope_type == "llama3" else rope_type  # Llama 3's: compared as model.rope_scaling
    extras = [("hidden_act", hf.hidden_act, "silu", "our SwiGLU uses SiLU"),
              ("mlp_bias", hf.mlp_bias, hf.attention_bias, "our model.bias sets attention and MLP biases together"),
              ("head_dim", getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
               hf.hidden_size // hf.num_attention_heads, "our head size is hidden_size / num_attention_heads"),
              ("rope_type", rope_type, "default", "RoPE scalings other than Llama 3's are not implemented")]
    problems += [f"{key}={have!r} ({why})" for key, have, want, why in extras if have != want]
    return problems


def check_hf_source(source: str, config: GPTConfig, resuming: bool) -> None:
    """Raise ConfigError unless `source` holds safetensors weights of exactly the recipe's model."""
    if resuming:
        raise ConfigError("--init-from-hf starts a new run from weights, --load resumes one: pass only one")
    _check_config(source, read_hf_config(source), config)
    from launch.checkpoints.hf_safetensors import check_hf_tensors
    check_hf_tensors(source, config)  # a ConfigError when there are none (pytorch_model.bin only)


def _check_config(source: str, hf, config: GPTConfig) -> None:
    from model.hf.moe import MODEL_TYPES, moe_import_problems
    if hf.model_type in ("llama", *MODEL_TYPES):
        problems = _llama_problems(hf, config) if hf.model_type == "llama" else moe_import_problems(hf, config)
        if problems:
            raise ConfigError(f"--init-from-hf {source!r} has {problems[0]}")
        return
    from model.hf.gpt2 import gpt2_incompatibilities
    problems = gpt2_incompatibilities(config)
    if problems:
        raise ConfigError(f"--init-from-hf {source!r} is a GPT-2 model, this run's model has {problems[0]}; "
                          f"drop that setting (GPT-2 weights need the gpt2 preset's switches)")
    for attr, accepted, fix in _REQUIREMENTS:
        have = getattr(hf, attr, None)
        if have not in accepted(config):
            raise ConfigError(f"--init-from-hf {source!r} has {attr}={have!r}, this run's model needs "
                              f"{accepted(config)[0]!r}: {fix}")


def hf_dense_state_dict(source: str, config: GPTConfig):
    """GPT-2, Llama or mixture-of-experts weights of `source` as a dense state dict of our model
    (model/hf/convert.py names, all experts): the whole model through transformers, for tests and
    small models; training reads lazily (`init_from_hf`)."""
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    from data.hub import hub_errors_only
    from model.hf.convert import from_gpt2_state_dict
    from model.hf.llama import from_llama_state_dict
    from model.hf.moe import from_moe_state_dict, hf_model_class
    with hub_errors_only():
        if config.moe.enabled:
            hf = hf_model_class(config).from_pretrained(source, weights_only=True, dtype="float32")
            return from_moe_state_dict(hf.state_dict(), config)
        if config.arch == "llama":
            hf = LlamaForCausalLM.from_pretrained(source, weights_only=True, dtype="float32")
            return from_llama_state_dict(hf.state_dict(), config)
        hf = GPT2LMHeadModel.from_pretrained(source, weights_only=True)
    return from_gpt2_state_dict(hf.state_dict(), config.n_layer)


def init_from_hf(pipe: PipelineModule, source: str, config: GPTConfig, state: ParallelState) -> None:
    """Overwrite the local stage's parameters of `pipe` with this rank's shards of `source`.

    Call before `deepspeed.initialize`, so the optimizer (and ZeRO's fp32 master copy) start
    from these weights. Each rank reads only its stage's tensors and its TP slices of them (of a
    mixture of experts, its EP rank's experts only)."""
    from launch.checkpoints.hf_safetensors import load_hf_shards_into
    load_hf_shards_into(pipe, source, config, True, state.tp_rank, state.tp_size, ep_rank=state.ep_rank,
                        ep_size=state.ep_size)
