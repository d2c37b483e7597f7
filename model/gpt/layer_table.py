"""The model's layers in order, one table (`pipeline_layers`) read by every user of layer
indices: the dense GPT (model/gpt/model.py) builds and runs its modules in this order, the pipeline
(model/gpt/pipe.py) makes one LayerSpec per entry, and stage names, checkpoint conversion, export
and the planner index it. No torch here: the planner reads it without starting torch.

GPT-2's table:
    0      embed   token ids (B, T) -> (B, T, h)
    1      wpe     adds wpe, dropout
    2..L+1 block   Block i                  pipeline stages are cut just before a block
    L+2    ln_f    LayerNorm
    L+3    head    the embedding again (tied): (B, T, h) -> (B, T, V_pad/tp) logits
With RoPE there is no wpe layer (the blocks rotate q and k); with untied embeddings the last
layer is `lm_head`, an LMHead with its own weight (Llama's table: embed, block 0..L-1, ln_f,
lm_head).
"""
from typing import List, Optional, Tuple

from model.config import ModelConfig

# kind -> (readable name, prefix of its parameters in the dense GPT of model/gpt/model.py). The tied
# head is the embedding's module again: the same parameters, saved once by DeepSpeed (layer 0).
LAYER_KINDS = {"embed": ("embed (tied)", "embed"), "wpe": ("wpe", "pos"), "block": ("block {i}", "blocks.{i}"),
               "ln_f": ("ln_f", "ln_f"), "head": ("lm_head (tied embed)", "embed"), "lm_head": ("lm_head", "lm_head")}


def pipeline_layers(model: ModelConfig) -> List[Tuple[str, Optional[int]]]:
    """The layers in order: (kind of LAYER_KINDS, block index for a block else None), of a
    resolved config (a GPTConfig, or `ModelConfig.resolved()`)."""
    learned, tied = model.position == "learned", model.tie_embeddings
    return ([("embed", None)] + [("wpe", None)] * learned + [("block", i) for i in range(model.n_layer)]
            + [("ln_f", None), ("head" if tied else "lm_head", None)])


def layer_name(kind: str, block: Optional[int], tied: bool = True) -> str:
    name = LAYER_KINDS[kind][0].format(i=block)
    return name if tied else name.replace(" (tied)", "")


def dense_prefix(kind: str, block: Optional[int]) -> str:
    return LAYER_KINDS[kind][1].format(i=block)
