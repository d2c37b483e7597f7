"""Recipes: typed sections loaded from YAML, overridden by `--set key.sub=value`.

Every field has a type and a docstring; unknown keys and wrong types are errors that name
the key, the value and what was expected. Each section checks its own values (`validate`, next
to its dataclass: ModelConfig in model/config.py, DataSpec in data/spec.py, the others here) and
`Recipe.validate` what the sections say together; the rules of the layout (tp, pp, dp) are
launch/config/layout.py's.
"""
import dataclasses
import math
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from data.spec import URL_FIELDS, DataError, DataSpec, check_no_credentials
from launch.config.strict_yaml import parse_yaml, read_yaml_file
from launch.errors import ConfigError
from model.config import GPTConfig, ModelConfig

PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("adamw", "muon")  # launch/optim/muon.py
RECOMPUTE_MODES = ("none", "selective", "full")
SCHEDULES = ("1f1b", "zb-h1")  # launch/analysis/zero_bubble_schedule.py
PARTITION_RULES = ("balanced", "blocks")  # launch/analysis/partition.py
WANDB_MODES = ("online", "offline", "disabled")
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
HEARTBEAT_INTERVAL_S = 2.0
"""Each rank's failure watcher writes its heartbeat and reads its successor's this often
(launch/resilience/failure.py); train.heartbeat_timeout_s must be above it."""
MIN_HANG_BOUND_S = 5.0
"""The shortest train.hang_timeout_s / first_step_timeout_s: a few heartbeats and store polls."""
MAX_WAIT_S = 7 * 24 * 3600
"""The longest wait a recipe may set (a week): past it a timeout bounds nothing, and a thread's wait
or a timedelta of 10**14 s overflows (OverflowError after the process group started)."""
MAX_SEED = 2 ** 32 - 1
"""train.seed is in [0, 2**32): NumPy's generators refuse negative seeds, and the weight streams'
seed x 1,000,003 + stream stays inside torch.manual_seed's 64 bits."""


