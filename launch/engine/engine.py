"""The run's model inside its DeepSpeed engine: the PipelineModule (seeded, or from transformers
weights), AdamW with its parameter groups and the LR schedule; the one builder of the training
run, the benches and the tests. Building prints nothing; the run prints the role map after it."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, List, Optional, Tuple

from launch.config.layout import Layout, runs_zero_bubble
from launch.config.recipe import Recipe

if TYPE_CHECKING:  # annotations only: no import cost at run time
    import torch
    from model.config import GPTConfig
    from model.parallel.state import ParallelState


def print_role_map(recipe: Recipe, layout: Layout, state: ParallelState, config: GPTConfig,
                   pipe: torch.nn.Module) -> None:
    """The groups, each stage's layers with its part of the predicted compute per micro-batch
    (launch/analysis/partition.py), the activations' shape and the schedule."""
    from launch.analysis.partition import stage_flops
    from model.gpt.pipe import stage_contents

    def groups(lists):
        return " ".join(str(g) for g in lists)
    train_cfg = recipe.train
    flops = [sum(f) for f in stage_flops(config, pipe.parts, layout.micro_batch_size, recipe.seq_len,
                                         train_cfg.recompute == "full")]
    cp = layout.cp
    print(f"layout: world {layout.world_size} = tp {layout.tp} x " + (f"cp {cp} x " if cp > 1 else "")
          + f"pp {layout.pp} x dp {layout.dp} (axis order pipe, data, model: TP ranks adjacent"
          + (", then CP)" if cp > 1 else ")") + "\n"
          f"  TP groups  (split each weight matrix):  {groups(state.tp_groups)}\n"
          + (f"  CP groups  (split each sequence, all-to-all in attention): {groups(state.cp_groups)}\n"
             if cp > 1 else "")
          + f"  pipelines  (split the layers, stage 0 first): {groups(state.pipelines)}\n"
          "  DP groups  (split the data, all-reduce grads" + (" over dp x cp" if cp > 1 else "") + "): "
          f"{groups(state.dp_groups)}"
          + (f"\n  EP groups  (split the experts, all-to-all tokens): {groups(state.ep_groups)}" if layout.ep > 1 else ""))
    for stage, contents in stage_contents(pipe, config):
        print(f"  stage {stage}: {contents} | {flops[stage] / sum(flops):.0%} of the predicted compute")
    b, seq_len = layout.micro_batch_size, recipe.seq_len
    seq_local, per_cp = seq_len // cp, "/cp" if cp > 1 else ""  # each CP rank its shard of every sequence
    shard = f"(b, T{per_cp}/tp, h) = ({b}, {seq_local // layout.tp}, h): sequence parallel" \
        if recipe.model.sequence_parallel and layout.tp > 1 else f"(b, T{per_cp}, h) = ({b}, {seq_local}, h)"
    schedule = train_cfg.schedule if runs_zero_bubble(train_cfg.schedule, layout.pp) or train_cfg.schedule == "1f1b" \
        else f"1f1b ({train_cfg.schedule} needs pp > 1)"
    if train_cfg.virtual_stages > 1:
        schedule = f"interleaved 1f1b, {train_cfg.virtual_stages} chunks per rank"
    print(f"activations: {shard} per rank between TP linears and across stages; recompute {train_cfg.recompute}; "
          f"schedule {schedule}", flush=True)


def param_groups(module: torch.nn.Module, experts: bool = False, muon: bool = False) -> List[dict]:
    """AdamW decays matrices and embeddings, not biases or LayerNorm (GPT-2 / nanoGPT). With
    `muon`, the hidden matrices first, in a group of Muon's (launch/optim/muon_matrices.py), empty
    groups left out. With `experts`, the expert parameters in groups of their own (launch/engine/experts.py)."""
    params = [p for p in module.parameters() if p.requires_grad]
    if muon:
        groups, names = _muon_param_groups(module, params), ("muon", "adamw")
    else:
        groups, names = [{"params": [p for p in params if p.dim() >= 2]},
                         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], ("decay", "no_decay")
    if not experts:
        return groups
    from launch.engine.experts import expert_param_groups  # DeepSpeed's split keys the groups by name
    return expert_param_groups([dict(group, name=name) for group, name in zip(groups, names)])


def _muon_param_groups(module: torch.nn.Module, params: List[torch.nn.Parameter]) -> List[dict]:
    """Muon's matrices, then everything else in one AdamW group that decays only the >= 2-D ones
    (launch/optim/muon.py). Two groups on every stage: DeepSpeed's ZeRO-1 all-reduces each group's
    gradient norm over the pipeline's stages, group by group, so every stage must hold as many groups
    (a middle stage has no embedding: a decay group of AdamW's own would be missing there, and hang)."""
    from launch.optim.muon_matrices import muon_matrices
    matrices = muon_matrices(module)
    # A stage without a block is refused in one line before any engine (launch/config/recipe.py
    # for a train.partition list, launch/analysis/partition.py: check_muon_stages for any cut).
    assert matrices, "train.optimizer=muon needs a transformer block on every pipeline stage"
    return [{"params": matrices, "muon": True}, {"params": [p for p in params if all(p is not m for m in matrices)]}]


