"""Loss and perplexity of given weights (a checkpoint, or GPT-2- or Llama-format transformers
weights) at any layout, through the training pipeline code (`build_pipeline`, `engine.eval_batch`).

The weights decide the model's shape (the checkpoint's recipe, or the transformers config); the recipe
decides the data and the batch. A checkpoint's shards are merged and re-split for this layout
(model/hf/convert.py), so every layout gives the same numbers. The data: the first n global batches
of the validation windows, or of the training stream when the recipe holds out no validation data.
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Tuple

from launch.analysis.partition import with_stage_boundaries
from launch.config.cli import DEFAULT_RECIPE
from launch.config.layout import Layout, check_and_derive_layout
from launch.config.recipe import Recipe, load_recipe
from launch.engine.distributed import ensure_single_process_env, on_cpu
from launch.errors import ConfigError
from launch.feed.run_inputs import load_run_data
from model.config import SHAPE_FIELDS

if TYPE_CHECKING:  # annotations only: no import cost at run time
    from deepspeed.pipe import PipelineModule
    from model.config import GPTConfig
    from model.parallel.state import ParallelState


@dataclass(frozen=True, kw_only=True)
class EvaluationJob:
    """A checked evaluation, ready to start its process group."""
    args: argparse.Namespace
    recipe: Recipe
    layout: Layout
    data: Any
    """data/pipeline.py's RunData."""
    vocab_size: int
    n_batches: int
    """Global batches to average over."""
    tasks: List[Tuple[str, List[Any]]] = ()
    """(name, data/multiple_choice.py Examples) of each --tasks item."""


def as_overrides(values: Dict[str, Any], prefix: str) -> List[str]:
    """{'model': {'n_layer': 4}} -> ['model.n_layer=4']: `--set` items (JSON is YAML)."""
    out = []
    for key, value in values.items():
        if isinstance(value, dict):
            out += as_overrides(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}={json.dumps(value)}")
    return out


def evaluation_recipe(args: argparse.Namespace) -> Recipe:
    """The recipe: the weights' model shape, the data and batch of --recipe (or the checkpoint's),
    then --set; read from complete.json or config.json only, no weights yet."""
    if args.load is not None:
        from launch.checkpoints.locate import find_checkpoint
        saved = find_checkpoint(args.load).meta["recipe"]
        weights = as_overrides(saved if args.recipe is None else {"model": saved["model"]}, "")
        shape = {k: saved["model"][k] for k in SHAPE_FIELDS}
    else:
        from launch.checkpoints.hf_weights import hf_model_fields, read_hf_config
        shape = hf_model_fields(read_hf_config(args.init_from_hf))
        weights = as_overrides({"model": shape}, "")
    # The weights' shape first, the user's --set last: a --set model.* that contradicts the
    # weights is caught below instead of silently ignored.
    # Any cp and ep: the weights do not depend on them (a checkpoint's experts are re-split, as its TP shards).
    layout = [f"train.{key}={getattr(args, key)}" for key in ("cp", "ep") if getattr(args, key, None) is not None]
    recipe = load_recipe(args.recipe or DEFAULT_RECIPE, weights + args.overrides + layout)
    for key, value in shape.items():
        if getattr(recipe.model, key) != value:
            raise ConfigError(f"model.{key}={getattr(recipe.model, key)!r} but the weights have {value!r}: "
                              f"the weights decide the model's shape; drop --set model.{key}")
    return recipe


def load_weights(pipe: PipelineModule, args: argparse.Namespace, config: GPTConfig, state: ParallelState) -> None:
    """This rank's shards of the checkpoint (merged, re-split for this layout) or HF weights."""
    if args.init_from_hf is not None:
        from launch.checkpoints.hf_weights import init_from_hf
        init_from_hf(pipe, args.init_from_hf, config, state)
        return
    from launch.checkpoints.hf_export import read_checkpoint_weights
    from model.hf.convert import load_dense_into
    _, _, dense = read_checkpoint_weights(args.load)  # every expert included (expert_files.read_layer_files)
    load_dense_into(pipe, dense, config, state.tp_rank, state.tp_size, config.padded_vocab_size(state.tp_size),
                    state.ep_rank, state.ep_size)