@dataclass
class TrainSection:
    steps: int = 100
    """Optimizer steps of the run."""
    seed: int = 1234
    """Seed of weights, data order and dropout."""
    micro_batch_size: int = 4
    """Samples per micro-batch per data-parallel replica (b)."""
    global_batch_size: int = 32
    """Samples per optimizer step over all replicas (B); B / (b * dp) micro-batches per step."""
    optimizer: str = "adamw"
    """adamw, or muon: Muon (momentum orthogonalised by Newton-Schulz, update scaled as Moonlight's so
    lr and weight_decay carry over) for the hidden matrices, AdamW for embeddings, the output head,
    norms, biases and routers (docs/design.md, "Muon at every layout")."""
    muon_momentum: float = 0.95
    """Muon's momentum mu (Keller Jordan's and Moonlight's 0.95), in [0, 1)."""
    muon_nesterov: bool = True
    """Muon orthogonalises G + mu M (Nesterov, as Moonlight's code) rather than M."""
    muon_ns_steps: int = 5
    """Newton-Schulz steps of Muon's orthogonalisation (launch/optim/newton_schulz.py), >= 1."""
    muon_ns_dtype: Optional[str] = None
    """fp32 or bf16: the precision of Newton-Schulz's matmuls; null: bf16 on a GPU (as Keller Jordan's
    code and torch.optim.Muon), fp32 on a CPU. The layout-parity runs use fp32."""
    muon_lr_rule: str = "moonlight"
    """How Muon scales lr for an m x n matrix (m outputs, n inputs): moonlight, lr 0.2 sqrt(max(m, n))
    (Liu et al. 2025, "Muon is Scalable for LLM Training", arXiv:2502.16982: the update's RMS is AdamW's,
    so AdamW's lr and weight_decay carry over; torch.optim.Muon's adjust_lr_fn="match_rms_adamw");
    keller, lr sqrt(max(1, m / n)) (Keller Jordan, "Muon", 2024, kellerjordan.github.io/posts/muon;
    torch.optim.Muon's default, lr about 0.02); none, lr. Weight decay is lr * weight_decay under each."""
    muon_adamw_lr: Optional[float] = None
    """With train.optimizer=muon, the peak lr of the AdamW group (embeddings, output head, norms,
    biases, routers), on the same schedule; null: train.lr."""
    muon_adamw_beta1: Optional[float] = None
    """With train.optimizer=muon, the AdamW group's beta1; null: train.beta1."""
    muon_adamw_beta2: Optional[float] = None
    """With train.optimizer=muon, the AdamW group's beta2; null: train.beta2."""
    muon_adamw_weight_decay: Optional[float] = None
    """With train.optimizer=muon, the AdamW group's decoupled weight decay (on its >= 2-D parameters);
    null: train.weight_decay, which then stays the Muon matrices' own."""
    lr: float = 6e-4
    """Peak learning rate of AdamW (and of Muon, whose update is scaled to AdamW's RMS)."""
    min_lr_ratio: float = 0.1
    """Cosine decay toward lr * min_lr_ratio (reached one step after the last: the last step's lr is
    just above it; launch/optim/lr_schedule.py)."""
    warmup_steps: int = 10
    """Linear warm-up: step k <= warmup_steps uses lr * k / warmup_steps."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay on matrices and embeddings (not biases or LayerNorm)."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    """Clip the global gradient norm (over all TP shards and stages) to this; 0 disables."""
    precision: str = "fp32"
    """fp32, bf16 or fp16."""
    zero_stage: int = 1
    """DeepSpeed ZeRO stage: 0 or 1 (pipeline parallelism allows no more)."""
    grad_accum_fusion: bool = True
    """bf16: the linears' weight-gradient GEMMs add into the optimizer's fp32 gradients, with no
    bf16 gradient to cast and add after each micro-batch (Megatron's gradient-accumulation
    fusion, launch/optim/main_grad.py); false: DeepSpeed's own accumulation. No effect in fp32/fp16."""
    recompute: str = "none"
    """Activation recomputation (Korthikanti et al. 2022): none; selective (store q, k, v and
    recompute each attention core); full (store each block's input, recompute the block)."""
    schedule: str = "1f1b"
    """Pipeline schedule: 1f1b (DeepSpeed's) or zb-h1 (zero-bubble H1, Qi et al. 2023: weight
    gradients deferred into 1F1B's idle slots; launch/analysis/zero_bubble_schedule.py). The same losses."""
    virtual_stages: int = 1
    """Chunks of the layer table per pipeline rank (interleaved 1F1B, Narayanan et al. 2021: chunk c of
    rank r is stage r + c x pp, the bubble shrinks by v; launch/engine/interleaved.py). Needs pp > 1,
    m a multiple of pp and n_layer divisible by pp x v; what it is not checked with yet is refused at
    start-up (docs/pipeline-schedules.md, Interleaved stages)."""
    eval_every: int = 0
    """Validation loss every this many steps and at the last step; 0 disables."""
    eval_batches: int = 10
    """Global batches of validation data per evaluation (the same ones every time)."""
    cp: int = 1
    """Context-parallel degree (--cp overrides it): each sequence split into cp contiguous shards,
    one per rank, attention exchanging them for heads (Ulysses; docs/design.md contract 17).
    world = tp x cp x pp x dp."""
    ep: int = 1
    """Expert-parallel degree (--ep overrides it): the experts of every MoE block split over ep ranks of
    the data-parallel axis (dp x cp ranks), tokens sent to their experts' ranks by an all-to-all
    (docs/design.md contract 18). Must divide dp x cp; 1 keeps every expert on every rank."""
    dist_timeout_s: int = 600
    """Collectives wait at most this long: if a rank dies, the others exit with an error. The last
    resort behind heartbeat_timeout_s."""
    heartbeat_timeout_s: float = 60.0
    """A rank whose heartbeat (every 2 s, launch/resilience/failure.py) has not advanced this long is
    declared lost and every rank exits; a store that does not answer this long means rank 0 is lost."""
    hang_timeout_s: float = 0.0
    """A step that has not ended after this many seconds is a hang: every rank writes its stacks,
    one line names the ranks not where the others are, the job ends (launch/resilience/hang_watchdog.py).
    0: 10x the median of the recent steps (their data waits left out), at least 120 s. Below
    dist_timeout_s. Validation and eval.tasks are timed batch by batch against it; saves have
    save_timeout_s, data waits data.stall_timeout_s."""
    first_step_timeout_s: float = 0.0
    """The same bound for the first step of each start, which also compiles and starts the data;
    0: 0.8 x dist_timeout_s (480 s by default)."""
    save_timeout_s: float = 0.0
    """A save (every rank's files, fsynced, and the commit) that runs longer is a hang, reported as
    one is. 0: no bound of its own: a save may take as long as it takes, its barrier still ends at
    dist_timeout_s."""
    stop_grace_s: float = 30.0
    """After SIGTERM/SIGINT a rank saves when the current step ends; if it has not ended within
    this many seconds, the rank leaves without saving (the last complete checkpoint resumes)."""
    async_save: bool = False
    """Saves return before their files are written: a background thread copies each rank's state to
    host memory (the next optimizer step waits for the copies), writes, fsyncs and commits it
    (launch/checkpoints/async_save.py); at most one save in flight, host memory one snapshot
    (docs/checkpoints.md, Asynchronous saves)."""
    max_starts_without_progress: int = 3
    """A requeue (--save DIR --load DIR) is refused in one line, exit 2, once this many starts in a
    row began at the same checkpoint and none saved a newer one (DIR/starts.jsonl,
    launch/resilience/restarts.py); 0: no cap."""
    partition: Union[str, List[int]] = "balanced"
    """Where the pipeline stages are cut: balanced (the least compute on the busiest stage, the
    output head and loss counted), blocks (equal numbers of blocks, DeepSpeed's type:Block) or
    blocks per stage, e.g. [3, 1] (launch/analysis/partition.py)."""
    compile: bool = False
    """Compile each transformer block with torch.compile (torchtitan's per-block compile); where
    the compiler cannot run here, one line says so and the run trains eagerly."""

    def validate(self) -> None:
        """Raise ConfigError on a value of this section that no layout can train (train.zero_stage
        and train.partition against --pp: launch/config/layout.py)."""
        b, B = self.micro_batch_size, self.global_batch_size
        if b < 1 or B < 1:
            raise ConfigError(f"train.micro_batch_size={b} and train.global_batch_size={B} must be >= 1")
        if self.steps < 1:
            raise ConfigError(f"train.steps={self.steps} (or --steps) must be >= 1")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"train.precision={self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if self.zero_stage == 0 and self.precision == "bf16":
            # deepspeed.initialize raises NotImplementedError for bf16 weights with the fp32 gradient
            # accumulation that pipeline runs need (docs/design.md contract 8); ZeRO-1 supports it.
            raise ConfigError("train.zero_stage=0 with train.precision=bf16: DeepSpeed 0.19.8 has no ZeRO-0 bf16 "
                              "path with fp32 gradient accumulation; set train.zero_stage=1")
        self._validate_optimizer()
        if self.recompute not in RECOMPUTE_MODES:
            raise ConfigError(f"train.recompute={self.recompute!r} is not one of {', '.join(RECOMPUTE_MODES)}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"train.schedule={self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        if self.virtual_stages < 1:
            raise ConfigError(f"train.virtual_stages={self.virtual_stages} must be >= 1 (chunks of layers per "
                              f"pipeline rank)")
        if self.warmup_steps < 0 or self.grad_clip < 0 or self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"train.lr={self.lr} must be > 0, warmup_steps={self.warmup_steps} and "
                              f"grad_clip={self.grad_clip} >= 0, min_lr_ratio={self.min_lr_ratio} in [0, 1]")
        if not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(f"train.seed={self.seed} (or --seed) must be in [0, {MAX_SEED}]")
        self._validate_adamw()
        if not 1 <= self.dist_timeout_s <= MAX_WAIT_S:
            raise ConfigError(f"train.dist_timeout_s={self.dist_timeout_s} must be in [1, {MAX_WAIT_S}] (seconds a "
                              f"collective waits before a rank gives up; default 600)")
        for name in ("heartbeat_timeout_s", "save_timeout_s", "stop_grace_s"):
            if getattr(self, name) > MAX_WAIT_S:
                raise ConfigError(f"train.{name}={getattr(self, name):g} must be at most {MAX_WAIT_S} s (a week)")
        if not self.heartbeat_timeout_s > HEARTBEAT_INTERVAL_S:
            raise ConfigError(f"train.heartbeat_timeout_s={self.heartbeat_timeout_s:g} must be above the heartbeat "
                              f"interval, {HEARTBEAT_INTERVAL_S:g} s (default 60)")
        for name in ("hang_timeout_s", "first_step_timeout_s"):  # 0: derived (launch/resilience/hang_watchdog.py)
            bound = getattr(self, name)
            if bound != 0 and not MIN_HANG_BOUND_S <= bound < self.dist_timeout_s:
                raise ConfigError(f"train.{name}={bound:g} must be 0 (derived), or at least {MIN_HANG_BOUND_S:g} s and "
                                  f"below train.dist_timeout_s={self.dist_timeout_s}: the collective timeout would "
                                  f"end the job first, without stacks")
        if not (self.save_timeout_s == 0 or self.save_timeout_s >= MIN_HANG_BOUND_S):
            raise ConfigError(f"train.save_timeout_s={self.save_timeout_s:g} must be 0 (no bound of its own) or at "
                              f"least {MIN_HANG_BOUND_S:g} s")
        if self.first_step_timeout_s and self.first_step_timeout_s < self.hang_timeout_s:
            raise ConfigError(f"train.first_step_timeout_s={self.first_step_timeout_s:g} must be at least "
                              f"train.hang_timeout_s={self.hang_timeout_s:g}: the first step also compiles "
                              f"and starts the data")
        if not self.stop_grace_s > 0:
            raise ConfigError(f"train.stop_grace_s={self.stop_grace_s:g} must be > 0 (seconds a stop request waits "
                              f"for the current step to end; default 30)")
        if self.max_starts_without_progress < 0:
            raise ConfigError(f"train.max_starts_without_progress={self.max_starts_without_progress} must be >= 0 "
                              f"(starts in a row from one checkpoint before a requeue is refused; 0: no cap; default 3)")
        if self.eval_every < 0 or self.eval_batches < 1:
            raise ConfigError(f"train.eval_every={self.eval_every} must be >= 0 and "
                              f"train.eval_batches={self.eval_batches} >= 1")

    def _validate_adamw(self) -> None:
        """The ranges torch.optim.AdamW checks when it is built, after the process group started."""
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"train.{name}={getattr(self, name):g} must be in [0, 1) (AdamW's moment decay; "
                                  f"default {getattr(TrainSection, name)})")
        if not 0 < self.eps < 1:
            raise ConfigError(f"train.eps={self.eps:g} must be in (0, 1) (AdamW's denominator term; default 1e-8)")
        if self.weight_decay < 0:
            raise ConfigError(f"train.weight_decay={self.weight_decay:g} must be >= 0 (default 0.1)")

    def _validate_optimizer(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"train.optimizer={self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
        if not 0 <= self.muon_momentum < 1:
            raise ConfigError(f"train.muon_momentum={self.muon_momentum:g} must be in [0, 1) (default 0.95)")
        if self.muon_ns_steps < 1:
            raise ConfigError(f"train.muon_ns_steps={self.muon_ns_steps} must be >= 1 (default 5, Keller Jordan's)")
        if self.muon_ns_dtype not in (None, "fp32", "bf16"):
            raise ConfigError(f"train.muon_ns_dtype={self.muon_ns_dtype!r} is not one of fp32, bf16 "
                              f"(or null: bf16 on a GPU, fp32 on a CPU)")
        if self.muon_lr_rule not in ("moonlight", "keller", "none"):  # launch/optim/newton_schulz.py: LR_RULES
            raise ConfigError(f"train.muon_lr_rule={self.muon_lr_rule!r} is not one of moonlight, keller, none")
        if self.muon_adamw_lr is not None and not self.muon_adamw_lr > 0:
            raise ConfigError(f"train.muon_adamw_lr={self.muon_adamw_lr:g} must be > 0 (or null: train.lr)")
        for name in ("muon_adamw_beta1", "muon_adamw_beta2"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"train.{name}={getattr(self, name):g} must be in [0, 1) "
                                  f"(or null: train.{name[len('muon_adamw_'):]})")
        if self.muon_adamw_weight_decay is not None and self.muon_adamw_weight_decay < 0:
            raise ConfigError(f"train.muon_adamw_weight_decay={self.muon_adamw_weight_decay:g} must be >= 0 "
                              f"(or null: train.weight_decay)")
        if self.optimizer == "muon" and not isinstance(self.partition, str) and 0 in list(self.partition):
            # Before the data is read (the balanced rule's cut needs the vocabulary: checked after,
            # launch/analysis/partition.py: check_muon_stages).
            raise muon_stage_error(list(self.partition), f"train.partition={list(self.partition)}")
        if self.optimizer == "muon" and self.precision == "fp16" and self.zero_stage == 0:
            # DeepSpeed's FP16 optimizer regroups the fp32 weights in a way launch/optim/muon_partitions.py does not read.
            raise ConfigError("train.optimizer=muon with train.precision=fp16 needs train.zero_stage=1 "
                              "(DeepSpeed's ZeRO-0 fp16 optimizer is not supported with Muon)")


def muon_stage_error(counts: List[int], cut: str) -> ConfigError:
    """train.optimizer=muon needs a hidden matrix on every stage (launch/engine/engine.py:
    _muon_param_groups): the error for blocks per stage `counts`, cut by `cut`, with a cut that
    moves a block from the fullest stage to each empty one."""
    fixed = list(counts)
    for k, n in enumerate(fixed):
        if n == 0:
            fixed[fixed.index(max(fixed))] -= 1
            fixed[k] = 1
    return ConfigError(f"train.optimizer=muon with blocks per stage {counts} ({cut}): every stage needs a "
                       f"transformer block for Muon's matrices; give each stage one, e.g. train.partition={fixed}")


@dataclass
class WandbSection:
    project: str = "gpt3d"
    name: Optional[str] = None
    """Run name; null lets wandb choose."""
    mode: str = "disabled"
    """online, offline or disabled; `--wandb` overrides."""

    def validate(self) -> None:
        """Raise ConfigError on an unknown mode (an online run's API key: launch/trainer/preflight.py)."""
        if self.mode not in WANDB_MODES:
            raise ConfigError(f"wandb.mode={self.mode!r} is not one of {', '.join(WANDB_MODES)} (--wandb overrides it)")


@dataclass
class EvalSection:
    """Downstream tasks scored while training (docs/evaluation.md)."""
    tasks: List[str] = field(default_factory=list)
    """Multiple-choice tasks, each NAME=PATH (a JSON Lines file of HellaSwag's, ARC's or PIQA's schema)."""
    every: int = 0
    """Score them every N steps and after the last; 0: after the last step only."""
    max_examples: int = 0
    """Each task's first N examples (the time an evaluation takes); 0: every example."""

    def validate(self) -> None:
        if self.every < 0 or self.max_examples < 0:
            raise ConfigError(f"eval.every={self.every} and eval.max_examples={self.max_examples} must be >= 0 "
                              f"(0: after the last step; every example)")
        if self.every and not self.tasks:
            raise ConfigError(f"eval.every={self.every} with no eval.tasks: give tasks, e.g. "
                              f"--set 'eval.tasks=[hellaswag=hellaswag.jsonl]'")


@dataclass
class Recipe:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataSpec = field(default_factory=DataSpec)
    train: TrainSection = field(default_factory=TrainSection)
    wandb: WandbSection = field(default_factory=WandbSection)
    eval: EvalSection = field(default_factory=EvalSection)
    deepspeed: Dict[str, Any] = field(default_factory=dict)
    """Extra DeepSpeed config keys passed through (not batch keys)."""

    @property
    def seq_len(self) -> int:
        """Tokens per training sample: data.seq_len, or the model's positions."""
        return self.data.seq_len or self.model.seq_len

    def gpt_config(self, vocab_size: int, eos_token_id: Optional[int] = None) -> GPTConfig:
        """The model to build: this recipe's model section with the tokenizer's vocabulary resolved
        (and its EOS, which starts each document under data.document_mask)."""
        return GPTConfig(**dict(dataclasses.asdict(self.model), vocab_size=vocab_size), seed=self.train.seed,
                         recompute_attention=self.train.recompute == "selective",
                         document_mask=self.data.document_mask, eos_token_id=eos_token_id)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self) -> None:
        """Every section's own checks, then what they say together; raise ConfigError on the first."""
        try:
            self.model.validate()
            self.data.validate()
        except ValueError as e:  # model/ and data/ do not import launch/, so they raise ValueError
            raise ConfigError(str(e)) from None
        self.train.validate()
        self.wandb.validate()
        self.eval.validate()
        stall = self.data.stall_timeout_s
        if stall != 0 and not MIN_HANG_BOUND_S <= stall < self.train.dist_timeout_s:
            raise ConfigError(f"data.stall_timeout_s={stall:g} must be 0 (0.8 x train.dist_timeout_s), or at least "
                              f"{MIN_HANG_BOUND_S:g} s and below train.dist_timeout_s={self.train.dist_timeout_s}: the "
                              f"peers of a stalled rank wait in a collective, which ends at dist_timeout_s without stacks")
        if self.data.seq_len is not None and not 1 <= self.data.seq_len <= self.model.seq_len:
            raise ConfigError(f"data.seq_len={self.data.seq_len} must be in [1, model.seq_len={self.model.seq_len}] "
                              f"(the model's positions); lower data.seq_len or raise model.seq_len")
        clashing = sorted(set(BATCH_KEYS) & set(self.deepspeed))
        if clashing:
            raise ConfigError(f"deepspeed.{clashing[0]} may not be set: batch keys are derived from "
                              f"train.micro_batch_size, train.global_batch_size and dp; set those instead")


