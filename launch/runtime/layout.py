"""The one place that derives the run's numbers (dp, micro-batches per step, DeepSpeed batch
keys) and checks them against the recipe, with messages that print the numbers and the fix.

Runs before torch.distributed or DeepSpeed start, so bad input costs nothing.
"""
import dataclasses
from dataclasses import dataclass
from typing import Tuple

from launch.analysis.partition import check_partition, run_parts
from launch.runtime.recipe import ConfigError, Recipe
from model.config import ARCHS, LLAMA3_SCALING_KEYS, MLPS, NORMS, POSITIONS, ModelConfig

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
PRECISIONS = ("fp32", "bf16", "fp16")
RECOMPUTE_MODES = ("none", "selective", "full")
SCHEDULES = ("1f1b", "zb-h1")  # launch/runtime/zero_bubble.py


@dataclass(frozen=True, kw_only=True)
class Layout:
    """The run's derived numbers; checkpoints record them (vars(layout))."""
    world_size: int
    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    global_batch_size: int
    grad_accum_steps: int
    """Micro-batches per pipeline per optimizer step (m = B / (b * dp))."""
    parts: Tuple[int, ...] = ()
    """Stage boundaries over the pipeline layers (stage k holds parts[k]:parts[k+1]) from
    train.partition; they need the vocabulary, so `with_parts` sets them once it is known."""


