"""The mixture-of-experts section of a model, `model.moe` (docs/architectures.md, "Mixture of
experts"): which blocks replace their MLP by E expert MLPs, how a router picks k of them per
token, and the auxiliary losses that keep the load balanced. num_experts = 0 is a dense model.

No torch here: the planner and the recipe loader read it without starting torch.
"""
from dataclasses import dataclass
from typing import Any, Dict, Optional

ROUTERS = ("softmax_topk", "topk_softmax")
ROUTER_DTYPES = ("fp32", "activations")
BALANCES = ("aux_loss", "bias", "none")
BALANCE_SCOPES = ("micro_batch", "global_batch")
MOE_SWITCHES = ("router", "norm_topk_prob")
"""The switches of this section an `arch` preset fills when the recipe leaves them null."""
MAX_EXPERTS = 4096
"""The bound of num_experts, experts_per_token and shared_experts: twice Switch-C's 2048 experts (Fedus
et al. 2022); DeepSeek-V3 has 256, Qwen3-MoE 128. Every block builds each expert as a module of its own."""


@dataclass(kw_only=True)
class MoEConfig:
    num_experts: int = 0
    """Routed experts E per MoE block; 0: every block has the dense MLP (no MoE)."""
    experts_per_token: int = 2
    """k: the experts each token is sent to (Mixtral 2, Qwen3-30B-A3B and OLMoE 8)."""
    expert_ffn_hidden_size: Optional[int] = None
    """Width of each expert's SwiGLU MLP; null is model.ffn_hidden_size."""
    shared_experts: int = 0
    """Always-on experts every token also passes through (DeepSeek-MoE's shared experts): one SwiGLU
    MLP of width shared_experts * expert_ffn_hidden_size, added to the routed experts' output."""
    router: Optional[str] = None
    """softmax_topk: softmax over all E logits, then the k largest probabilities (Qwen3-MoE, OLMoE;
    renormalised to sum to 1 with norm_topk_prob, which is also Mixtral's transformers code);
    topk_softmax: the k largest logits, then a softmax over those k (Mixtral's reference code: the
    same weights as softmax_topk with norm_topk_prob, up to rounding). null: the arch preset's."""
    norm_topk_prob: Optional[bool] = None
    """softmax_topk: divide the k chosen probabilities by their sum (Mixtral, Qwen3-30B-A3B: true;
    OLMoE: false). null: the arch preset's."""
    router_dtype: str = "fp32"
    """fp32: the router's logits GEMM (its input and weight cast, not the stored weight), softmax,
    top-k and losses in fp32, whatever the activations' dtype (Megatron-LM's --moe-router-dtype fp32);
    activations: the GEMM in the activations' dtype (bf16 logits tie at the k-th place for some tokens)."""
    moe_every: int = 1
    """Block i (from 0) is an MoE block when (i + 1) % moe_every == 0 (Qwen3-MoE's
    decoder_sparse_step): 1 makes every block MoE, 2 every second one; the others keep the dense MLP."""
    balance: str = "aux_loss"
    """How the experts' load is kept even (docs/architectures.md, "Load balancing"). aux_loss: the
    load-balancing loss below; bias: DeepSeek-V3's auxiliary-loss-free balancing (Liu et al. 2024,
    sec. 2.1.2): a per-expert bias added to the router probabilities for the top-k choice only (the
    weights stay the probabilities), moved by bias_update_rate after each step, up for the experts that
    received fewer than the mean assignments of the step and down for the others; none: neither."""
    balance_scope: str = "micro_batch"
    """balance=aux_loss: over which tokens f_e is counted. micro_batch: each micro-batch's own (Switch,
    Mixtral, OLMoE); global_batch: a whole step's global batch, across micro-batches and DP (Qiu et
    al. 2025, Qwen3), which lets single micro-batches specialise. A step's counts are complete only
    after its last forward, and 1F1B runs backward passes before that, so the step uses the previous
    step's counts (the first step: uniform, so no balancing gradient); this is the same at every
    layout and micro-batch size, where Megatron-LM's running average over the micro-batches seen so
    far is not."""
    bias_update_rate: float = 0.001
    """balance=bias: the bias update speed gamma (DeepSeek-V3: 0.001 for most of its training)."""
    aux_loss_coef: float = 0.01
    """balance=aux_loss: weight of the load-balancing loss (Switch Transformer, Fedus et al. 2022, eq. 4,
    in transformers' normalisation: E * sum_e f_e * P_e, f_e the share of the k assignments per token that go to expert e,
    so a balanced router scores k), averaged over the MoE blocks. Mixtral 0.02, OLMoE 0.01, Qwen3 0.001."""
    z_loss_coef: float = 0.0
    """Weight of the router z-loss (ST-MoE, Zoph et al. 2022, eq. 5: the mean squared logsumexp of the
    router logits), averaged over the MoE blocks; 0 disables (OLMoE trained with 0.001)."""

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0

    def is_moe_block(self, layer_index: int) -> bool:
        return self.enabled and (layer_index + 1) % self.moe_every == 0

    def validate_ranges(self) -> None:
        """Each count and coefficient in its range, MoE or not (moe_every and the expert width: model/config.py,
        which knows n_layer and the widths' bound). Written so that NaN fails too."""
        for key, least in (("num_experts", 0), ("experts_per_token", 1), ("shared_experts", 0)):
            value = getattr(self, key)
            if not least <= value <= MAX_EXPERTS:
                raise ValueError(f"model.moe.{key}={value} must be >= {least} and <= {MAX_EXPERTS}"
                                 f"{' (0: a dense model)' if key == 'num_experts' else ''}")
        for key in ("bias_update_rate", "aux_loss_coef", "z_loss_coef"):
            if not getattr(self, key) >= 0:
                raise ValueError(f"model.moe.{key}={getattr(self, key)} must be >= 0 (0 turns it off)")

    def validate(self, ffn_hidden_size: Optional[int]) -> None:
        """Raise ValueError naming the field, its value and the fix (layout rules, ep: launch/config/layout.py);
        the ranges of validate_ranges hold already."""
        if not self.enabled:
            return
        E, k = self.num_experts, self.experts_per_token
        if not 1 <= k <= E:
            raise ValueError(f"model.moe.experts_per_token={k} must be in [1, model.moe.num_experts={E}]: each token "
                             f"goes to k of the E experts; lower experts_per_token or add experts")
        width = self.expert_ffn_hidden_size if self.expert_ffn_hidden_size is not None else ffn_hidden_size
        if width is None or width < 1:
            raise ValueError(f"model.moe.expert_ffn_hidden_size={self.expert_ffn_hidden_size} must be >= 1 "
                             f"(null takes model.ffn_hidden_size)")
        if self.router not in ROUTERS:
            raise ValueError(f"model.moe.router={self.router!r} is not one of {', '.join(ROUTERS)}")
        if self.router_dtype not in ROUTER_DTYPES:
            raise ValueError(f"model.moe.router_dtype={self.router_dtype!r} is not one of {', '.join(ROUTER_DTYPES)}")
        if self.router == "topk_softmax" and self.norm_topk_prob is False:
            raise ValueError("model.moe.router=topk_softmax with model.moe.norm_topk_prob=false: a softmax over "
                             "the k chosen logits always sums to 1; use router=softmax_topk for unnormalised weights")
        if self.balance not in BALANCES:
            raise ValueError(f"model.moe.balance={self.balance!r} is not one of {', '.join(BALANCES)}")
        if self.balance_scope not in BALANCE_SCOPES:
            raise ValueError(f"model.moe.balance_scope={self.balance_scope!r} is not one of {', '.join(BALANCE_SCOPES)}")
        if self.balance_scope == "global_batch" and self.balance != "aux_loss":
            raise ValueError(f"model.moe.balance_scope=global_batch counts the load-balancing loss over the global "
                             f"batch, but model.moe.balance={self.balance!r} has no such loss; set balance=aux_loss "
                             f"or balance_scope=micro_batch")

    def expert_width(self, ffn_hidden_size: int) -> int:
        """Each expert's MLP width: expert_ffn_hidden_size, or the model's ffn_hidden_size when null."""
        return self.expert_ffn_hidden_size if self.expert_ffn_hidden_size is not None else ffn_hidden_size


def moe_from(value: Any) -> MoEConfig:
    """A MoEConfig from a recipe's or a checkpoint's mapping (or an instance, kept)."""
    if isinstance(value, MoEConfig):
        return value
    if value is None:
        return MoEConfig()
    if not isinstance(value, dict):
        raise ValueError(f"model.moe={value!r} must be a mapping (num_experts, experts_per_token, ...)")
    unknown = sorted(set(value) - set(MoEConfig.__dataclass_fields__))
    if unknown:
        raise ValueError(f"unknown recipe key model.moe.{unknown[0]}; known keys: "
                         f"{', '.join('model.moe.' + k for k in MoEConfig.__dataclass_fields__)}")
    return MoEConfig(**value)


def moe_preset(values: Dict[str, Any]) -> Dict[str, Any]:
    """The MOE_SWITCHES values of an arch preset's `values` (preset_values in model/config.py)."""
    return {key: values[key] for key in MOE_SWITCHES}