class NotFinite(ConfigError):
    """A float field given NaN, an infinity, or a number past float's range."""


def _check_type(key: str, value: Any, annotation: Any) -> Any:
    """Return value converted to the field's type, or raise ConfigError naming both."""
    if typing.get_origin(annotation) is typing.Union:  # Optional[T], or a choice such as Union[str, List[int]]
        if value is None and type(None) in typing.get_args(annotation):
            return None
        choices = [a for a in typing.get_args(annotation) if a is not type(None)]
        for choice in choices:
            try:
                return _check_type(key, value, choice)
            except NotFinite:
                raise
            except ConfigError:
                pass
        names = " or ".join(str(a) if typing.get_origin(a) else a.__name__ for a in choices)
        raise ConfigError(f"{key}={value!r} has the wrong type: expected {names.replace('typing.', '')}")
    if typing.get_origin(annotation) is dict:
        if isinstance(value, dict):
            return value
    elif typing.get_origin(annotation) is list:  # data.mix: its items are checked by data/mixture_spec.py
        if isinstance(value, list):
            return value
    elif annotation is float and isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:  # YAML 1.1 reads `3e-4` (no dot) as a string
            number = float(value)
        except OverflowError:  # an integer past float's range: float(10**400) raises, no inf
            number = math.inf
        except ValueError:
            number = None
        if number is not None:
            # Checked here, once for every float field: a range check written `x <= 0` is False for
            # NaN, and inf passes `x > 0`, so they would reach the optimizer or the model.
            if not math.isfinite(number):
                shown = _shown_int(value) if isinstance(value, int) else repr(value)
                raise NotFinite(f"{key}={shown} must be a finite number (NaN, inf and values past "
                                f"{sys.float_info.max:.3g} are not)")
            return number
    elif annotation is int and isinstance(value, int) and not isinstance(value, bool):
        if abs(value) >= 2 ** 63:  # no tensor, timedelta or C++ size holds it (OverflowError later)
            raise ConfigError(f"{key}={_shown_int(value)} is past the 64-bit integers every size and count "
                              f"must fit in")
        return value
    elif annotation in (str, bool) and type(value) is annotation:
        return value
    name = getattr(annotation, "__name__", str(annotation))
    refuse_credentials(key, value)  # the message below repeats the value
    raise ConfigError(f"{key}={value!r} has the wrong type: expected {name}")


