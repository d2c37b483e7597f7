"""How checkpoint files are read and written: a safe unpickler and durable writes.

Reading: every checkpoint file (ours, DeepSpeed's own loader at the saved layout, and
launch/checkpoints/reshard.py at another) is unpickled with `torch.load(weights_only=True)`: tensors, plain
containers and the four small DeepSpeed types its files pickle (`allowed_types`); anything else, such as
a pickled callable, is refused, so loading a checkpoint runs no code from it. DeepSpeed 0.19.8
has no switch for this (its TorchCheckpointEngine.load passes weights_only=False), so the engine
gets a checkpoint engine of ours, SafeCheckpointEngine, which it then uses for every load and save.

Writing: each file is fsynced by the rank that wrote it before the save returns, and a
directory is fsynced after an entry in it changes, so a checkpoint that `latest` names is on
disk, not in a page cache that a power loss empties.
"""
from __future__ import annotations

import contextlib
import os
import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Callable, List, Optional, Union

import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

if TYPE_CHECKING:  # annotations only: no import cost at run time
    from deepspeed.runtime.pipe.engine import PipelineEngine

PathLike = Union[str, Path]


class UnsafeCheckpoint(Exception):
    """A checkpoint file holds a pickled object outside the allow-list."""


def allowed_types() -> List[type]:
    """The non-tensor types DeepSpeed's checkpoint files pickle: the fp16 loss scalers (optimizer
    state), the ZeRO stage (model states) and the fragment addresses of ZeRO's flat partitions."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


_file_loaded: Optional[Callable[[], None]] = None  # each_file_loaded's callback, while a load runs


@contextlib.contextmanager
def each_file_loaded(callback: Callable[[], None]):
    """Call `callback()` after every file `load_safely` reads meanwhile (a resume's progress, which
    the hang watchdog times file by file: a large checkpoint takes minutes)."""
    global _file_loaded
    _file_loaded = callback
    try:
        yield
    finally:
        _file_loaded = None


def load_safely(path: PathLike, map_location=None, mmap: bool = False):
    """torch.load with weights_only=True and `allowed_types`; UnsafeCheckpoint names the file and
    the type it refused."""
    try:
        with torch.serialization.safe_globals(allowed_types()):
            loaded = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
        if _file_loaded is not None:
            _file_loaded()
        return loaded
    except pickle.UnpicklingError as e:
        reason = next((line.strip() for line in str(e).splitlines() if "Unsupported global" in line),
                      str(e).splitlines()[0] if str(e) else type(e).__name__)
        raise UnsafeCheckpoint(f"refused to load checkpoint file {path}: {reason[:300]} (checkpoints load "
                               f"with torch.load(weights_only=True); only tensors and DeepSpeed's own "
                               f"types are allowed)") from None


def fsync_file(path: PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: PathLike) -> None:
    """Make the directory's entries (files created, renamed or removed in it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, text: str) -> None:
    """Replace `path` atomically: a temporary file, fsynced, renamed over it, then its directory fsynced.
    The temporary file is a new one: whatever had its name (a link too) is removed, never written through."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # a killed process's, or a link: never written through (O_EXCL creates a new file)
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def save_durably(obj, path: PathLike) -> None:
    torch.save(obj, path)
    fsync_file(path)


class SafeCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch.save/torch.load engine, except that loads go through `load_safely` and
    each saved file is fsynced by the rank that wrote it."""

    def save(self, state_dict, path: str):
        super().save(state_dict, path)
        fsync_file(path)

    def load(self, path: str, map_location=None):
        return load_safely(path, map_location)


def use_safe_engine(engine: PipelineEngine) -> None:
    """Give a DeepSpeed engine our checkpoint engine (its save and load look it up each call)."""
    if not isinstance(engine.checkpoint_engine, SafeCheckpointEngine):
        engine.checkpoint_engine = SafeCheckpointEngine(engine._config)