def evaluate_weights(job: EvaluationJob) -> Dict[str, Any]:
    """Loss and perplexity of the job's weights over its n_batches global batches; rank 0 prints them
    (and writes --json-out)."""
    args, recipe, layout, data, n_batches = job.args, job.recipe, job.layout, job.data, job.n_batches
    import deepspeed

    from launch.engine.distributed import shut_down_distributed, start_rank
    from launch.engine.ds_config import evaluation_config
    from launch.evaluation.validation import mean_loss, perplexity
    from launch.instruments.metrics import is_logging_rank
    from model.parallel.state import init_parallel_state
    from model.gpt.pipe import build_pipeline

    start_rank(layout.world_size, recipe.train.dist_timeout_s)
    experts = recipe.model.moe.enabled
    state = init_parallel_state(layout.tp, layout.pp, layout.cp, layout.ep, experts=experts)
    if experts:  # as the training engine: DeepSpeed's expert groups from our topology (launch/engine/experts.py)
        from launch.engine.experts import register_expert_groups
        register_expert_groups(state)
    config = recipe.gpt_config(job.vocab_size, data.tokenizer.eos_token_id)
    pipe = build_pipeline(config, state, parts=layout.parts or None)
    load_weights(pipe, args, config, state)
    # No optimizer: the pipeline engine needs one for train_batch only. fp32 whatever the
    # recipe trains in, so every layout and the transformers model agree to rounding.
    engine, _, _, _ = deepspeed.initialize(model=pipe, config=evaluation_config(recipe, layout))
    on_validation = data.has_validation

    def loss_over(batches) -> float:
        return mean_loss(engine, batches, n_batches, state, layout.grad_accum_steps)

    if on_validation:  # a mixture: each source's own loss, then their weighted mean; bits per byte weighted alike
        from data.bits_per_byte import validation_loss_and_bpb
        loss, by_source, bpb = validation_loss_and_bpb(
            data, lambda part: loss_over(part.val_batches(state.dp_rank, layout.dp, n_batches)),
            lambda part: n_batches, with_bpb=is_logging_rank(state.global_rank))
    else:
        loss, by_source, bpb = loss_over(data.train_batches(state.dp_rank, layout.dp)), None, None
    result = {"loss": loss, "ppl": perplexity(loss), "batches": n_batches,
              "tokens": n_batches * layout.global_batch_size * recipe.seq_len,
              "data": "validation" if on_validation else "train", "source": str(args.load or args.init_from_hf),
              "layout": vars(layout)}
    if by_source is not None:
        result["loss_by_source"] = by_source
    if is_logging_rank(state.global_rank):
        if bpb is not None:  # bits per byte (data/bits_per_byte.py)
            result["bpb"] = bpb
        print(f"loss {loss:.6f} ppl {result['ppl']:.4f}" + (f" bpb {result['bpb']:.6f}" if on_validation else "")
              + f" ({n_batches} global batches of {result['data']} data, "
              f"tp={layout.tp} cp={layout.cp} pp={layout.pp} dp={layout.dp}"
              + (f" ep={layout.ep}" if experts else "") + ")", flush=True)
        for label, source_loss in (by_source or {}).items():
            print(f"  {label}: loss {source_loss:.6f} ppl {perplexity(source_loss):.4f}", flush=True)
        if args.json_out is not None:
            args.json_out.write_text(json.dumps(result, indent=1) + "\n")
    if job.tasks:
        result["tasks"] = score_tasks(job, engine, state, data.tokenizer, is_logging_rank(state.global_rank))
    shut_down_distributed()
    return result


def score_tasks(job: EvaluationJob, engine, state: ParallelState, tokenizer, logging: bool) -> List[Dict[str, Any]]:
    """Each task's acc, acc_norm and n (launch/evaluation/task_scoring.py); rank 0 prints a line per
    task and appends its record to --metrics-out."""
    import torch

    from deepspeed.accelerator import get_accelerator
    from launch.evaluation.task_scoring import score_tasks as score
    from launch.evaluation.task_scoring import task_sequences
    device = torch.device(get_accelerator().current_device_name())
    scores = score(engine, state, job.layout, task_sequences(job.tasks, tokenizer, job.recipe.seq_len), device)
    records = [{"task": name, **values} for name, values in scores.items()]
    if logging:
        for record in records:
            print(f"{record['task']}: acc {record['acc']:.4f} acc_norm {record['acc_norm']:.4f} n {record['n']}",
                  flush=True)
            if job.args.metrics_out is not None:
                with open(job.args.metrics_out, "a") as out:
                    out.write(json.dumps(record) + "\n")
    return records


def prepare_evaluation(args: argparse.Namespace) -> EvaluationJob:
    """Raise ConfigError or DataError (one line) on the first bad input, before any process group."""
    recipe = evaluation_recipe(args)
    ensure_single_process_env()
    layout = check_and_derive_layout(recipe, int(os.environ["WORLD_SIZE"]), args.tp, args.pp, on_cpu())
    tasks = read_tasks(args)  # before the data: a bad task file costs nothing
    data, vocab_size = load_run_data(recipe, layout)
    layout = with_stage_boundaries(layout, recipe, vocab_size)  # the training run's cut of the pipeline
    if args.init_from_hf is not None:  # the parts of its config the shape check above does not see
        from launch.checkpoints.hf_weights import check_hf_source
        check_hf_source(args.init_from_hf, recipe.gpt_config(vocab_size, data.tokenizer.eos_token_id),
                        resuming=False)
    wanted = recipe.train.eval_batches if args.batches is None else args.batches
    if wanted < 1:
        raise ConfigError(f"--batches {wanted} must be >= 1")
    n_batches = data.eval_global_batches(wanted) if data.has_validation else wanted
    if n_batches < 1:
        raise ConfigError(f"the validation data holds fewer windows than one global batch "
                          f"({layout.global_batch_size}); raise data.val_fraction or lower train.global_batch_size")
    return EvaluationJob(args=args, recipe=recipe, layout=layout, data=data, vocab_size=vocab_size,
                         n_batches=n_batches, tasks=tasks)


def read_tasks(args: argparse.Namespace) -> List[Tuple[str, List[Any]]]:
    """--tasks NAME=PATH items as (name, examples); a bad item is one line before any process group."""
    from data.multiple_choice import read_tasks as read_task_files
    if args.max_examples < 0:
        raise ConfigError(f"--max-examples {args.max_examples} must be >= 0 (0: every example)")
    tasks = read_task_files(args.tasks, args.max_examples, "--tasks")
    if args.metrics_out is not None and not args.metrics_out.parent.is_dir():
        raise ConfigError(f"--metrics-out {str(args.metrics_out)!r}: folder {str(args.metrics_out.parent)!r} "
                          f"does not exist")
    return tasks