def _shown_int(value: int) -> str:
    """A huge integer as its size (past 4,300 digits, Python refuses to write it out)."""
    return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"


def _apply(section: Any, values: Dict[str, Any], prefix: str) -> None:
    if not isinstance(values, dict):
        raise ConfigError(f"{prefix.rstrip('.')} must be a mapping, got {values!r}")
    hints = typing.get_type_hints(type(section))
    for key, value in values.items():
        if key not in hints:
            known = ", ".join(prefix + k for k in hints)
            raise ConfigError(f"unknown recipe key {prefix}{key}; known keys: {known}")
        current = getattr(section, key)
        if dataclasses.is_dataclass(current):
            _apply(current, value, f"{prefix}{key}.")
        else:
            setattr(section, key, _check_type(prefix + key, value, hints[key]))


def _parse_override(item: str) -> Dict[str, Any]:
    """'train.lr=1e-3' -> {'train': {'lr': 0.001}}; the value is parsed as YAML."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r} is not key.sub=value (e.g. --set train.lr=3e-4)")
    key, text = item.split("=", 1)
    try:
        value = parse_yaml(text, "the value") if text else ""
    except ConfigError as e:
        refuse_credentials(f"--set {key}", text)  # the message below repeats the value
        shown = item if len(item) <= 120 else item[:100] + "..."
        raise ConfigError(f"--set {shown!r}: {e}; quote it, e.g. --set '{key}=\"...\"'") from None
    parts = key.strip().split(".")
    if parts[0] == "deepspeed" and len(parts) > 1:  # free-form pass-through section
        nested: Dict[str, Any] = {parts[-1]: value}
        for part in reversed(parts[1:-1]):
            nested = {part: nested}
        return {"deepspeed": nested}
    nested = value
    for part in reversed(parts):
        nested = {part: nested}
    return nested


def deep_merge(into: Dict[str, Any], extra: Dict[str, Any]) -> None:
    """Merge `extra` into `into`, recursing into dicts both hold; `extra` wins."""
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            deep_merge(into[key], value)
        else:
            into[key] = value


def load_recipe(path: Path, overrides: List[str]) -> Recipe:
    if not path.is_file():
        raise ConfigError(f"recipe file {str(path)!r} not found; pass --recipe recipes/<name>.yaml "
                          f"(see recipes/)")
    raw = read_yaml_file(path, f"recipe {str(path)!r}")
    if raw is None:  # an empty file: the defaults
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"recipe {str(path)!r} is a YAML {type(raw).__name__}, not a mapping of sections "
                          f"(model:, data:, train:, ...); see recipes/demo.yaml")
    recipe = Recipe()
    for values in [raw] + [_parse_override(o) for o in overrides]:
        values = dict(values) if isinstance(values, dict) else values
        if isinstance(values, dict) and "deepspeed" in values:
            _check_type("deepspeed", values["deepspeed"], Dict[str, Any])
            deep_merge(recipe.deepspeed, values.pop("deepspeed"))
        _apply(recipe, values, "")
    # As it is read: every later message may repeat these values (a tokenizer that fails to load
    # under --layout auto comes before Recipe.validate), and the recipe is saved with every checkpoint.
    for key in URL_FIELDS:
        refuse_credentials(f"data.{key}", getattr(recipe.data, key))
    refuse_credentials("eval.tasks", recipe.eval.tasks)  # NAME=PATH items
    return recipe


def refuse_credentials(where: str, value: Any) -> None:
    """data/spec.py's check_no_credentials (a URL's user:password@ or http(s) ?query) as a ConfigError."""
    try:
        check_no_credentials(where, value)
    except DataError as e:
        raise ConfigError(str(e)) from None
