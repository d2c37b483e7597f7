"""A transformers GPT-2 or Llama checkpoint into megatron-core's GPTModel (local layer spec), one
pipeline stage and tensor-parallel rank at a time: the weights `--init-from-hf` gives ours.

megatron-core's layout, where it differs from transformers':
- attention's fused `linear_qkv` rows are grouped per key/value head: for each of the n_kv groups,
  its n_head / n_kv query heads, then its key head, then its value head; the TP split is by
  contiguous rows, so each rank holds whole groups;
- SwiGLU's fused `linear_fc1` holds, on each TP rank, that rank's gate rows then its up rows
  ([gate_r; up_r]), so the unsplit tensor is not [gate; up];
- transformers' GPT-2 Conv1D weights are (in, out): transposed to a Linear's (out, in);
- the decoder's layers are numbered per stage (`layer_number` is the global one, 1-based).
"""
from pathlib import Path
from typing import Dict

import torch
from safetensors.torch import load_file


def load_hf_checkpoint(hf_dir: Path) -> Dict[str, torch.Tensor]:
    files = sorted(Path(hf_dir).glob("*.safetensors"))
    weights = {}
    for f in files:
        weights.update(load_file(str(f)))
    return weights


def _grouped_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_kv: int) -> torch.Tensor:
    """(rows, ...) q, k, v in head order -> megatron's per-group [q heads; k; v] rows."""
    rest = q.shape[1:]
    return torch.cat([q.reshape(n_kv, -1, *rest), k.reshape(n_kv, -1, *rest), v.reshape(n_kv, -1, *rest)],
                     dim=1).reshape(-1, *rest)


def _layer_weights(hf: Dict[str, torch.Tensor], arch: str, i: int, n_head: int, n_kv: int) -> Dict[str, object]:
    """One block's unsplit megatron tensors (fc1 of SwiGLU as its (gate, up) pair)."""
    if arch == "gpt2":
        p = f"transformer.h.{i}."
        qkv_w = hf[p + "attn.c_attn.weight"].t()
        qkv_b = hf[p + "attn.c_attn.bias"]
        return {
            "input_layernorm.weight": hf[p + "ln_1.weight"], "input_layernorm.bias": hf[p + "ln_1.bias"],
            "self_attention.linear_qkv.weight": _grouped_qkv(*qkv_w.chunk(3), n_kv=n_head),
            "self_attention.linear_qkv.bias": _grouped_qkv(*qkv_b.chunk(3), n_kv=n_head),
            "self_attention.linear_proj.weight": hf[p + "attn.c_proj.weight"].t(),
            "self_attention.linear_proj.bias": hf[p + "attn.c_proj.bias"],
            "pre_mlp_layernorm.weight": hf[p + "ln_2.weight"], "pre_mlp_layernorm.bias": hf[p + "ln_2.bias"],
            "mlp.linear_fc1.weight": hf[p + "mlp.c_fc.weight"].t(), "mlp.linear_fc1.bias": hf[p + "mlp.c_fc.bias"],
            "mlp.linear_fc2.weight": hf[p + "mlp.c_proj.weight"].t(), "mlp.linear_fc2.bias": hf[p + "mlp.c_proj.bias"],
        }
    p = f"model.layers.{i}."
    return {
        "input_layernorm.weight": hf[p + "input_layernorm.weight"],
        "self_attention.linear_qkv.weight": _grouped_qkv(hf[p + "self_attn.q_proj.weight"],
                                                          hf[p + "self_attn.k_proj.weight"],
                                                          hf[p + "self_attn.v_proj.weight"], n_kv),
        "self_attention.linear_proj.weight": hf[p + "self_attn.o_proj.weight"],
        "pre_mlp_layernorm.weight": hf[p + "post_attention_layernorm.weight"],
        "mlp.linear_fc1.weight": (hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]),
        "mlp.linear_fc2.weight": hf[p + "mlp.down_proj.weight"],
    }


def _shard(param: torch.nn.Parameter, full, tp_rank: int, tp: int) -> torch.Tensor:
    """This rank's part of `full`, by the split megatron-core marks on the parameter."""
    if isinstance(full, tuple):  # SwiGLU fc1: [gate_r; up_r]
        return torch.cat([t.chunk(tp, dim=0)[tp_rank] for t in full])
    if getattr(param, "tensor_model_parallel", False):
        return full.chunk(tp, dim=param.partition_dim)[tp_rank]
    return full


def load_into(model: torch.nn.Module, hf: Dict[str, torch.Tensor], arch: str, n_head: int, n_kv: int,
              tp_rank: int, tp: int) -> None:
    """Copy every parameter of this stage's `model` from the transformers weights `hf`."""
    prefix = "transformer." if arch == "gpt2" else "model."
    embed = hf[prefix + ("wte.weight" if arch == "gpt2" else "embed_tokens.weight")]
    head = embed if arch == "gpt2" or "lm_head.weight" not in hf else hf["lm_head.weight"]
    full = {"embedding.word_embeddings.weight": embed, "output_layer.weight": head,
            "decoder.final_layernorm.weight": hf[prefix + ("ln_f.weight" if arch == "gpt2" else "norm.weight")]}
    if arch == "gpt2":
        full["embedding.position_embeddings.weight"] = hf["transformer.wpe.weight"]
        full["decoder.final_layernorm.bias"] = hf["transformer.ln_f.bias"]
    if hasattr(model, "decoder"):
        for local, layer in enumerate(model.decoder.layers):
            for name, tensor in _layer_weights(hf, arch, layer.layer_number - 1, n_head, n_kv).items():
                full[f"decoder.layers.{local}.{name}"] = tensor
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name not in full:
                raise KeyError(f"no transformers weight for megatron-core's {name}")
            value = _shard(param, full[name], tp_rank, tp)
            if value.shape != param.shape:
                raise ValueError(f"{name}: megatron-core's shard {tuple(param.shape)}, ours {tuple(value.shape)}")
            param.copy_(value)
