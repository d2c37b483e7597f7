"""Everything a training job checks before its first collective (exit 2 on bad input, nothing
written yet): recipe, layout, precision, paths, checkpoint to resume, tokenizer and data."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from data.fingerprint import data_fingerprint
from launch.analysis.partition import check_muon_stages, with_stage_boundaries
from launch.config.cli import training_recipe
from launch.config.layout import Layout, check_and_derive_layout, runs_zero_bubble
from launch.config.recipe import Recipe
from launch.engine.distributed import (check_precision_supported, ensure_open_file_limit,
                                        ensure_single_process_env, on_cpu)
from launch.errors import AlreadyFinished, ConfigError
from launch.feed.run_inputs import load_run_data, resolved_recipe_dict

if TYPE_CHECKING:  # annotations only: data/pipeline.py imports torch
    from data.pipeline import RunData
    from launch.checkpoints.locate import CheckpointRef


@dataclass(frozen=True, kw_only=True)
class TrainingJob:
    """A checked training job, ready to start its process group."""
    args: argparse.Namespace
    recipe: Recipe
    layout: Layout
    data: RunData
    """What data/run.py's prepare_run_data returns: one source (SourceData) or a mixture (MixtureData)."""
    vocab_size: int
    resume_from: Optional[CheckpointRef] = None
    """The checkpoint to resume from, or None."""
    data_fingerprint: Dict[str, Any]
    """What decides the samples of each step (data/fingerprint.py), saved with every checkpoint."""
    data_state: Optional[dict] = None
    """The streams' position to continue from (None: fresh, cached data, or --restart-data)."""
    data_origin_samples: int = 0
    """Samples trained before the current data order began (a --restart-data resume's)."""
    tasks: List[Tuple[str, List[Any]]] = ()
    """eval.tasks read: (name, data/multiple_choice.py Examples) of each."""
    layout_choice: Optional[Any] = None
    """--layout auto's pick (launch/autotune/auto_layout.py: AutoChoice), None for a layout given."""
    remote_save: Optional[Any] = None
    """--save on object storage (launch/checkpoints/object_store.py: RemoteDir; args.save is its
    local staging directory), None for a local --save."""


def prepare_training_job(args: argparse.Namespace, recipe: Optional[Recipe] = None) -> TrainingJob:
    """Raise ConfigError or DataError (one line) on the first bad input; move files only last.
    `recipe`: the recipe of `args` if already read (launch/train.py reads it before importing torch)."""
    recipe = recipe if recipe is not None else training_recipe(args)
    ensure_single_process_env()
    tp, pp, layout_choice = args.tp, args.pp, None
    if args.layout == "auto":  # the planner's pick for these processes, the same on every rank
        from launch.autotune.auto_layout import auto_layout
        from launch.feed.run_inputs import load_checked_tokenizer
        recipe, layout_choice = auto_layout(args, recipe, int(os.environ["WORLD_SIZE"]),
                                            load_checked_tokenizer(recipe)[1], on_cpu())
        tp, pp = layout_choice.tp, layout_choice.pp
    layout = check_and_derive_layout(recipe, int(os.environ["WORLD_SIZE"]), tp, pp, on_cpu())
    check_precision_supported(recipe.train.precision)
    from launch.engine.ds_config import check_deepspeed_section
    check_deepspeed_section(recipe, layout)
    ensure_open_file_limit(layout.world_size, int(os.environ["RANK"]))
    if runs_zero_bubble(recipe.train.schedule, layout.pp):
        from launch.engine.zero_bubble import check_deepspeed_hooks
        check_deepspeed_hooks(layout.pp)
    if args.save is not None or args.load is not None:  # s3:// and gs://: local staging directories from here
        from launch.checkpoints.object_store import stage
        remote_save = stage(args)
    else:
        remote_save = None
    from launch.trainer.preflight import check_before_start
    check_before_start(recipe, args.metrics_out, args.save, args.timeline, args.comm_counts)
    from data.multiple_choice import read_tasks  # before the training data: a bad task file costs nothing
    tasks = read_tasks(recipe.eval.tasks, recipe.eval.max_examples, "eval.tasks")
    resume_from = None
    if args.load is not None:
        from launch.checkpoints.locate import find_resume_point
        resume_from = find_resume_point(args.load, args.save, is_writer=os.environ["RANK"] == "0")
    if args.save is not None:  # before the data: another run's checkpoints there cost nothing to refuse
        from launch.checkpoints.locate import refuse_another_runs_save_dir
        refuse_another_runs_save_dir(args.save, resume_from)
    from launch.resilience.restarts import refuse_a_requeue_loop  # before the data: a refused requeue costs nothing
    refuse_a_requeue_loop(args.save, args.load, resume_from, recipe.train.max_starts_without_progress)
    if resume_from is not None and not args.restart_data:  # an unpinned hub source: the commit it trained on
        from data.fingerprint import at_saved_commit
        recipe.data = at_saved_commit(recipe.data, resume_from.meta["data_fingerprint"])
    data, vocab_size = load_run_data(recipe, layout)
    layout = with_stage_boundaries(layout, recipe, vocab_size)  # the stage boundaries need the vocabulary
    check_muon_stages(recipe, layout, vocab_size)
    if args.init_from_hf is not None:
        from launch.checkpoints.hf_weights import check_hf_source
        check_hf_source(args.init_from_hf, recipe.gpt_config(vocab_size, data.tokenizer.eos_token_id),
                        resuming=resume_from is not None)
    fingerprint, data_state, origin = data_fingerprint(data), None, 0
    if resume_from is not None:
        from launch.checkpoints.locate import check_compatible, data_position
        check_compatible(resume_from, resolved_recipe_dict(recipe, vocab_size), vars(layout))
        try:
            data_state, origin = data_position(resume_from, fingerprint, args.restart_data)
            data.check_data_state(data_state, resume_from.meta["samples"] - origin)
        except (KeyError, TypeError, AttributeError, IndexError) as e:  # what complete.json's check leaves to data/
            raise ConfigError(f"checkpoint {str(resume_from.path)!r} has a data position or fingerprint this "
                              f"version cannot read ({type(e).__name__}: {str(e)[:200]}); resume with "
                              f"--restart-data, or load another checkpoint") from None
        if resume_from.meta["step"] >= recipe.train.steps and args.save is not None \
                and args.load.resolve() == args.save.resolve():  # a requeue after the end: done, not wrong
            raise AlreadyFinished(f"checkpoint {str(resume_from.path)!r} is at step {resume_from.meta['step']} of "
                                  f"--steps {recipe.train.steps}: the run has finished, nothing to do")
        if resume_from.meta["step"] >= recipe.train.steps:
            raise ConfigError(f"checkpoint {str(resume_from.path)!r} is at step {resume_from.meta['step']}, "
                              f"not before --steps {recipe.train.steps}: nothing to train")
    elif args.restart_data:
        raise ConfigError("--restart-data restarts the data order of a resumed run: it needs --load")
    if args.save is not None:  # last: only a run that passed every check moves files
        from launch.checkpoints.store import prepare_save_dir
        prepare_save_dir(args.save, resume_from, is_writer=os.environ["RANK"] == "0")
        if remote_save is not None:
            remote_save.prepare(resume_from, is_writer=os.environ["RANK"] == "0")
    return TrainingJob(args=args, recipe=recipe, layout=layout, data=data, vocab_size=vocab_size,
                       resume_from=resume_from, data_fingerprint=fingerprint, data_state=data_state,
                       data_origin_samples=origin, layout_choice=layout_choice, tasks=tasks,
                       remote_save=remote_save)
