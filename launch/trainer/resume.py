"""Resuming a run: load the checkpoint into the built engine (re-sharded for this layout and ZeRO
stage where they changed), and say on the logging rank what changed."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Tuple

from launch.checkpoints import store
from launch.checkpoints.locate import same_layout, saved_zero_stage
from launch.checkpoints.safe_io import each_file_loaded

if TYPE_CHECKING:  # annotations only: no import cost at run time
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from launch.checkpoints.locate import CheckpointRef
    from launch.config.layout import Layout
    from model.config import GPTConfig
    from model.parallel.state import ParallelState


def restore(engine: PipelineEngine, resume_from: Optional[CheckpointRef], layout: Layout, state: ParallelState,
            config: GPTConfig, logging_rank: bool, progress: Callable[[], None] = lambda: None) -> Tuple[int, int]:
    """(first step to train, samples consumed so far): (1, 0), or after the checkpoint's step;
    `progress()` after each file read."""
    if resume_from is None:
        return 1, 0
    with each_file_loaded(progress):
        client_state = store.load(engine, resume_from, vars(layout), state, config)
    step, samples = client_state["step"], client_state["samples"]
    if logging_rank:
        saved = resume_from.meta["layout"]
        stages = (saved_zero_stage(resume_from.meta), engine.zero_optimization_stage())
        print(f"resumed from {resume_from.path} at step {step} ({samples} samples consumed)"
              + ("" if stages[0] == stages[1] else f", ZeRO-{stages[0]} state re-sharded for ZeRO-{stages[1]}")
              + ("" if same_layout(saved, vars(layout)) else
                 f", re-sharded from tp={saved['tp']} pp={saved['pp']} dp={saved['dp']}"
                 + "".join(f" {key}={saved[key]}" for key in ("cp", "ep", "virtual_stages")
                           if getattr(layout, key) > 1 or saved[key] > 1) + " "
                 f"(stage boundaries {list(saved['parts'])} -> {list(layout.parts)})"), flush=True)
    return step + 1, samples
