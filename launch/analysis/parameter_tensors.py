"""Parameter tensors one rank of each pipeline stage holds: the pipeline engine's
costs per tensor (ZeRO's gradient hook on each, its reduction and copy back at the step;
launch/autotune/calibrate_engine.py) are charged by this count, not by bytes.

Counted from the model's own modules, built once per model on the meta device (no memory, no
process group): each layer of the layer table (model/gpt/layer_table.py) holds the dense GPT's
parameters under its prefix. TP and EP shard tensors without adding any, so the count is the
same at every tp and ep. The tied head is the embedding's module again on the embedding's stage,
and its own copy on another (DeepSpeed's TiedLayerSpec)."""
import dataclasses
import json
from typing import Dict, List, Sequence

from model.config import ModelConfig
from model.gpt.layer_table import dense_prefix, pipeline_layers

_COUNTS: Dict[str, Dict[str, int]] = {}  # model fields -> "dense" / "moe" block or a layer's prefix -> its tensors


def _tensors_by_piece(model: ModelConfig) -> Dict[str, int]:
    """"dense" and "moe" (one block of each kind the model has) and every other layer's parameter
    prefix (dense_prefix) -> how many parameter tensors it holds. One block of a kind stands for
    all (a 48-block, 128-expert model takes 8 s to build whole even on the meta device)."""
    key = json.dumps(dataclasses.asdict(model), sort_keys=True, default=str)
    if key not in _COUNTS:
        import torch

        from model.config import GPTConfig
        from model.gpt.model import GPT
        from model.transformer.block import Block
        config = GPTConfig(**dataclasses.asdict(model))
        with torch.device("meta"):
            names = [name for name, _ in GPT(dataclasses.replace(config, n_layer=0), None).named_parameters()]
            counts = {_kind(model, i): len(list(Block(config, i, None).parameters()))
                      for i in _one_block_of_each_kind(model)}
        for kind, i in pipeline_layers(model):
            if kind != "block":
                prefix = dense_prefix(kind, i)
                counts[prefix] = sum(name.startswith(prefix + ".") for name in names)
        _COUNTS[key] = counts
    return _COUNTS[key]


def _kind(model: ModelConfig, block: int) -> str:
    return "moe" if model.moe.enabled and model.moe.is_moe_block(block) else "dense"


def _one_block_of_each_kind(model: ModelConfig) -> List[int]:
    first: Dict[str, int] = {}
    for i in range(model.n_layer):
        first.setdefault(_kind(model, i), i)
    return list(first.values())


def parameter_tensors_per_stage(model: ModelConfig, parts: Sequence[int]) -> List[int]:
    """Parameter tensors of one rank of each stage of the cut `parts` (a resolved config)."""
    counts, layers = _tensors_by_piece(model), pipeline_layers(model)
    out = []
    for start, end in zip(parts[:-1], parts[1:]):
        held = layers[start:end]
        blocks = sum(counts[_kind(model, i)] for kind, i in held if kind == "block")
        out.append(blocks + sum(counts[prefix] for prefix in {dense_prefix(kind, i) for kind, i in held if kind != "block"}))
    return out
