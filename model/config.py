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
import math
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from model.moe_config import MoEConfig, moe_from, moe_preset

SHAPE_FIELDS = ("n_layer", "n_head", "n_embd", "seq_len", "vocab_size")
"""The fields a set of weights fixes (a checkpoint or a transformers model decides them)."""

ARCHS = ("gpt2", "llama", "mixtral", "qwen3_moe", "olmoe")
MOE_ARCHS = ("mixtral", "qwen3_moe", "olmoe")
"""The mixture-of-experts families: the Llama layout with their own switch values (model.moe)."""
POSITIONS = ("learned", "rope")
NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu")
QK_NORMS = ("head", "projection")
ARCH_SWITCHES = ("position", "rope_theta", "norm", "norm_eps", "mlp", "ffn_hidden_size", "n_kv_head",
                 "tie_embeddings", "bias", "qk_norm")
"""The switches an `arch` preset fills when the recipe leaves them null."""
LLAMA3_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
"""The keys of `model.rope_scaling` (Llama 3's, transformers' rope_parameters of rope_type llama3)."""

# Bounds far above any published model, so that a typo (a size of 10**18) is one line at start-up
# instead of a table of that many layers built for minutes or a float overflow in the formulas.
MAX_LAYERS = 4096
"""The deepest published language models have about 100-130 blocks (GPT-3 96, PaLM 540B 118,
Llama 3.1 405B 126); DeepNet's research models 1,000 (Wang et al. 2022)."""
MAX_HEADS = 4096
"""Llama 3.1 405B and MT-NLG 530B have 128 attention heads."""
MAX_WIDTH = 2 ** 20
"""Any width: n_embd (MT-NLG 530B: 20480), head_size, the MLP's (PaLM 540B: 73728), an expert's."""
MAX_POSITIONS = 2 ** 24
"""seq_len, max_positions and original_max_position_embeddings (Llama 4 Scout: 10,485,760 positions)."""
MAX_VOCAB = 2 ** 24
"""vocab_size and vocab_pad_multiple (Gemma 3's vocabulary: 262,144 tokens)."""
INT_RANGES = {"n_layer": MAX_LAYERS, "n_head": MAX_HEADS, "n_kv_head": MAX_HEADS, "n_embd": MAX_WIDTH,
              "head_size": MAX_WIDTH, "ffn_hidden_size": MAX_WIDTH, "seq_len": MAX_POSITIONS,
              "max_positions": MAX_POSITIONS, "vocab_size": MAX_VOCAB, "vocab_pad_multiple": MAX_VOCAB}
"""The integer fields, each from 1 to its bound (null, where allowed, is not checked here)."""


