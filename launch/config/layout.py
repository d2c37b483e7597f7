"""The run's layout at (world size, tp, pp, train.cp): derives dp = world / (tp x cp x pp), micro-batches per step and DeepSpeed's
batch keys from a recipe, after checking the recipe (`Recipe.validate`) and the rules that
depend on tp and pp, with messages that print the numbers and the fix.

Runs before torch.distributed or DeepSpeed start, so bad input costs nothing.
"""
from dataclasses import dataclass
from typing import Sequence, Tuple, Union

from launch.config.recipe import PARTITION_RULES, Recipe
from launch.errors import ConfigError
from model.config import ModelConfig


@dataclass(frozen=True, kw_only=True)
class Layout:
    """The run's derived numbers; checkpoints record them (vars(layout))."""
    world_size: int
    tp: int
    pp: int
    dp: int
    """Data replicas: each draws its own samples (the CP ranks of one replica share them)."""
    micro_batch_size: int
    global_batch_size: int
    grad_accum_steps: int
    """Micro-batches per pipeline per optimizer step (m = B / (b * dp))."""
    cp: int = 1
    """Context-parallel ranks per replica, each holding seq_len / cp tokens of every sequence
    (train.cp, --cp)."""
    ep: int = 1
    """Expert-parallel ranks: each MoE block's experts split over ep ranks of DeepSpeed's data axis
    (dp x cp ranks; train.ep, --ep)."""
    parts: Tuple[int, ...] = ()
    """Stage boundaries over the pipeline layers (stage k holds parts[k]:parts[k+1]) from
    train.partition; they need the vocabulary, so launch/analysis/partition.py's `with_stage_boundaries`
    sets them once it is known."""
    virtual_stages: int = 1
    """Chunks of the layer table per pipeline rank (train.virtual_stages; interleaved 1F1B at v > 1)."""
    chunk_parts: Tuple[int, ...] = ()
    """At v > 1 the boundaries of the pp x v chunks (chunk c of rank r is stage r + c x pp), set with
    `parts`; () at v = 1. A checkpoint records both: each rank's ZeRO-1 partition holds its chunks'
    parameters, so a resume at another v or another cut of the chunks re-shards."""


