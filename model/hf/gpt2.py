"""Name and layout map between our dense GPT (tp=1, one stage) and transformers' GPT2LMHeadModel.

GPT-2 stores its linear weights as Conv1D (in, out); ours are nn.Linear-style (out, in).
The vocabulary padding rows are stripped. Used by the export and by the architecture test.
"""
from typing import Dict, Iterator, List, Tuple

import torch

from model.config import GPTConfig
from model.config import preset_values
from model.gpt.model import GPT

GPT2_LINEARS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def gpt2_incompatibilities(config: GPTConfig) -> List[str]:
    """Switches GPT2LMHeadModel cannot express, as `model.key=value` items (empty: exportable)."""
    gpt2 = preset_values("gpt2", config.n_embd, config.n_head)
    keys = ("arch", "position", "norm", "norm_eps", "mlp", "ffn_hidden_size", "n_kv_head", "tie_embeddings", "bias")
    return [f"model.{key}={getattr(config, key)!r}" for key in keys
            if getattr(config, key) != (gpt2[key] if key != "arch" else "gpt2")]


def gpt2_config_kwargs(config: GPTConfig) -> Dict:
    """Keyword arguments of `transformers.GPT2Config` for the same architecture."""
    return dict(vocab_size=config.vocab_size, n_positions=config.seq_len, n_embd=config.n_embd,
                n_layer=config.n_layer, n_head=config.n_head, activation_function="gelu_new",
                resid_pdrop=config.dropout, embd_pdrop=config.dropout, attn_pdrop=config.dropout,
                layer_norm_epsilon=1e-5, initializer_range=config.init_std, tie_word_embeddings=True)


def gpt2_name_pairs(n_layer: int) -> Iterator[Tuple[str, str, bool]]:
    """(our dense name, GPT2LMHeadModel's name, stored as Conv1D (in, out)) of every stored
    parameter, in model order (the tied lm_head is wte: transformers does not store it)."""
    yield "embed.wte.weight", "transformer.wte.weight", False
    yield "pos.wpe", "transformer.wpe.weight", False
    for i in range(n_layer):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        for name in ("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias"):
            yield ours + name, theirs + name, False
        for name in GPT2_LINEARS:
            yield f"{ours}{name}.weight", f"{theirs}{name}.weight", True
            yield f"{ours}{name}.bias", f"{theirs}{name}.bias", False
    yield "ln_f.weight", "transformer.ln_f.weight", False
    yield "ln_f.bias", "transformer.ln_f.bias", False


def to_gpt2_state_dict(model: GPT) -> Dict[str, torch.Tensor]:
    """Our dense model's weights under GPT2LMHeadModel's names and layouts."""
    assert model.tp_group is None, "merge TP shards first: this maps the dense (tp=1) model"
    ours = model.state_dict()
    ours["embed.wte.weight"] = ours["embed.wte.weight"][: model.config.vocab_size]  # padding rows stripped
    out = {theirs: ours[name].t() if conv1d else ours[name]  # (out, in) -> Conv1D (in, out)
           for name, theirs, conv1d in gpt2_name_pairs(model.config.n_layer)}
    out["lm_head.weight"] = out["transformer.wte.weight"]
    return {k: v.detach().contiguous().clone() for k, v in out.items()}
