"""The model's definition, written once: `ModelConfig` is the recipe's `model:` section, what a
checkpoint records, what the planner sizes and what export and import translate; `GPTConfig`
adds what a built model also needs from the run (its init seed, selective recompute).

The architecture is an `arch` preset plus individual switches (docs/architectures.md). A switch
left null takes the preset's value (`ARCH_PRESETS`, `ModelConfig.resolved`); a switch that is
set wins. `arch` also names the module layout: `gpt2` keeps GPT-2's fused c_attn / c_fc modules
(so its grouped-query attention and SwiGLU switches must stay at GPT-2's values), `llama` has
its own projections (q/k/v fused, o; gate/up fused, down) and accepts every value of every switch.

No torch here: the planner and the recipe loader read it without starting torch.
"""
import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Optional

SHAPE_FIELDS = ("n_layer", "n_head", "n_embd", "seq_len", "vocab_size")
"""The fields a set of weights fixes (a checkpoint or a transformers model decides them)."""

ARCHS = ("gpt2", "llama")
POSITIONS = ("learned", "rope")
NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu")
ARCH_SWITCHES = ("position", "rope_theta", "norm", "norm_eps", "mlp", "ffn_hidden_size", "n_kv_head",
                 "tie_embeddings", "bias")
"""The switches an `arch` preset fills when the recipe leaves them null."""
LLAMA3_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
"""The keys of `model.rope_scaling` (Llama 3's, transformers' rope_parameters of rope_type llama3)."""


