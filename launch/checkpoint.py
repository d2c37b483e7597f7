"""Checkpoints: DeepSpeed's engine state plus ours, committed atomically.

Layout of a save directory:
    DIR/latest                     the tag of the newest complete checkpoint (atomic rename)
    DIR/step00000042/              DeepSpeed's files: per-layer weights (layer_XX-model_YY-...),
                                   ZeRO optimizer partitions, LR scheduler, loss scaler, and
                                   our client state: step, samples consumed, resolved recipe
    DIR/step00000042/rng/rank_N.pt the RNG states of global rank N (dropout replay)
    DIR/step00000042/complete.json written last, by rank 0, after every rank has saved, with
                                   the step, layout, resolved recipe and every file's size
A process killed mid-save leaves a tag directory without complete.json and `latest` still
naming the previous checkpoint; `--load` only ever takes complete checkpoints.
At the saved (tp, pp, dp) DeepSpeed's loader restores everything bit for bit; at another layout
launch/reshard.py re-shards the ZeRO-1 weights and optimizer state.
"""
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from launch.config import ConfigError

COMPLETE = "complete.json"
LATEST = "latest"


def tag_for(step: int) -> str:
    return f"step{step:08d}"


@dataclass
class CheckpointRef:
    """A complete checkpoint on disk and what complete.json says about it."""
    root: Path
    tag: str
    meta: Dict[str, Any]

    @property
    def path(self) -> Path:
        return self.root / self.tag


def _read_complete(path: Path) -> Optional[Dict[str, Any]]:
    try:
        return json.loads((path / COMPLETE).read_text())
    except (OSError, ValueError):
        return None


def find_checkpoint(load: Path) -> CheckpointRef:
    """The checkpoint `--load` names, verified against its manifest of file sizes."""
    ref = _locate(load)
    for name, size in ref.meta["files"].items():
        path = ref.path / name
        actual = path.stat().st_size if path.is_file() else None
        if actual != size:
            found = "missing" if actual is None else f"{actual} bytes"
            raise ConfigError(f"checkpoint {ref.path} is damaged: {name} is {found}, expected {size} bytes; "
                              f"load an older checkpoint (a tag directory) instead")
    return ref


def _locate(load: Path) -> CheckpointRef:
    """`load` is a save directory (take its latest complete checkpoint) or one tag directory."""
    if not load.is_dir():
        raise ConfigError(f"--load {str(load)!r}: no such directory")
    meta = _read_complete(load)
    if meta is not None:
        return CheckpointRef(load.parent, load.name, meta)
    latest = load / LATEST
    if latest.is_file():
        tag = latest.read_text().strip()
        meta = _read_complete(load / tag)
        if meta is not None:
            return CheckpointRef(load, tag, meta)
    # No usable `latest` (older tooling, or a hand-edited file): the newest complete tag.
    complete = sorted(p.name for p in load.iterdir() if p.is_dir() and _read_complete(p) is not None)
    if complete:
        return CheckpointRef(load, complete[-1], _read_complete(load / complete[-1]))
    if any(load.iterdir()):
        raise ConfigError(f"--load {str(load)!r} holds no complete checkpoint (no {COMPLETE}); "
                          f"it is not a checkpoint directory or every save in it was interrupted")
    raise ConfigError(f"--load {str(load)!r} is empty: no checkpoint to resume from")


def same_layout(saved: Dict[str, int], layout: Dict[str, int]) -> bool:
    return all(saved[k] == layout[k] for k in ("tp", "pp", "dp"))


