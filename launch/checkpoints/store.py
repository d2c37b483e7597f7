"""Checkpoints: DeepSpeed's engine state plus ours, committed atomically (docs/checkpoints.md).

A save directory:
    DIR/latest                     the tag of the newest complete checkpoint (atomic rename)
    DIR/step00000042/              DeepSpeed's files (per-layer weights, ZeRO optimizer partitions,
                                   LR scheduler, loss scaler) and our client state (step, samples
                                   consumed, resolved recipe)
    DIR/step00000042/rng/rank_N.pt the RNG states of global rank N (dropout replay)
    DIR/step00000042/experts/      a mixture-of-experts model's expert weights, one file per
                                   (pipeline layer, TP rank, EP rank), named by the global expert
                                   ids it holds (expert_files.py); the layer files hold the rest
    DIR/step00000042/complete.json written last, by rank 0, after every rank has saved and fsynced:
                                   its format, step, layout, resolved recipe, every file's size,
                                   the parent (locate.py: REQUIRED)
    DIR/abandoned-<UTC time>/      tags after the one a run resumed from, moved aside at start
Nothing outside DIR is moved or deleted: only its own tag and abandoned-* directories (no links),
and a save into a directory of another run's checkpoints, or through a link named as a tag, is refused.
`--load` takes only complete checkpoints, and an unreadable manifest or `latest` is an error;
`--keep-last K` keeps the K newest of the parent chain. Loads are torch.load(weights_only=True).
With train.async_save the same files and the same commit come from a background writer
(async_save.py), after a host snapshot. A save directory on object storage (s3://, gs://) is a
local staging directory committed as above, then uploaded in commit order (object_store.py), by
the background writer too with train.async_save."""
from __future__ import annotations

import contextlib
import json
import shutil
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch
import torch.distributed as dist

from launch.checkpoints import slow_save, zero0_state
from launch.checkpoints.commit_guard import committing
from launch.checkpoints.async_save import AsyncSaver
from launch.checkpoints.expert_files import experts_apart, has_experts, load_experts, save_experts
from launch.checkpoints.locate import (LATEST, CheckpointRef, history, not_a_tag_dir, resumes_from, same_layout,
                                       saved_zero_stage, step_of, tag_for)
from launch.checkpoints.manifest import CHECKPOINT_FORMAT, COMPLETE, ENGINE_ZERO_STAGE
from launch.checkpoints.safe_io import (SafeCheckpointEngine, fsync_dir, load_safely, save_durably, use_safe_engine,
                                       write_durably)
from launch.errors import ConfigError

if TYPE_CHECKING:  # annotations only: no import cost at run time
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from launch.checkpoints.object_store import RemoteDir
    from model.config import GPTConfig
    from model.parallel.state import ParallelState


def _rng_state() -> Dict[str, Any]:
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker
    return {"cpu": torch.get_rng_state(), "accelerator": get_accelerator().get_rng_state(),
            "tracker": get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: Dict[str, Any]) -> None:
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker
    torch.set_rng_state(state["cpu"])
    get_accelerator().set_rng_state(state["accelerator"])
    get_cuda_rng_tracker().set_states(state["tracker"])


PRUNING = ".pruning-"  # a pruned tag is renamed to this prefix at once, then deleted in the background
ABANDONED = "abandoned-"  # where a start sets aside the tags after the step it resumed from


def _own(root: Path, entry: Path) -> bool:
    """Whether a run may move or delete `entry`: a directory directly in `root`, named as a tag,
    a set-aside or a pruned one, no symbolic link, and (resolved) inside `root`. Anything else in
    the save directory may be another run's, or a way out of it (a link to elsewhere)."""
    named = step_of(entry.name) is not None or entry.name.startswith((ABANDONED, PRUNING))
    return (named and entry.parent == root and not entry.is_symlink() and entry.is_dir()
            and entry.resolve().parent == root.resolve())


def prepare_save_dir(root: Path, resume_from: Optional[CheckpointRef], is_writer: bool) -> None:
    """Before a run saves into `root`, make its checkpoints after the resumed step T (0 for a
    fresh run) leave: the tag directories of later steps (the history this run abandons by
    resuming an older tag of `root`, or a save cut short) move into root/abandoned-<UTC time>/,
    and `latest` names T's tag if it lies in `root` (else it is removed: nothing in `root`
    continues this run yet). So a save never writes into a directory with another run's files,
    `--load root` never picks the abandoned run, and `--keep-last` prunes this run's history. Only
    the run's own entries move (`_own`); another run's complete checkpoints were refused before
    (locate.refuse_another_runs_save_dir). Called on every rank before torch.distributed starts;
    only the writer (global rank 0) moves, and no rank saves before it has joined them."""
    if not is_writer or not root.is_dir():
        return
    try:
        _set_aside_later_tags(root, resume_from)
    except OSError as e:
        raise ConfigError(f"--save {str(root)!r}: could not move its later checkpoints aside ({e}); "
                          f"move them yourself or save into another directory") from None


