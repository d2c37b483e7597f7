"""A checkpoint as a transformers model directory (GPT2LMHeadModel for arch gpt2,
LlamaForCausalLM for arch llama, MixtralForCausalLM, Qwen3MoeForCausalLM or OlmoeForCausalLM for a
mixture of experts, model/hf/moe.py): read DeepSpeed's per-layer weight files (one per pipeline
layer and TP rank) one layer at a time, merge its TP shards with model/hf/convert.py, strip the vocab
padding, and write it into safetensors shards (with their index when there are several); then
config (the tokenizer's real BOS and EOS ids), generation config and tokenizer.
One process, no DeepSpeed engine, no torch.distributed; only model weights, never optimizer state;
at most one layer and one shard in memory, never the whole model."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Tuple

from launch.errors import ConfigError

if TYPE_CHECKING:  # annotations only: no import cost at run time
    import torch

    from model.config import GPTConfig

DEFAULT_SHARD_BYTES = 2 << 30  # the largest safetensors file the export writes (a whole model below it)


def checkpoint_gpt_config(recipe: Dict[str, Any]):
    """The GPTConfig of a checkpoint, from the resolved recipe saved in its complete.json."""
    from model.config import GPTConfig
    return GPTConfig(**recipe["model"], seed=recipe["train"]["seed"])


def _checkpoint_layers(load: Path):
    """(CheckpointRef, GPTConfig, {saved pipeline layer: [its file on TP rank 0, 1, ...]}) of `--load`."""
    from launch.checkpoints.locate import find_checkpoint
    from model.gpt.layer_table import pipeline_layers

    from launch.checkpoints.expert_files import LAYER_FILE  # torch: imported once a checkpoint is read
    ref = find_checkpoint(load)  # a complete checkpoint whose files have their recorded sizes
    config = checkpoint_gpt_config(ref.meta["recipe"])
    tp = ref.meta["layout"]["tp"]
    found: Dict[Tuple[int, int], Path] = {}
    for path in ref.path.iterdir():
        match = LAYER_FILE.fullmatch(path.name)
        if match:
            found[int(match.group(1)), int(match.group(2))] = path
    # The tied head is a function of the embedding's module, which DeepSpeed saves once (layer 0);
    # an untied one (lm_head) has its own layer file.
    saved_layers = [index for index, (kind, _) in enumerate(pipeline_layers(config)) if kind != "head"]
    wanted = [(layer, rank) for layer in saved_layers for rank in range(tp)]
    missing = [f"layer_{layer:02d}-model_{rank:02d}" for layer, rank in wanted if (layer, rank) not in found]
    if missing:
        raise ConfigError(f"checkpoint {ref.path} lacks the weight files {', '.join(missing[:4])}"
                          f"{' ...' if len(missing) > 4 else ''} of its tp={tp} n_layer={config.n_layer} model")
    return ref, config, {layer: [found[layer, rank] for rank in range(tp)] for layer in saved_layers}


def _read_layer(files: List[Path]):
    """One pipeline layer's state dict on each TP rank, every expert of an MoE layer included
    (launch/checkpoints/expert_files.py: read_layer_files, the one reader of a checkpoint's layers). DeepSpeed
    writes each layer file with torch.save(module.state_dict()): a plain dict of tensors, so the
    safe unpickler (weights_only) reads it and no code in the file runs."""
    from launch.checkpoints.expert_files import read_layer_files
    return read_layer_files(files)


def read_checkpoint_weights(load: Path):
    """(CheckpointRef, GPTConfig, dense state dict with the real vocabulary) of `--load`: the
    whole model in this process (evaluation and tests; the export goes layer by layer)."""
    from model.hf.convert import merge_layer_states
    ref, config, layers = _checkpoint_layers(load)
    layer_states = {layer: _read_layer(files) for layer, files in layers.items()}
    return ref, config, merge_layer_states(layer_states, config, config.vocab_size)


def hf_tensors(layers: Dict[int, List[Path]], config: GPTConfig) -> Iterator[Tuple[str, "torch.Tensor"]]:
    """(transformers name, full tensor) of every weight, one pipeline layer read at a time:
    TP shards merged, vocab padding stripped, GPT-2's linears transposed to Conv1D (in, out),
    fused tensors cut into their parts, experts into one tensor per expert and projection."""
    from model.hf.convert import merge_layer_states
    from model.hf.shards import hf_sources
    from model.hf.source import stored_tensors
    from model.transformer.moe import BALANCE_STATE
    sources = hf_sources(config)
    for layer, files in sorted(layers.items()):
        for name, full in merge_layer_states({layer: _read_layer(files)}, config, config.vocab_size).items():
            if name.rsplit(".", 1)[-1] not in BALANCE_STATE:  # training state, no part of the exported model
                yield from stored_tensors(sources[name], full)


def dense_gpt(config: GPTConfig, dense):
    """Our dense GPT (tp_group None, one stage) holding the given weights."""
    from model.hf.convert import load_dense_into
    from model.gpt.model import GPT
    model = GPT(config)
    load_dense_into(model, dense, None, 0, 1, config.padded_vocab_size(1))
    return model.eval()


def load_export_tokenizer(name: str, vocab_size: int, flag: str):
    """The tokenizer to ship with the model, or a ConfigError naming the fix."""
    from data.builtin import load_tokenizer
    from data.spec import DataError
    try:
        tokenizer = load_tokenizer(name, flag)
    except DataError as e:  # already one line (files that ask for custom code)
        raise ConfigError(str(e)) from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{flag}={name!r} could not be loaded ({type(e).__name__}) and an export without "
                          f"a tokenizer cannot generate text; pass --tokenizer with a local tokenizer "
                          f"directory or 'builtin'") from None
    if len(tokenizer) > vocab_size:
        raise ConfigError(f"{flag}={name!r} has {len(tokenizer)} tokens, more than the model's vocabulary "
                          f"{vocab_size}; pass the tokenizer the model was trained with (--tokenizer)")
    return tokenizer


def check_out_dir(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} is a file, not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConfigError(f"--out {str(out)!r} is not empty; choose a new directory or pass --overwrite")


def check_exportable(config: GPTConfig) -> None:
    """A ConfigError naming the switches the target transformers class cannot express."""
    from model.hf.gpt2 import gpt2_incompatibilities
    from model.hf.llama import llama_incompatibilities
    if config.moe.enabled:  # the family of its arch (arch llama: of its q/k norm), model/hf/moe.py
        from model.hf.moe import family_of, moe_incompatibilities
        problems, target = moe_incompatibilities(config), family_of(config).model_class
        if problems:
            raise ConfigError(f"{target} cannot express the checkpoint's model: {', '.join(problems)}; only "
                              f"models it can express export")
        return
    if config.arch == "llama":
        problems, target = llama_incompatibilities(config), "LlamaForCausalLM (RoPE, RMSNorm, SwiGLU)"
    else:
        problems = gpt2_incompatibilities(config)
        target = "GPT2LMHeadModel (learned positions, LayerNorm, 4h GELU MLP, tied head, biases)"
    if problems:
        raise ConfigError(f"the checkpoint's model has {', '.join(problems)}, which {target} cannot express; "
                          f"only checkpoints of that architecture export")


def hf_config(config: GPTConfig, tokenizer):
    """The transformers config of our architecture (GPT-2, Llama or a mixture-of-experts family)
    with the tokenizer's real BOS and EOS ids (GPT2Config's default 50256 would lie outside a
    smaller vocabulary)."""
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    if config.moe.enabled:
        from model.hf.moe import hf_config as moe_hf_config
        return moe_hf_config(config, **ids)
    if config.arch == "llama":
        from transformers import LlamaConfig

        from model.hf.llama import llama_config_kwargs
        return LlamaConfig(**llama_config_kwargs(config), **ids)
    from transformers import GPT2Config

    from model.hf.gpt2 import gpt2_config_kwargs
    return GPT2Config(**gpt2_config_kwargs(config), **ids)


def export(load: Path, out: Path, tokenizer_name: Optional[str] = None, overwrite: bool = False,
           max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write the transformers directory of checkpoint `load` to `out`; return `out`. The weights
    go layer by layer into safetensors shards of at most `max_shard_bytes` (one
    model.safetensors when they fit, else shards and their index): no process holds the model."""
    from transformers import GenerationConfig

    from launch.checkpoints.hf_safetensors import write_safetensors
    check_out_dir(out, overwrite)
    ref, config, layers = _checkpoint_layers(load)
    check_exportable(config)
    flag = "--tokenizer" if tokenizer_name else "the checkpoint's data.tokenizer"
    tokenizer = load_export_tokenizer(tokenizer_name or ref.meta["recipe"]["data"]["tokenizer"],
                                      config.vocab_size, flag)
    out.mkdir(parents=True, exist_ok=True)
    dtype = write_safetensors(out, hf_tensors(layers, config), max_shard_bytes)
    hf = hf_config(config, tokenizer)
    hf.dtype = dtype
    hf.save_pretrained(out)
    generation = GenerationConfig.from_model_config(hf)
    generation.update(pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                      else tokenizer.eos_token_id)
    generation.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