def check_and_derive_layout(recipe: Recipe, world_size: int, tp: int, pp: int, on_cpu: bool) -> Layout:
    """Check the recipe and every rule that depends on the layout; raise ConfigError naming the values."""
    cp = recipe.train.cp
    if tp < 1 or pp < 1 or cp < 1:
        raise ConfigError(f"--tp {tp} --pp {pp} --cp {cp}: each must be >= 1")
    model_parallel = tp * cp * pp
    if world_size % model_parallel != 0:
        flags = f"--tp {tp} --pp {pp}" + (f" --cp {cp}" if cp > 1 else "")
        if on_cpu:
            hint = (f"on CPU the launcher starts one process per NUMA node unless told: run "
                    f"`deepspeed --num_gpus {model_parallel} launch/train.py {flags} ...`")
        else:
            hint = (f"start a multiple of {model_parallel} processes or choose --tp" + (", --cp" if cp > 1 else "")
                    + f" and --pp whose product divides {world_size}")
        product = f"tp*pp = {tp}*{pp}" if cp == 1 else f"tp*cp*pp = {tp}*{cp}*{pp}"
        raise ConfigError(f"world size {world_size} is not divisible by {product} = {model_parallel}; {hint}")
    dp = world_size // model_parallel
    recipe.validate()

    model_cfg, train_cfg = recipe.model, recipe.train
    if model_cfg.n_head % tp != 0:
        raise ConfigError(f"model.n_head={model_cfg.n_head} is not divisible by --tp {tp}; "
                          f"choose tp among the divisors of n_head")
    check_tensor_split(model_cfg, tp)
    if model_cfg.n_layer < pp:
        raise ConfigError(f"model.n_layer={model_cfg.n_layer} is fewer than the {pp} pipeline stages of --pp {pp}; "
                          f"use --pp <= {model_cfg.n_layer}")
    b, B = train_cfg.micro_batch_size, train_cfg.global_batch_size
    if B % (b * dp) != 0:
        raise ConfigError(f"train.global_batch_size={B} is not divisible by micro_batch_size*dp = "
                          f"{b}*{dp} = {b * dp}; pick a global batch that is a multiple of {b * dp}")
    if train_cfg.zero_stage not in (0, 1):
        # Every run, pp=1 included, trains through DeepSpeed's pipeline engine, which refuses 2 and 3.
        raise ConfigError(f"train.zero_stage={train_cfg.zero_stage} with --pp {pp}: DeepSpeed's pipeline engine "
                          f"supports ZeRO stage 0 or 1 only; set train.zero_stage=1")
    forced = recipe.deepspeed.get("zero_optimization", {})
    if isinstance(forced, dict) and forced.get("stage", 0) not in (0, 1):
        raise ConfigError(f"deepspeed.zero_optimization.stage={forced['stage']!r} with --pp {pp}: DeepSpeed's pipeline "
                          f"engine supports ZeRO stage 0 or 1 only; remove it (train.zero_stage sets the stage)")
    check_partition(train_cfg.partition, model_cfg.n_layer, pp)
    if cp > 1:
        check_context_parallel(recipe, tp, cp)
    check_expert_parallel(recipe, tp, dp * cp)
    if model_cfg.sequence_parallel and recipe.seq_len % tp != 0:
        # Each TP rank holds T/t positions of every sequence-parallel activation.
        raise ConfigError(f"model.sequence_parallel with --tp {tp} needs the sequence length {recipe.seq_len} "
                          f"(data.seq_len, else model.seq_len) divisible by {tp}; choose a multiple of {tp} "
                          f"or set model.sequence_parallel=false")
    pipeline = recipe.deepspeed.get("pipeline")
    partitioned = [k for k in ("pipe_partitioned", "grad_partitioned")
                   if isinstance(pipeline, dict) and pipeline.get(k)]
    if model_cfg.sequence_parallel and tp > 1 and pp > 1 and partitioned:
        # DeepSpeed would send 1/tp of each stage output and all-gather it, assuming the TP ranks
        # hold the same tensor; under SP they hold different chunks: silently wrong losses.
        raise ConfigError(f"deepspeed.pipeline.{partitioned[0]}=true with model.sequence_parallel, --tp {tp} "
                          f"--pp {pp}: stage outputs differ per TP rank under SP and cannot be partitioned; "
                          f"remove the key (SP already sends 1/tp of the sequence)")
    if runs_zero_bubble(train_cfg.schedule, pp):
        check_zero_bubble(recipe, pp)
    if train_cfg.virtual_stages > 1:
        check_virtual_stages(recipe, pp, B // (b * dp))
    return Layout(world_size=world_size, tp=tp, pp=pp, dp=dp, cp=cp, ep=recipe.train.ep, micro_batch_size=b,
                  global_batch_size=B, grad_accum_steps=B // (b * dp), virtual_stages=train_cfg.virtual_stages)


def check_expert_parallel(recipe: Recipe, tp: int, data_ranks: int) -> None:
    """What expert parallelism needs: ep ranks carved out of DeepSpeed's data axis (dp x cp
    ranks), whole experts per rank, and each expert's MLP split over tp."""
    model, ep = recipe.model.resolved(), recipe.train.ep
    if ep < 1:
        raise ConfigError(f"--ep {ep} (train.ep) must be >= 1")
    if not model.moe.enabled:
        if ep > 1:
            raise ConfigError(f"--ep {ep} with model.moe.num_experts=0: expert parallelism splits the experts of "
                              f"a mixture-of-experts model; drop --ep or set model.moe.num_experts")
        return
    if data_ranks % ep:
        raise ConfigError(f"--ep {ep} does not divide the {data_ranks} data-parallel ranks (dp x cp): the experts are "
                          f"split over ep of them and each split is replicated over the rest; choose --ep among the "
                          f"divisors of {data_ranks}")
    E = model.moe.num_experts
    if E % ep:
        raise ConfigError(f"model.moe.num_experts={E} is not divisible by --ep {ep}: each expert-parallel rank holds "
                          f"E/ep whole experts; choose --ep among the divisors of {E}")
    width = model.expert_ffn_hidden_size
    if width % tp:
        raise ConfigError(f"model.moe.expert_ffn_hidden_size={width} is not divisible by --tp {tp}: each TP rank "
                          f"holds 1/tp of every expert's MLP; choose a multiple of {tp}")


def check_context_parallel(recipe: Recipe, tp: int, cp: int) -> None:
    """What Ulysses attention (Jacobs et al. 2023) needs of the model at cp > 1: whole heads per
    (TP, CP) rank after the all-to-all, and whole tokens per CP rank (and per TP rank under SP)."""
    model = recipe.model
    if model.n_head % (tp * cp):
        raise ConfigError(f"model.n_head={model.n_head} is not divisible by tp*cp = {tp}*{cp} = {tp * cp}: after "
                          f"the all-to-all each rank attends over whole heads; choose tp*cp among the divisors of "
                          f"{model.n_head}")
    shards = cp * tp if model.sequence_parallel else cp
    if recipe.seq_len % shards:
        split = f"cp*tp = {cp}*{tp} = {shards} (sequence parallel)" if model.sequence_parallel else f"--cp {cp}"
        raise ConfigError(f"sequence length {recipe.seq_len} (data.seq_len, else model.seq_len) is not divisible "
                          f"by {split}: each CP rank holds seq_len/cp tokens; choose a multiple of {shards}")
    kv = model.resolved().n_kv_head
    if kv % (tp * cp) and (tp * cp) % kv:
        raise ConfigError(f"model.n_kv_head={kv} with tp*cp = {tp}*{cp} = {tp * cp}: tp*cp must divide n_kv_head or "
                          f"n_kv_head must divide tp*cp (the key/value heads replicate over the ranks sharing one); "
                          f"choose a --cp for which it does")


def runs_zero_bubble(schedule_name: str, pp: int) -> bool:
    """Whether a run of `train.schedule` at `pp` stages executes ZB-H1: at pp = 1 there is no bubble to fill
    and 1F1B runs (the tied embedding would otherwise receive its two gradients in another order)."""
    return schedule_name == "zb-h1" and pp > 1


def check_zero_bubble(recipe: Recipe, pp: int) -> None:
    """What would lose ZB-H1's deferred weight gradients silently."""
    for key in ("bf16", "bfloat16"):  # DeepSpeed reads either spelling
        section = recipe.deepspeed.get(key)
        if isinstance(section, dict) and section.get("immediate_grad_update"):
            # The BF16 optimizer would then take gradients only from autograd's accumulation hooks
            # and skip `update_hp_grads`: the W passes' gradients, set outside autograd, never arrive.
            raise ConfigError(f"deepspeed.{key}.immediate_grad_update=true with train.schedule=zb-h1 --pp {pp}: "
                              f"the W passes' weight gradients would be dropped; remove the key or use "
                              f"train.schedule=1f1b")


def check_interleaving(pp: int, virtual_stages: int, microbatches: int) -> None:
    """Raise ConfigError (one line) unless Megatron's interleaved order exists for (p, v, m)."""
    if virtual_stages < 1 or pp < 1 or microbatches < 1:
        raise ConfigError(f"train.virtual_stages={virtual_stages}, --pp {pp} and {microbatches} micro-batches "
                          f"must each be >= 1")
    if virtual_stages > 1 and pp < 2:
        raise ConfigError(f"train.virtual_stages={virtual_stages} with --pp {pp}: interleaving needs pipeline "
                          f"stages to interleave; use --pp >= 2 or train.virtual_stages=1")
    if virtual_stages > 1 and microbatches % pp:
        raise ConfigError(f"train.virtual_stages={virtual_stages} with --pp {pp} and {microbatches} micro-batches "
                          f"per step: interleaved 1F1B runs the micro-batches through each chunk in groups of pp "
                          f"(Megatron-LM requires it too); use a global batch giving a multiple of {pp} "
                          f"micro-batches, or train.virtual_stages=1")


def check_virtual_stages(recipe: Recipe, pp: int, microbatches: int) -> None:
    """train.virtual_stages > 1 (interleaved 1F1B, launch/engine/interleaved.py): what its order needs,
    what it does not run (ZB-H1, a train.partition list that leaves a chunk empty) and what it has not
    been checked with (a parity test against v = 1: compiled blocks), each in one line: a run must not
    train something else than the recipe says."""
    train_cfg, model = recipe.train, recipe.model
    v, blocks = train_cfg.virtual_stages, model.n_layer
    check_interleaving(pp, v, microbatches)
    if blocks < pp * v:
        raise ConfigError(f"train.virtual_stages={v} with --pp {pp}: model.n_layer={blocks} blocks are fewer than "
                          f"the pp x v = {pp * v} chunks; choose v with pp x v at most {blocks}")
    if train_cfg.partition == "blocks" and blocks % (pp * v):
        raise ConfigError(f"train.virtual_stages={v} with --pp {pp} and train.partition=blocks: model.n_layer={blocks} "
                          f"blocks do not divide into pp x v = {pp * v} equal chunks; choose v with pp x v dividing "
                          f"{blocks}, or train.partition=balanced")
    if train_cfg.schedule == "zb-h1":  # its W passes per chunk are ZB-V's placement, another schedule
        raise ConfigError(f"train.virtual_stages={v} with train.schedule=zb-h1: interleaved stages run 1F1B only "
                          f"(zero-bubble over chunks is ZB-V, not implemented); use train.virtual_stages=1 or "
                          f"train.schedule=1f1b")
    counts = train_cfg.partition  # blocks per rank, split over its chunks (launch/analysis/partition.py: chunk_blocks)
    if isinstance(counts, list) and min(counts[:-1] + [counts[-1] + 1]) < v:
        raise ConfigError(f"train.virtual_stages={v} with train.partition={counts}: each rank's blocks are split "
                          f"over its {v} chunks, so each rank needs at least {v} blocks (the last rank {v - 1}: its "
                          f"last chunk may hold only the head); give more, or train.partition=balanced")
    # No parity test against v = 1 in the suite: it compiles every block cold (docs/pipeline-schedules.md).
    if train_cfg.compile:
        raise ConfigError(f"train.virtual_stages={v} with train.compile: interleaved stages have no parity test "
                          f"against v = 1 with compiled blocks (docs/pipeline-schedules.md); use "
                          f"train.virtual_stages=1 or train.compile=false")


def check_tensor_split(model: ModelConfig, tp: int) -> None:
    """The MLP width and the key/value heads of a valid model (ModelConfig.validate) against --tp."""
    full = model.resolved()  # the arch preset's switches filled in
    if full.ffn_hidden_size < 1 or full.ffn_hidden_size % tp:
        raise ConfigError(f"model.ffn_hidden_size={full.ffn_hidden_size} must be >= 1 and divisible by --tp {tp} "
                          f"(each rank holds ffn_hidden_size/tp of the MLP); choose a multiple of {tp}")
    kv = full.n_kv_head
    if kv % tp and tp % kv:
        raise ConfigError(f"model.n_kv_head={kv} with --tp {tp}: tp must divide n_kv_head (each rank holds its "
                          f"own key/value heads) or n_kv_head must divide tp (tp/n_kv_head ranks share one); "
                          f"choose --tp among the divisors or multiples of {kv}")
    if full.qk_norm == "projection" and kv % tp:
        raise ConfigError(f"model.qk_norm=projection with model.n_kv_head={kv} and --tp {tp}: the key norm over the "
                          f"whole projection needs whole key/value heads on every TP rank; choose --tp among the "
                          f"divisors of {kv}")
    if tp > kv and full.head_dim % (tp // kv):
        raise ConfigError(f"model.n_kv_head={kv} with --tp {tp}: the {tp // kv} ranks sharing a key/value head "
                          f"each hold 1/{tp // kv} of its {full.head_dim} rows, which does not divide; choose a "
                          f"smaller --tp")


def check_partition(partition: Union[str, Sequence[int]], n_layer: int, pp: int) -> None:
    """Raise ConfigError naming the value and the fix unless `partition` is a rule of PARTITION_RULES
    or pp numbers of blocks summing to n_layer, each >= 1 but the last, which may be 0."""
    if isinstance(partition, str):
        if partition not in PARTITION_RULES:
            raise ConfigError(f"train.partition={partition!r} is not one of {', '.join(PARTITION_RULES)} or a list "
                              f"of blocks per stage (e.g. [3, 1])")
        return
    counts = list(partition)
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in counts):
        raise ConfigError(f"train.partition={counts!r}: blocks per stage must be whole numbers, e.g. [3, 1]")
    # The last stage may hold only the final norm and the head (worth it for a large vocabulary);
    # a first stage of only the embeddings hangs DeepSpeed 0.19.8's pipeline engine at pp=2 (tried).
    if len(counts) != pp or sum(counts) != n_layer or min(counts[:-1] + [1]) < 1 or min(counts, default=0) < 0:
        raise ConfigError(f"train.partition={counts!r} with --pp {pp} and model.n_layer={n_layer}: give {pp} numbers "
                          f"of blocks per stage summing to {n_layer}, each >= 1 (the last may be 0), or balanced, "
                          f"blocks")