def llama_ffn_hidden_size(n_embd: int, multiple_of: int = 256) -> int:
    """Meta's SwiGLU width: 2/3 of 4h (the same parameters as a 4h GELU MLP), rounded up to a
    multiple of 256 (Llama 1/2 `FeedForward`; Llama-2-7B: 4096 -> 11008)."""
    return multiple_of * -(-int(2 * 4 * n_embd / 3) // multiple_of)


def preset_values(arch: str, n_embd: int, n_head: int) -> Dict[str, Any]:
    """The switch values of preset `arch` for a model of this width: ARCH_SWITCHES and the
    router's MOE_SWITCHES (model/moe_config.py)."""
    routing = dict(router="softmax_topk", norm_topk_prob=True)
    if arch == "gpt2":  # Radford et al. 2019: what this repository trained before the switches
        return dict(position="learned", rope_theta=10000.0, norm="layernorm", norm_eps=1e-5, mlp="gelu",
                    ffn_hidden_size=4 * n_embd, n_kv_head=n_head, tie_embeddings=True, bias=True, qk_norm=None,
                    **routing)
    if arch not in ARCHS:
        raise ValueError(f"model.arch={arch!r} is not one of {', '.join(ARCHS)}")
    # Touvron et al. 2023: RoPE, RMSNorm, SwiGLU, untied head, no biases; the MoE families on top.
    llama = dict(position="rope", rope_theta=10000.0, norm="rmsnorm", norm_eps=1e-5, mlp="swiglu",
                 ffn_hidden_size=llama_ffn_hidden_size(n_embd), n_kv_head=n_head, tie_embeddings=False,
                 bias=False, qk_norm=None, **routing)
    if arch == "mixtral":  # Jiang et al. 2024: top-2 of 8, softmax over the chosen two
        return dict(llama, rope_theta=1e6)
    if arch == "qwen3_moe":  # Qwen3 technical report 2025: per-head q/k RMSNorm, renormalised top-k
        return dict(llama, rope_theta=1e6, norm_eps=1e-6, qk_norm="head")
    if arch == "olmoe":  # Muennighoff et al. 2024: q/k RMSNorm over the whole projection, top-k unnormalised
        return dict(llama, qk_norm="projection", norm_topk_prob=False)
    return llama


def shown(value: Any) -> str:
    """A value for a one-line message: an integer past 40 digits as its size (Python refuses to write
    out one past 4,300 digits), anything else as repr."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10 ** 40:
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    return repr(value)


def finite_number(value: Any) -> bool:
    """A number (not a bool) that is a finite float: not NaN (no comparison holds), an infinity or an
    integer past float's range (math.isfinite raises OverflowError on one)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) <= sys.float_info.max


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
    """Hidden size; divisible by n_head unless head_size is set."""
    head_size: Optional[int] = None
    """Width of each attention head (transformers' head_dim, Megatron's kv_channels); null is
    n_embd / n_head. Qwen3-30B-A3B: 128 at n_embd 2048 with 32 heads. Needs a Llama-layout arch."""
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
    """Llama 3's RoPE frequency scaling (transformers' rope_type llama3, model/transformer/rotary.py): a mapping
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
    qk_norm: Optional[str] = None
    """RMSNorm of the queries and keys before RoPE: head (one weight of head size shared by the heads,
    Qwen3), projection (over the whole q and k projections, OLMoE), or null (none; gpt2, llama,
    mixtral)."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture of experts (model/moe_config.py): routed and shared experts, the router, the auxiliary
    losses. num_experts 0 (the default) is a dense model."""

    def __post_init__(self) -> None:
        self.moe = moe_from(self.moe)  # a recipe's or checkpoint's mapping becomes the dataclass

    def padded_vocab_size(self, tp_size: int) -> int:
        return padded_vocab_size(self.vocab_size, tp_size, self.vocab_pad_multiple)

    def resolved(self) -> "ModelConfig":
        """A copy with every switch left null set from the `arch` preset (the recipe's wins)."""
        return dataclasses.replace(self, **self._preset_filled())

    def _preset_filled(self) -> Dict[str, Any]:
        """The switches left null, with the preset's values, and `moe` with its router's filled."""
        preset = preset_values(self.arch, self.n_embd, self.n_head)
        filled = {key: preset[key] for key in ARCH_SWITCHES if getattr(self, key) is None}
        routing = {key: value for key, value in moe_preset(preset).items() if getattr(self.moe, key) is None}
        return dict(filled, moe=dataclasses.replace(self.moe, **routing))

    @property
    def llama_layout(self) -> bool:
        """The Llama module layout (fused q/k/v and gate/up projections, any switch value): every arch but gpt2."""
        return self.arch != "gpt2"

    @property
    def expert_ffn_hidden_size(self) -> int:
        """Each routed (and shared) expert's MLP width (a resolved config)."""
        return self.moe.expert_width(self.ffn_hidden_size)

    @property
    def position_range(self) -> int:
        """The positions the model is built for: max_positions, or seq_len when longer or null."""
        return max(self.seq_len, self.max_positions or 0)

    @property
    def head_dim(self) -> int:
        return self.head_size if self.head_size is not None else self.n_embd // self.n_head

    def validate(self) -> None:
        """Raise ValueError naming the field, its value and the fix (launch/ reports it as bad input,
        exit 2; this module does not import launch/). How the heads and widths split over tp and
        the blocks over pp are the layout's rules (launch/config/layout.py)."""
        self._validate_ranges()  # first: the preset's widths below are computed from these numbers
        self.moe.validate_ranges()
        if self.head_size is None and self.n_embd % self.n_head != 0:
            raise ValueError(f"model.n_embd={self.n_embd} is not divisible by model.n_head={self.n_head} (or set "
                             f"model.head_size)")
        if self.arch not in ARCHS:
            raise ValueError(f"model.arch={self.arch!r} is not one of {', '.join(ARCHS)}")
        full = self.resolved()  # the arch preset's switches filled in
        for key, allowed in (("position", POSITIONS), ("norm", NORMS), ("mlp", MLPS), ("qk_norm", QK_NORMS + (None,))):
            if getattr(full, key) not in allowed:
                raise ValueError(f"model.{key}={getattr(full, key)!r} is not one of {', '.join(map(str, allowed))}")
        gpt2_only = dict(mlp=("gelu", full.mlp), n_kv_head=(full.n_head, full.n_kv_head),
                         qk_norm=(None, full.qk_norm), head_size=(full.n_embd // full.n_head, full.head_dim),
                         **{"moe.num_experts": (0, full.moe.num_experts)})
        changed = [(key, got) for key, (want, got) in gpt2_only.items() if want != got]
        if full.arch == "gpt2" and changed:
            key, value = changed[0]
            raise ValueError(f"model.{key}={value!r} with model.arch=gpt2: GPT-2's fused c_attn and c_fc have "
                             f"n_kv_head = n_head, a GELU MLP, no q/k norm and no experts; set model.arch=llama, "
                             f"which takes every switch")
        if full.arch in MOE_ARCHS and not full.moe.enabled:
            raise ValueError(f"model.arch={full.arch} with model.moe.num_experts={full.moe.num_experts}: the "
                             f"{full.arch} preset is a mixture of experts; set model.moe.num_experts (and "
                             f"experts_per_token)")
        full.moe.validate(full.ffn_hidden_size)
        if full.moe.enabled and full.mlp != "swiglu":
            raise ValueError(f"model.mlp={full.mlp!r} with model.moe.num_experts={full.moe.num_experts}: the experts "
                             f"are SwiGLU MLPs; set model.mlp=swiglu")
        if not 0 < full.norm_eps < 1:  # written so that NaN fails too (a checkpoint's JSON may hold one)
            raise ValueError(f"model.norm_eps={shown(full.norm_eps)} must be > 0 and < 1 (1e-5 or 1e-6 in the presets)")
        if not full.rope_theta > 0:
            raise ValueError(f"model.rope_theta={shown(full.rope_theta)} must be > 0 (10000 in Llama 2, 500000 in "
                             f"Llama 3)")
        full._validate_rope_scaling()
        if full.position == "rope" and full.head_dim % 2:
            raise ValueError(f"model.position=rope needs an even head size, n_embd/n_head = "
                             f"{full.n_embd}/{full.n_head} = {full.head_dim}; choose n_embd and n_head with an even "
                             f"quotient")
        kv = full.n_kv_head
        if kv < 1 or full.n_head % kv:
            raise ValueError(f"model.n_kv_head={kv} must divide model.n_head={full.n_head} (each key/value head serves "
                             f"n_head/n_kv_head query heads; 1 is multi-query, null is n_head)")
        if self.max_positions is not None and full.position != "rope":
            raise ValueError(f"model.max_positions={self.max_positions} needs model.position=rope (learned "
                             f"positions have model.seq_len rows); drop it or set model.position=rope")

    def _validate_ranges(self) -> None:
        """Each number in its range (INT_RANGES; the floats' NaN and infinities are the recipe loader's,
        but a comparison written so that NaN fails keeps a checkpoint's or a caller's out too)."""
        for key, most in INT_RANGES.items():
            value = getattr(self, key)
            if value is not None and not 1 <= value <= most:
                null = " (or null)" if self.__dataclass_fields__[key].default is None else ""
                raise ValueError(f"model.{key}={shown(value)} must be >= 1 and <= {most}{null}")
        if not 1 <= self.moe.moe_every <= self.n_layer:
            raise ValueError(f"model.moe.moe_every={shown(self.moe.moe_every)} must be >= 1 and <= model.n_layer="
                             f"{self.n_layer}: block i is an MoE block when (i + 1) % moe_every == 0")
        width = self.moe.expert_ffn_hidden_size
        if width is not None and not 1 <= width <= MAX_WIDTH:
            raise ValueError(f"model.moe.expert_ffn_hidden_size={shown(width)} must be >= 1 and <= {MAX_WIDTH} "
                             f"(null takes model.ffn_hidden_size)")
        if not 0 < self.init_std <= 1:  # N(0, 1) weights already grow each layer's output sqrt(n_embd)-fold
            raise ValueError(f"model.init_std={shown(self.init_std)} must be > 0 and <= 1 (GPT-2 and Llama: 0.02)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout={shown(self.dropout)} must be in [0, 1)")

    def _validate_rope_scaling(self) -> None:
        """rope_scaling: null, or Llama 3's four numbers as transformers' _validate_llama3_rope_parameters
        wants them: factor >= 1, 0 < low_freq_factor < high_freq_factor, a whole number of original
        positions (model/transformer/rotary.py divides by each)."""
        scaling = self.rope_scaling
        if scaling is None:
            return
        keys = ", ".join(LLAMA3_SCALING_KEYS)
        if self.position != "rope":
            raise ValueError(f"model.rope_scaling is set with model.position={self.position!r}: it scales RoPE's "
                             f"frequencies; set model.position=rope or drop model.rope_scaling")
        if set(scaling) != set(LLAMA3_SCALING_KEYS):  # the keys may be anything YAML or JSON reads: no sorting
            given = ", ".join(key if isinstance(key, str) else shown(key) for key in scaling) or "none"
            raise ValueError(f"model.rope_scaling has keys {given}; Llama 3's scaling takes exactly {keys} (e.g. 32, "
                             f"1, 4, 8192 for Llama 3.2)")
        for key, rule in (("factor", ">= 1"), ("low_freq_factor", "> 0"), ("high_freq_factor", "> 0")):
            value = scaling[key]
            if not finite_number(value) or not (value >= 1 if rule == ">= 1" else value > 0):
                raise ValueError(f"model.rope_scaling.{key}={shown(value)} must be a finite number {rule} (Llama 3.2: "
                                 f"factor 32, low_freq_factor 1, high_freq_factor 4)")
        positions = scaling["original_max_position_embeddings"]
        if isinstance(positions, bool) or not isinstance(positions, int) or not 1 <= positions <= MAX_POSITIONS:
            raise ValueError(f"model.rope_scaling.original_max_position_embeddings={shown(positions)} must be a whole "
                             f"number >= 1 and <= {MAX_POSITIONS} (Llama 3: 8192)")
        if scaling["low_freq_factor"] >= scaling["high_freq_factor"]:
            raise ValueError(f"model.rope_scaling low_freq_factor={scaling['low_freq_factor']} and high_freq_factor="
                             f"{scaling['high_freq_factor']}: they must be numbers > 0 with low_freq_factor < "
                             f"high_freq_factor (Llama 3: 1 and 4)")


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
    model/transformer/documents.py)."""
    eos_token_id: Optional[int] = None
    """The token that starts each document under `document_mask` (the tokenizer's EOS, data/tokens.py)."""

    def __post_init__(self) -> None:
        if self.vocab_size is None:
            raise ValueError("GPTConfig needs a vocab_size (a recipe's null is resolved from the tokenizer first)")
        if self.document_mask and self.eos_token_id is None:
            raise ValueError("GPTConfig with document_mask needs the eos_token_id that starts each document")
        super().__post_init__()
        # A built model never sees a null switch: fill them from the preset here, once.
        for key, value in self._preset_filled().items():
            setattr(self, key, value)

    def sequence_parallel_group(self, tp_group: Any) -> Any:
        """The TP group when activations are sequence-sharded, else None (the collectives bypass)."""
        return tp_group if self.sequence_parallel else None