def llama_ffn_hidden_size(n_embd: int, multiple_of: int = 256) -> int:
    """Meta's SwiGLU width: 2/3 of 4h (the same parameters as a 4h GELU MLP), rounded up to a
    multiple of 256 (Llama 1/2 `FeedForward`; Llama-2-7B: 4096 -> 11008)."""
    return multiple_of * -(-int(2 * 4 * n_embd / 3) // multiple_of)


def preset_values(arch: str, n_embd: int, n_head: int) -> Dict[str, Any]:
    """The switch values of preset `arch` for a model of this width."""
    if arch == "gpt2":  # Radford et al. 2019: what this repository trained before the switches
        return dict(position="learned", rope_theta=10000.0, norm="layernorm", norm_eps=1e-5, mlp="gelu",
                    ffn_hidden_size=4 * n_embd, n_kv_head=n_head, tie_embeddings=True, bias=True)
    if arch == "llama":  # Touvron et al. 2023: RoPE, RMSNorm, SwiGLU, untied head, no biases
        return dict(position="rope", rope_theta=10000.0, norm="rmsnorm", norm_eps=1e-5, mlp="swiglu",
                    ffn_hidden_size=llama_ffn_hidden_size(n_embd), n_kv_head=n_head, tie_embeddings=False,
                    bias=False)
    raise ValueError(f"model.arch={arch!r} is not one of {', '.join(ARCHS)}")


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
    max_positions: Optional[int] = None
    """RoPE: the positions the model is built for, written as transformers' max_position_embeddings
    on export (Llama 3.2: 131072, trained on shorter samples); null is seq_len. --init-from-hf
    needs at least the source's. Learned positions have exactly seq_len (wpe's rows): null."""
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
    arch: str = "gpt2"
    """gpt2 or llama: the module layout and the values of the switches below left null."""
    position: Optional[str] = None
    """learned (a wpe table of seq_len rows) or rope (rotary embeddings of q and k, no parameters)."""
    rope_theta: Optional[float] = None
    """RoPE base (10000 in Llama 1/2 and TinyLlama, 500000 in Llama 3)."""
    rope_scaling: Optional[Dict[str, float]] = None
    """Llama 3's RoPE frequency scaling (transformers' rope_type llama3, model/rotary.py): a mapping
    of factor, low_freq_factor, high_freq_factor and original_max_position_embeddings (Llama 3.1
    and 3.2: 8 or 32, 1, 4, 8192). null: unscaled, as in every preset."""
    norm: Optional[str] = None
    """layernorm (weight and bias) or rmsnorm (weight only)."""
    norm_eps: Optional[float] = None
    """Epsilon of every norm (1e-5 in both presets)."""
    mlp: Optional[str] = None
    """gelu (up, tanh-GELU, down) or swiglu (down(silu(gate) * up)); swiglu needs arch llama."""
    ffn_hidden_size: Optional[int] = None
    """Width of the MLP (gpt2: 4 * n_embd; llama: 2/3 of that rounded up to a multiple of 256)."""
    n_kv_head: Optional[int] = None
    """Key/value heads (grouped-query attention; 1 is multi-query); null is n_head. Must divide
    n_head; fewer than n_head needs arch llama."""
    tie_embeddings: Optional[bool] = None
    """The output head is the token embedding (gpt2) or a weight of its own (llama)."""
    bias: Optional[bool] = None
    """Biases in the attention and MLP linears (gpt2 yes, llama no). LayerNorm keeps its own."""

    def padded_vocab_size(self, tp_size: int) -> int:
        return padded_vocab_size(self.vocab_size, tp_size, self.vocab_pad_multiple)

    def resolved(self) -> "ModelConfig":
        """A copy with every switch left null set from the `arch` preset (the recipe's wins)."""
        preset = preset_values(self.arch, self.n_embd, self.n_head)
        filled = {key: preset[key] for key in ARCH_SWITCHES if getattr(self, key) is None}
        return dataclasses.replace(self, **filled)

    @property
    def position_range(self) -> int:
        """The positions the model is built for: max_positions, or seq_len when longer or null."""
        return max(self.seq_len, self.max_positions or 0)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def validate(self) -> None:
        """Raise ValueError naming the field, its value and the fix (launch/ reports it as bad input,
        exit 2; this module does not import launch/). How the heads and widths split over tp and
        the blocks over pp are the layout's rules (launch/config/layout.py)."""
        for key in ("n_layer", "n_head", "n_embd", "seq_len"):
            if getattr(self, key) < 1:
                raise ValueError(f"model.{key}={getattr(self, key)} must be >= 1")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"model.n_embd={self.n_embd} is not divisible by model.n_head={self.n_head}")
        if self.arch not in ARCHS:
            raise ValueError(f"model.arch={self.arch!r} is not one of {', '.join(ARCHS)}")
        full = self.resolved()  # the arch preset's switches filled in
        for key, allowed in (("position", POSITIONS), ("norm", NORMS), ("mlp", MLPS)):
            if getattr(full, key) not in allowed:
                raise ValueError(f"model.{key}={getattr(full, key)!r} is not one of {', '.join(allowed)}")
        if full.arch == "gpt2" and (full.mlp != "gelu" or full.n_kv_head != full.n_head):
            key, value = ("mlp", full.mlp) if full.mlp != "gelu" else ("n_kv_head", full.n_kv_head)
            raise ValueError(f"model.{key}={value!r} with model.arch=gpt2: GPT-2's fused c_attn and c_fc have "
                             f"n_kv_head = n_head and a GELU MLP; set model.arch=llama, which takes every switch")
        if full.norm_eps <= 0 or full.rope_theta <= 0:
            raise ValueError(f"model.norm_eps={full.norm_eps} and model.rope_theta={full.rope_theta} must be > 0")
        full._validate_rope_scaling()
        if full.position == "rope" and full.head_dim % 2:
            raise ValueError(f"model.position=rope needs an even head size, n_embd/n_head = "
                             f"{full.n_embd}/{full.n_head} = {full.head_dim}; choose n_embd and n_head with an even "
                             f"quotient")
        kv = full.n_kv_head
        if kv < 1 or full.n_head % kv:
            raise ValueError(f"model.n_kv_head={kv} must divide model.n_head={full.n_head} (each key/value head serves "
                             f"n_head/n_kv_head query heads; 1 is multi-query, null is n_head)")
        if self.max_positions is not None and (full.position != "rope" or self.max_positions < 1):
            raise ValueError(f"model.max_positions={self.max_positions} needs model.position=rope and a value >= 1 "
                             f"(learned positions have model.seq_len rows); drop it or set model.position=rope")
        if self.vocab_pad_multiple < 1:
            raise ValueError(f"model.vocab_pad_multiple={self.vocab_pad_multiple} must be >= 1")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"model.vocab_size={self.vocab_size} must be >= 1 (or null for the tokenizer's)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout={self.dropout} must be in [0, 1)")

    def _validate_rope_scaling(self) -> None:
        """rope_scaling: null, or Llama 3's four numbers with 0 < low_freq_factor < high_freq_factor."""
        scaling = self.rope_scaling
        if scaling is None:
            return
        keys = ", ".join(LLAMA3_SCALING_KEYS)
        if self.position != "rope":
            raise ValueError(f"model.rope_scaling is set with model.position={self.position!r}: it scales RoPE's "
                             f"frequencies; set model.position=rope or drop model.rope_scaling")
        if sorted(scaling) != sorted(LLAMA3_SCALING_KEYS):
            raise ValueError(f"model.rope_scaling has keys {', '.join(sorted(scaling)) or 'none'}; Llama 3's scaling "
                             f"takes exactly {keys} (e.g. 32, 1, 4, 8192 for Llama 3.2)")
        bad = [k for k in LLAMA3_SCALING_KEYS if isinstance(scaling[k], bool)
               or not isinstance(scaling[k], (int, float)) or scaling[k] <= 0]
        if bad or scaling["low_freq_factor"] >= scaling["high_freq_factor"]:
            raise ValueError(f"model.rope_scaling={scaling!r}: {keys} must be numbers > 0 with low_freq_factor < "
                             f"high_freq_factor")


@dataclass(kw_only=True)
class GPTConfig(ModelConfig):
    """A buildable model: the recipe's ModelConfig with its vocabulary resolved, plus the run's
    settings the layers read."""
    seed: int = 1234
    """Seed of the weight initialisation (the recipe's train.seed)."""
    recompute_attention: bool = False
    """Selective recompute: rerun the attention core in backward instead of storing it (K22 sec. 5)."""
    document_mask: bool = False
    """Attend only within documents, positions restarting at each (the recipe's data.document_mask;
    model/documents.py)."""
    eos_token_id: Optional[int] = None
    """The token that starts each document under `document_mask` (the tokenizer's EOS, data/tokens.py)."""

    def __post_init__(self) -> None:
        if self.vocab_size is None:
            raise ValueError("GPTConfig needs a vocab_size (a recipe's null is resolved from the tokenizer first)")
        if self.document_mask and self.eos_token_id is None:
            raise ValueError("GPTConfig with document_mask needs the eos_token_id that starts each document")
        # A built model never sees a null switch: fill them from the preset here, once.
        preset = preset_values(self.arch, self.n_embd, self.n_head)
        for key in ARCH_SWITCHES:
            if getattr(self, key) is None:
                setattr(self, key, preset[key])

    def sequence_parallel_group(self, tp_group: Any) -> Any:
        """The TP group when activations are sequence-sharded, else None (the collectives bypass)."""
        return tp_group if self.sequence_parallel else None