def derive_layout(recipe: Recipe, world_size: int, tp: int, pp: int, on_cpu: bool) -> Layout:
    """Check every rule that depends on the layout; raise ConfigError naming the values."""
    if tp < 1 or pp < 1:
        raise ConfigError(f"--tp {tp} --pp {pp}: both must be >= 1")
    if world_size % (tp * pp) != 0:
        if on_cpu:
            hint = (f"on CPU the launcher starts one process per NUMA node unless told: run "
                    f"`deepspeed --num_gpus {tp * pp} launch/train.py --tp {tp} --pp {pp} ...`")
        else:
            hint = f"start a multiple of {tp * pp} processes or choose --tp and --pp whose product divides {world_size}"
        raise ConfigError(f"world size {world_size} is not divisible by tp*pp = {tp}*{pp} = {tp * pp}; {hint}")
    dp = world_size // (tp * pp)

    m, t = recipe.model, recipe.train
    for key in ("n_layer", "n_head", "n_embd", "seq_len"):
        if getattr(m, key) < 1:
            raise ConfigError(f"model.{key}={getattr(m, key)} must be >= 1")
    if m.n_head % tp != 0:
        raise ConfigError(f"model.n_head={m.n_head} is not divisible by --tp {tp}; "
                          f"choose tp among the divisors of n_head")
    if m.n_embd % m.n_head != 0:
        raise ConfigError(f"model.n_embd={m.n_embd} is not divisible by model.n_head={m.n_head}")
    check_architecture(m, tp)
    if m.n_layer < pp:
        raise ConfigError(f"model.n_layer={m.n_layer} is fewer than the {pp} pipeline stages of --pp {pp}; "
                          f"use --pp <= {m.n_layer}")
    if m.vocab_pad_multiple < 1:
        raise ConfigError(f"model.vocab_pad_multiple={m.vocab_pad_multiple} must be >= 1")
    if m.vocab_size is not None and m.vocab_size < 1:
        raise ConfigError(f"model.vocab_size={m.vocab_size} must be >= 1 (or null for the tokenizer's)")
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout={m.dropout} must be in [0, 1)")

    b, B = t.micro_batch_size, t.global_batch_size
    if b < 1 or B < 1:
        raise ConfigError(f"train.micro_batch_size={b} and train.global_batch_size={B} must be >= 1")
    if B % (b * dp) != 0:
        raise ConfigError(f"train.global_batch_size={B} is not divisible by micro_batch_size*dp = "
                          f"{b}*{dp} = {b * dp}; pick a global batch that is a multiple of {b * dp}")
    if t.steps < 1:
        raise ConfigError(f"train.steps={t.steps} (or --steps) must be >= 1")
    if t.precision not in PRECISIONS:
        raise ConfigError(f"train.precision={t.precision!r} is not one of {', '.join(PRECISIONS)}")
    if t.zero_stage not in (0, 1):
        # Every run, pp=1 included, trains through DeepSpeed's pipeline engine, which refuses 2 and 3.
        raise ConfigError(f"train.zero_stage={t.zero_stage} with --pp {pp}: DeepSpeed's pipeline engine "
                          f"supports ZeRO stage 0 or 1 only; set train.zero_stage=1")
    if t.zero_stage == 0 and t.precision == "bf16":
        # deepspeed.initialize raises NotImplementedError for bf16 weights with the fp32 gradient
        # accumulation that pipeline runs need (docs/design.md contract 8); ZeRO-1 supports it.
        raise ConfigError("train.zero_stage=0 with train.precision=bf16: DeepSpeed 0.19.8 has no ZeRO-0 bf16 "
                          "path with fp32 gradient accumulation; set train.zero_stage=1")
    if t.activation_checkpoint_interval < 0:
        raise ConfigError(f"train.activation_checkpoint_interval={t.activation_checkpoint_interval} must be >= 0")
    if t.recompute not in RECOMPUTE_MODES:
        raise ConfigError(f"train.recompute={t.recompute!r} is not one of {', '.join(RECOMPUTE_MODES)}")
    if t.recompute == "selective" and t.activation_checkpoint_interval > 0:
        raise ConfigError(f"train.recompute=selective with train.activation_checkpoint_interval="
                          f"{t.activation_checkpoint_interval}: the interval is for full recompute; "
                          f"set train.recompute=full or train.activation_checkpoint_interval=0")
    if t.schedule not in SCHEDULES:
        raise ConfigError(f"train.schedule={t.schedule!r} is not one of {', '.join(SCHEDULES)}")
    check_partition(t.partition, m.n_layer, pp)
    if t.warmup_steps < 0 or t.grad_clip < 0 or t.lr <= 0 or not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError(f"train.lr={t.lr} must be > 0, warmup_steps={t.warmup_steps} and "
                          f"grad_clip={t.grad_clip} >= 0, min_lr_ratio={t.min_lr_ratio} in [0, 1]")
    d = recipe.data
    if d.seq_len is not None and not 1 <= d.seq_len <= m.seq_len:
        raise ConfigError(f"data.seq_len={d.seq_len} must be in [1, model.seq_len={m.seq_len}] (the model's "
                          f"positions); lower data.seq_len or raise model.seq_len")
    if m.sequence_parallel and recipe.seq_len % tp != 0:
        # Each TP rank holds T/t positions of every sequence-parallel activation.
        raise ConfigError(f"model.sequence_parallel with --tp {tp} needs the sequence length {recipe.seq_len} "
                          f"(data.seq_len, else model.seq_len) divisible by {tp}; choose a multiple of {tp} "
                          f"or set model.sequence_parallel=false")
    if not 0 <= d.val_fraction < 1:
        raise ConfigError(f"data.val_fraction={d.val_fraction} must be in [0, 1)")
    if d.num_proc < 1 or d.shuffle_buffer < 1:
        raise ConfigError(f"data.num_proc={d.num_proc} and data.shuffle_buffer={d.shuffle_buffer} must be >= 1")
    if t.dist_timeout_s < 1:
        raise ConfigError(f"train.dist_timeout_s={t.dist_timeout_s} must be >= 1 (seconds a collective waits "
                          f"before a rank gives up; default 600)")
    if t.eval_every < 0 or t.eval_batches < 1:
        raise ConfigError(f"train.eval_every={t.eval_every} must be >= 0 and train.eval_batches={t.eval_batches} >= 1")
    pipeline = recipe.deepspeed.get("pipeline")
    partitioned = [k for k in ("pipe_partitioned", "grad_partitioned")
                   if isinstance(pipeline, dict) and pipeline.get(k)]
    if m.sequence_parallel and tp > 1 and pp > 1 and partitioned:
        # DeepSpeed would send 1/tp of each stage output and all-gather it, assuming the TP ranks
        # hold the same tensor; under SP they hold different chunks: silently wrong losses.
        raise ConfigError(f"deepspeed.pipeline.{partitioned[0]}=true with model.sequence_parallel, --tp {tp} "
                          f"--pp {pp}: stage outputs differ per TP rank under SP and cannot be partitioned; "
                          f"remove the key (SP already sends 1/tp of the sequence)")
    clashing = sorted(set(BATCH_KEYS) & set(recipe.deepspeed))
    if clashing:
        raise ConfigError(f"deepspeed.{clashing[0]} may not be set: batch keys are derived from "
                          f"train.micro_batch_size, train.global_batch_size and dp; set those instead")
    return Layout(world_size=world_size, tp=tp, pp=pp, dp=dp, micro_batch_size=b, global_batch_size=B,
                  grad_accum_steps=B // (b * dp))


def with_parts(layout: Layout, recipe: Recipe, vocab_size: int) -> Layout:
    """The layout with the stage boundaries of the recipe's train.partition (launch/analysis/partition.py)."""
    return dataclasses.replace(layout, parts=tuple(run_parts(recipe, vocab_size, layout.pp)))


def check_architecture(model: ModelConfig, tp: int) -> None:
    """The arch preset and its switches (model/config.py), alone and against --tp."""
    if model.arch not in ARCHS:
        raise ConfigError(f"model.arch={model.arch!r} is not one of {', '.join(ARCHS)}")
    m = model.resolved()
    for key, allowed in (("position", POSITIONS), ("norm", NORMS), ("mlp", MLPS)):
        if getattr(m, key) not in allowed:
            raise ConfigError(f"model.{key}={getattr(m, key)!r} is not one of {', '.join(allowed)}")
    if m.arch == "gpt2" and (m.mlp != "gelu" or m.n_kv_head != m.n_head):
        key, value = ("mlp", m.mlp) if m.mlp != "gelu" else ("n_kv_head", m.n_kv_head)
        raise ConfigError(f"model.{key}={value!r} with model.arch=gpt2: GPT-2's fused c_attn and c_fc have "
                          f"n_kv_head = n_head and a GELU MLP; set model.arch=llama, which takes every switch")
    if m.norm_eps <= 0 or m.rope_theta <= 0:
        raise ConfigError(f"model.norm_eps={m.norm_eps} and model.rope_theta={m.rope_theta} must be > 0")
    check_rope_scaling(m)
    if m.position == "rope" and m.head_dim % 2:
        raise ConfigError(f"model.position=rope needs an even head size, n_embd/n_head = {m.n_embd}/{m.n_head} = "
                          f"{m.head_dim}; choose n_embd and n_head with an even quotient")
    if m.ffn_hidden_size < 1 or m.ffn_hidden_size % tp:
        raise ConfigError(f"model.ffn_hidden_size={m.ffn_hidden_size} must be >= 1 and divisible by --tp {tp} "
                          f"(each rank holds ffn_hidden_size/tp of the MLP); choose a multiple of {tp}")
    kv = m.n_kv_head
    if kv < 1 or m.n_head % kv:
        raise ConfigError(f"model.n_kv_head={kv} must divide model.n_head={m.n_head} (each key/value head serves "
                          f"n_head/n_kv_head query heads; 1 is multi-query, null is n_head)")
    if kv % tp and tp % kv:
        raise ConfigError(f"model.n_kv_head={kv} with --tp {tp}: tp must divide n_kv_head (each rank holds its "
                          f"own key/value heads) or n_kv_head must divide tp (tp/n_kv_head ranks share one); "
                          f"choose --tp among the divisors or multiples of {kv}")
    if tp > kv and m.head_dim % (tp // kv):
        raise ConfigError(f"model.n_kv_head={kv} with --tp {tp}: the {tp // kv} ranks sharing a key/value head "
                          f"each hold 1/{tp // kv} of its {m.head_dim} rows, which does not divide; choose a "
                          f"smaller --tp")


def check_rope_scaling(m: ModelConfig) -> None:
    """model.rope_scaling: null, or Llama 3's four numbers with 0 < low_freq_factor < high_freq_factor."""
    scaling = m.rope_scaling
    if scaling is None:
        return
    keys = ", ".join(LLAMA3_SCALING_KEYS)
    if m.position != "rope":
        raise ConfigError(f"model.rope_scaling is set with model.position={m.position!r}: it scales RoPE's "
                          f"frequencies; set model.position=rope or drop model.rope_scaling")
    if sorted(scaling) != sorted(LLAMA3_SCALING_KEYS):
        raise ConfigError(f"model.rope_scaling has keys {', '.join(sorted(scaling)) or 'none'}; Llama 3's scaling "
                          f"takes exactly {keys} (e.g. 32, 1, 4, 8192 for Llama 3.2)")
    bad = [k for k in LLAMA3_SCALING_KEYS if isinstance(scaling[k], bool) or not isinstance(scaling[k], (int, float))
           or scaling[k] <= 0]
    if bad or scaling["low_freq_factor"] >= scaling["high_freq_factor"]:
        raise ConfigError(f"model.rope_scaling={scaling!r}: {keys} must be numbers > 0 with low_freq_factor < "
                          f"high_freq_factor")


def check_vocab(recipe: Recipe, tokenizer_vocab: int) -> int:
    """The model's real vocabulary: the recipe's, or the tokenizer's when the recipe says null."""
    vocab = recipe.model.vocab_size or tokenizer_vocab
    if vocab < tokenizer_vocab:
        raise ConfigError(f"model.vocab_size={vocab} is smaller than the tokenizer's vocabulary "
                          f"{tokenizer_vocab} ({recipe.data.tokenizer!r}); set model.vocab_size >= "
                          f"{tokenizer_vocab} or null")
    return vocab