def _set_aside_later_tags(root: Path, resume_from: Optional[CheckpointRef]) -> None:
    resumed = resume_from.meta["step"] if resume_from is not None else 0
    later = sorted(p for p in root.iterdir() if (step_of(p.name) or 0) > resumed and _own(root, p))
    in_root = resumes_from(resume_from, root)
    if later:
        aside = root / time.strftime(f"{ABANDONED}%Y%m%dT%H%M%SZ", time.gmtime())
        while aside.exists():
            aside = aside.with_name(aside.name + "-1")
        aside.mkdir()
        for p in later:
            p.rename(aside / p.name)
        fsync_dir(root)
        print(f"checkpoints after step {resumed} moved out of the way into {aside}: "
              f"{', '.join(p.name for p in later)}", flush=True)
    if in_root:
        write_durably(root / LATEST, resume_from.tag)
    elif (root / LATEST).exists():
        (root / LATEST).unlink()
        fsync_dir(root)


def save(engine: PipelineEngine, root: Path, step: int, samples: int, recipe_dict: Dict[str, Any],
         layout: Dict[str, int], keep_last: int, is_writer: bool, wandb_run_id: Optional[str] = None,
         data_state: Optional[Dict[str, Any]] = None, data_identity: Optional[Dict[str, Any]] = None,
         layout_auto: Optional[Dict[str, Any]] = None, saver: Optional[AsyncSaver] = None,
         remote: Optional[RemoteDir] = None) -> Path:
    """Every rank calls this; rank `is_writer` commits (it holds the wandb run, whose id a
    resumed run continues) and then prunes in the background, while the others train on.
    `data_state`: the streaming data position of the whole run (JSON, already gathered from the
    ranks), stored in complete.json for `--load`; `data_identity`: what decides the samples
    (data/fingerprint.py) and where the data order began, which a resume checks (default: no
    fingerprint, the order begun at sample 0, for a save with no data behind it); `layout_auto`:
    how --layout auto chose the layout (launch/autotune/auto_layout.py: AutoChoice); `saver`
    (train.async_save): return after a host snapshot of this rank's files, which `saver` writes and
    commits in the background (async_save.py; the caller has waited for its previous save); `remote`
    (--save s3://...): `root` is its staging directory, and the checkpoint committed there is then
    published to the store (object_store.py). Returns the tag directory."""
    tag = tag_for(step)
    if not_a_tag_dir(root / tag) is not None:  # made since the start (locate.refuse_another_runs_save_dir)
        raise ConfigError(f"--save {str(root)!r}: {not_a_tag_dir(root / tag)}, where this run saves step {step}; "
                          f"remove it and resume with --load {str(root)!r}")
    use_safe_engine(engine)  # each rank fsyncs the files it writes
    client_state = {"step": step, "samples": samples, "recipe": recipe_dict}
    zero_stage = engine.zero_optimization_stage()
    if zero_stage == 0:  # the optimizer state by parameter name, for a re-shard (zero0_state.py)
        client_state.update(zero0_state.client_state(engine))
    experts = has_experts(engine)
    capture = saver.capture(engine) if saver is not None else None
    with experts_apart(engine) if experts else contextlib.nullcontext(), _capturing(engine, capture):
        engine.save_checkpoint(str(root), tag=tag, client_state=client_state, save_latest=False)
    if experts:  # written here in both modes: a rank's experts are a small part of its files
        save_experts(engine, root / tag, layout["ep"])
    rng_dir = root / tag / "rng"
    rng_dir.mkdir(parents=True, exist_ok=True)
    identity = data_identity or {"data_fingerprint": None, "data_origin_samples": 0}
    meta = {"format": CHECKPOINT_FORMAT, "step": step, "samples": samples, "layout": layout,
            "recipe": recipe_dict, ENGINE_ZERO_STAGE: zero_stage, "world_size": dist.get_world_size(),
            "wandb_run_id": wandb_run_id, "data_state": data_state,
            "data_fingerprint": identity["data_fingerprint"], "data_origin_samples": identity["data_origin_samples"],
            "parent": None, "layout_auto": layout_auto}

    def commit() -> None:
        meta["parent"] = _latest_tag(root)  # read at the commit: the previous save's has been committed
        _commit(root, tag, meta)
        _prune_in_background(root, tag, keep_last)
    rng_file = rng_dir / f"rank_{dist.get_rank()}.pt"
    if saver is not None:
        files = capture.files + [(rng_file, saver.snapshot.copy(_rng_state()))]
        publish = None
        if remote is not None:  # the writer's thread uploads after the local commit, agreeing on its own group
            def publish(agree):
                remote.publish(root / tag, meta, keep_last, is_writer, agree=agree)
        saver.start(files, dist.get_rank(), commit if is_writer else None, publish)
        return root / tag
    save_durably(_rng_state(), rng_file)
    slow_save.wait_if_asked(dist.get_rank())  # a test hook, nothing unless GPT3D_SLOW_SAVE is set
    dist.barrier()  # every rank's files are on disk before the checkpoint is declared complete
    if is_writer:
        commit()
    if remote is not None:
        remote.publish(root / tag, meta, keep_last, is_writer)
    return root / tag