def build_engine(recipe: Recipe, layout: Layout, state: ParallelState, config: GPTConfig, compiled: bool = False,
                 init_from_hf: Optional[str] = None, verbose: bool = False,
                 optimizer: Optional[Callable[[List[dict]], torch.optim.Optimizer]] = None) -> Tuple[Any, Any]:
    """(engine, own grad norm): the run's PipelineModule (seeded init, or `init_from_hf` weights;
    each block compiled if `compiled`, launch/engine/compiler.py decides) inside a DeepSpeed
    engine with AdamW or Muon (train.optimizer; or `optimizer`, built from the parameter groups: the tests' SGD), ZeRO,
    clipping and the LR schedule; and, for fp32 ZeRO-0, our own gradient norm and clipping
    (launch/optim/grad_norm.py), else None."""
    import deepspeed

    from launch.analysis.engine_memory import reduces_gradients
    from launch.engine.console import quiet_stdout
    from launch.engine.ds_config import deepspeed_config
    from launch.engine.zero_bubble import use_zero_bubble_schedule
    from launch.optim.grad_norm import Zero0GradNorm, uses_own_grad_norm
    from launch.optim.lr_schedule import warmup_cosine
    from launch.optim.main_grad import attach_main_grads
    from model.gpt.compiled import compile_blocks
    from model.gpt.pipe import build_pipeline
    from model.parallel.weight_grad import WEIGHT_GRADS

    train_cfg = recipe.train
    zero_bubble = runs_zero_bubble(train_cfg.schedule, layout.pp)  # at pp = 1 there is no bubble: 1F1B runs
    WEIGHT_GRADS.enabled = zero_bubble  # before the first forward: the linears read it there
    experts = config.moe.enabled
    if experts:  # before deepspeed.initialize, which reduces and partitions by these groups
        from launch.engine.experts import register_expert_groups
        register_expert_groups(state)
    with quiet_stdout(not verbose):  # DeepSpeed's own layer listing: the role map shows it
        checkpoint_every = 1 if train_cfg.recompute == "full" else 0  # full recompute: every block's input
        parts = layout.parts or None
        if train_cfg.virtual_stages > 1:  # pp x v stages, v chunks per rank (launch/engine/interleaved.py)
            if not layout.chunk_parts:  # one home for the cut: the checkpoint records these very boundaries
                raise ValueError("virtual_stages > 1 needs the layout's chunk boundaries "
                                 "(launch/analysis/partition.py: with_stage_boundaries)")
            parts = list(layout.chunk_parts)
        pipe = build_pipeline(config, state, checkpoint_every, parts=parts, virtual_stages=train_cfg.virtual_stages)
    if compiled:  # in place, before DeepSpeed wraps the module: each block compiles on its first call
        compile_blocks(pipe)
    if init_from_hf is not None:  # before deepspeed.initialize: the optimizer starts from them
        from launch.checkpoints.hf_weights import init_from_hf as load_hf_weights
        load_hf_weights(pipe, init_from_hf, config, state)
    ds_config = deepspeed_config(recipe, layout)
    own_norm = uses_own_grad_norm(ds_config["zero_optimization"]["stage"], train_cfg.precision)
    if own_norm:  # DeepSpeed's fp32 ZeRO-0 clipping miscounts across stages: ours clips instead
        ds_config["gradient_clipping"] = 0.0
    muon = train_cfg.optimizer == "muon" and optimizer is None
    if muon:  # our optimizer inside DeepSpeed's wrapper (launch/optim/muon.py)
        from launch.optim.muon import muon_factory
        optimizer = muon_factory(train_cfg, state.tp_group)
    engine, _, _, _ = deepspeed.initialize(
        model=pipe, model_parameters=param_groups(pipe, experts, muon), config=ds_config, optimizer=optimizer,
        lr_scheduler=warmup_cosine(train_cfg.warmup_steps, train_cfg.steps, train_cfg.min_lr_ratio))
    if not reduces_gradients(train_cfg.precision, engine.zero_optimization_stage(), layout.dp * layout.cp):
        engine.pipeline_enable_backward_allreduce = False  # one data rank: a sum of one is itself
    if muon:  # before the first step: where DeepSpeed's flat partitions put each matrix
        from launch.optim.muon_partitions import bind_muon_partitions
        bind_muon_partitions(engine.optimizer)
    if train_cfg.grad_accum_fusion:  # bf16: the linears add their weight gradients into the fp32 buffer
        attach_main_grads(engine.optimizer)
    if zero_bubble:
        use_zero_bubble_schedule(engine)
    if train_cfg.virtual_stages > 1:  # interleaved 1F1B (launch/engine/interleaved.py)
        from launch.engine.interleaved import use_interleaved_schedule
        use_interleaved_schedule(engine, train_cfg.virtual_stages)
    grad_norm = Zero0GradNorm(engine, state.tp_rank, train_cfg.grad_clip, state.ep_group) if own_norm else None
    return engine, grad_norm