def check_compatible(ref: CheckpointRef, recipe_dict: Dict[str, Any], layout: Dict[str, int]) -> None:
    """The model shape and the ZeRO stage must match the checkpoint's; another layout needs
    ZeRO-1 (launch/reshard.py re-shards ZeRO-1 state). Say which key differs."""
    saved_model, model = ref.meta["recipe"]["model"], recipe_dict["model"]
    # Free to change on resume: they leave every weight's shape and TP shard as they are (and
    # checkpoints saved before `sequence_parallel` existed lack the key).
    free = ("dropout", "sequence_parallel")
    for key in sorted(set(saved_model) | set(model)):
        if saved_model.get(key) != model.get(key) and key not in free:
            raise ConfigError(f"checkpoint {ref.path} has model.{key}={saved_model.get(key)!r}, this run "
                              f"{model.get(key)!r}: a checkpoint only resumes the model it was saved from")
    saved, stages = ref.meta["layout"], (ref.meta["recipe"]["train"]["zero_stage"], recipe_dict["train"]["zero_stage"])
    if stages[0] != stages[1]:
        raise ConfigError(f"checkpoint {ref.path} has train.zero_stage={stages[0]}, this run {stages[1]}: "
                          f"the optimizer state is stored per ZeRO stage; resume with --set train.zero_stage={stages[0]}")
    if not same_layout(saved, layout) and stages[1] != 1:
        raise ConfigError(f"checkpoint {ref.path} was saved at tp={saved['tp']} pp={saved['pp']} dp={saved['dp']} "
                          f"with train.zero_stage={stages[0]}, this run is tp={layout['tp']} pp={layout['pp']} "
                          f"dp={layout['dp']}: a change of layout re-shards ZeRO-1 state only; resume at the "
                          f"saved layout")


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


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def save(engine, root: Path, step: int, samples: int, recipe_dict: Dict[str, Any],
         layout: Dict[str, int], keep_last: int, is_writer: bool, wandb_run_id: Optional[str] = None,
         data_state: Optional[Dict[str, Any]] = None) -> Path:
    """Every rank calls this; rank `is_writer` commits (it holds the wandb run, whose id a
    resumed run continues). `data_state`: the streaming data position of the whole run (JSON,
    already gathered from the ranks), stored in complete.json for `--load`. Returns the tag directory."""
    tag = tag_for(step)
    client_state = {"step": step, "samples": samples, "recipe": recipe_dict}
    engine.save_checkpoint(str(root), tag=tag, client_state=client_state, save_latest=False)
    rng_dir = root / tag / "rng"
    rng_dir.mkdir(parents=True, exist_ok=True)
    torch.save(_rng_state(), rng_dir / f"rank_{dist.get_rank()}.pt")
    dist.barrier()  # every rank's files are on disk before the checkpoint is declared complete
    if is_writer:
        files = {str(f.relative_to(root / tag)): f.stat().st_size
                 for f in sorted((root / tag).rglob("*")) if f.is_file()}
        meta = {"step": step, "samples": samples, "layout": layout, "recipe": recipe_dict,
                "world_size": dist.get_world_size(), "wandb_run_id": wandb_run_id, "data_state": data_state,
                "files": files}
        _write_atomic(root / tag / COMPLETE, json.dumps(meta, indent=1))
        _write_atomic(root / LATEST, tag)
        _prune(root, keep_last)
    dist.barrier()
    return root / tag


def _prune(root: Path, keep_last: int) -> None:
    """Delete complete checkpoints beyond the newest `keep_last` (0 keeps all)."""
    if keep_last < 1:
        return
    complete = sorted(p for p in root.iterdir() if p.is_dir() and (p / COMPLETE).exists())
    for old in complete[:-keep_last]:
        (old / COMPLETE).unlink()  # first: a half-deleted directory is never taken for complete
        shutil.rmtree(old, ignore_errors=True)


def load(engine, ref: CheckpointRef, layout: Dict[str, int], state, config) -> Dict[str, Any]:
    """Restore the engine and return the client state (step, samples, recipe). At the saved
    layout: DeepSpeed's own loader and this rank's RNG states (a bitwise continuation). At
    another: launch/reshard.py re-shards weights and optimizer state (fp32 rounding)."""
    if not same_layout(ref.meta["layout"], layout):
        from launch.reshard import load_resharded
        load_resharded(engine, ref.path, ref.meta["layout"], state, config.n_layer, config.vocab_size,
                       config.padded_vocab_size(state.tp_size))
        return {key: ref.meta[key] for key in ("step", "samples", "recipe")}
    load_path, client_state = engine.load_checkpoint(str(ref.root), tag=ref.tag)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {ref.path}")
    rng_file = ref.path / "rng" / f"rank_{dist.get_rank()}.pt"
    _set_rng_state(torch.load(rng_file, weights_only=True))
    return client_state