@contextlib.contextmanager
def _capturing(engine: PipelineEngine, capture: Optional[SafeCheckpointEngine]):
    """DeepSpeed's save with `capture` (async_save.py) as its checkpoint engine: every file kept as a
    host snapshot; then our safe engine again."""
    if capture is None:
        yield
        return
    safe, engine.checkpoint_engine = engine.checkpoint_engine, capture
    try:
        yield
    finally:
        engine.checkpoint_engine = safe


def _latest_tag(root: Path) -> Optional[str]:
    return (root / LATEST).read_text().strip() if (root / LATEST).exists() else None


def _commit(root: Path, tag: str, meta: Dict[str, Any]) -> None:
    """complete.json (with every file's size), then `latest`; each made durable before the next.
    A rank that leaves meanwhile (commit_guard.py) waits for it to end."""
    with committing():
        _write_commit(root, tag, meta)


def _write_commit(root: Path, tag: str, meta: Dict[str, Any]) -> None:
    tag_dir = root / tag
    meta["files"] = {str(f.relative_to(tag_dir)): f.stat().st_size for f in sorted(tag_dir.rglob("*")) if f.is_file()}
    for d in [tag_dir] + [d for d in tag_dir.rglob("*") if d.is_dir()]:
        fsync_dir(d)  # the entries of the files every rank created
    write_durably(tag_dir / COMPLETE, json.dumps(meta, indent=1))
    fsync_dir(root)  # the tag directory's own entry, before `latest` names it
    write_durably(root / LATEST, tag)


_pruning: Optional[threading.Thread] = None  # the writer's one background deletion


def _prune_in_background(root: Path, tag: str, keep_last: int) -> None:
    """Rename the tags of `tag`'s history beyond the newest `keep_last` out of the tag namespace
    (a rename: instant, and never a half-deleted checkpoint), then delete them in a thread."""
    global _pruning
    if keep_last < 1:
        return
    # This run's history beyond the newest keep_last, and the tags earlier runs left aside at start.
    for old in history(root, tag)[keep_last:] + sorted(root.glob(f"{ABANDONED}*")):
        if _own(root, old):
            old.rename(root / f"{PRUNING}{old.name}-{time.time_ns()}")
    if _pruning is not None:
        _pruning.join()
    doomed = [d for d in root.glob(f"{PRUNING}*") if _own(root, d)]  # also any that a killed run left behind
    if doomed:
        _pruning = threading.Thread(target=_delete, args=(doomed,), name="checkpoint-prune")
        _pruning.start()


def _delete(directories: List[Path]) -> None:
    for d in directories:
        shutil.rmtree(d, ignore_errors=True)


def load(engine: PipelineEngine, ref: CheckpointRef, layout: Dict[str, int], state: ParallelState, config: GPTConfig) -> Dict[str, Any]:
    """Restore the engine and return the client state (step, samples, recipe). At the saved
    layout: DeepSpeed's own loader, this rank's experts (`experts/`) and its RNG states (a bitwise
    continuation). At another: launch/checkpoints/reshard.py re-shards weights and optimizer state,
    experts included (fp32 rounding); so does a change of the engine's ZeRO stage at the saved layout
    (ZeRO-1 saved, ZeRO-0 built: launch/analysis/engine_memory.py: built_zero_stage), which keeps
    the RNG states."""
    layout_kept = same_layout(ref.meta["layout"], layout)
    if not layout_kept or saved_zero_stage(ref.meta) != engine.zero_optimization_stage():
        from launch.checkpoints.reshard import load_resharded
        from model.gpt.pipe import seed_dropout_rngs
        load_resharded(engine, ref.path, ref.meta["layout"], state, config, config.vocab_size,
                       config.padded_vocab_size(state.tp_size))
        if layout_kept:
            _set_rng_state(load_safely(ref.path / "rng" / f"rank_{dist.get_rank()}.pt"))
        else:  # no saved RNG state fits this layout's ranks: new streams, not step 1's masks again
            seed_dropout_rngs(config.seed, state, "resumed", ref.meta["step"])
        return {key: ref.meta[key] for key in ("step", "samples", "recipe")}
    use_safe_engine(engine)  # DeepSpeed's loader then unpickles with weights_only=True
    experts = has_experts(engine)
    with experts_apart(engine) if experts else contextlib.nullcontext():
        load_path, client_state = engine.load_checkpoint(str(ref.root), tag=ref.tag)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {ref.path}")
    if experts:
        load_experts(engine, ref.path, layout["ep"])
    _set_rng_state(load_safely(ref.path / "rng" / f"rank_{dist.get_rank()}.pt"))
    return client_state
