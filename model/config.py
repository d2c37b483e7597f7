"""The model's definition, written once: `ModelConfig` is the recipe's `model:` section, what a
checkpoint records, what the planner sizes and what export and import translate; `GPTConfig`
adds what a built model also needs from the run (its init seed, selective recompute).

No torch here: the planner and the recipe loader read it without starting torch.
"""
from dataclasses import dataclass
from typing import Any, Optional

SHAPE_FIELDS = ("n_layer", "n_head", "n_embd", "seq_len", "vocab_size")
"""The fields a set of weights fixes (a checkpoint or a transformers model decides them)."""


def padded_vocab_size(vocab_size: int, tp_size: int, multiple: int = 1) -> int:
    """Smallest size >= vocab_size divisible by multiple * tp_size (Megatron's padding)."""
    step = multiple * tp_size
    return -(-vocab_size // step) * step


@dataclass(kw_only=True)
class ModelConfig:
    n_layer: int = 12
    """Transformer blocks; at least one per pipeline stage."""
    n_head: int = 12
    """Attention heads; divisible by tp."""
    n_embd: int = 768
    """Hidden size; divisible by n_head."""
    seq_len: int = 1024
    """Positions the model has (GPT-2's n_positions); every batch uses exactly this length."""
    vocab_size: Optional[int] = None
    """Real vocabulary; null in a recipe takes the tokenizer's size (never below it). Padded to
    `vocab_pad_multiple * tp` inside the model, stripped on export."""
    vocab_pad_multiple: int = 1
    """Pad the vocabulary to a multiple of this times tp (128 keeps GPU matmuls aligned)."""
    dropout: float = 0.0
    """Dropout on embeddings, attention probabilities and residual branches (0 for parity checks;
    most modern pretraining uses 0)."""
    init_std: float = 0.02
    """GPT-2 init N(0, init_std); residual output projections use init_std / sqrt(2 * n_layer)."""
    sequence_parallel: bool = False
    """Shard LayerNorm/dropout/residual activations along the sequence over TP (Korthikanti et
    al. 2022, sec. 4.2); the sequence length must divide by tp. Same losses; a no-op at tp=1."""

    def padded_vocab_size(self, tp_size: int) -> int:
        return padded_vocab_size(self.vocab_size, tp_size, self.vocab_pad_multiple)


@dataclass(kw_only=True)
class GPTConfig(ModelConfig):
    """A buildable model: the recipe's ModelConfig with its vocabulary resolved, plus the run's
    settings the layers read."""
    seed: int = 1234
    """Seed of the weight initialisation (the recipe's train.seed)."""
    recompute_attention: bool = False
    """Selective recompute: rerun the attention core in backward instead of storing it (K22 sec. 5)."""

    def __post_init__(self) -> None:
        if self.vocab_size is None:
            raise ValueError("GPTConfig needs a vocab_size (a recipe's null is resolved from the tokenizer first)")

    def sequence_parallel_group(self, tp_group: Any) -> Any:
        """The TP group when activations are sequence-sharded, else None (the collectives bypass)."""
        return tp_group if self.sequence_parallel else None
