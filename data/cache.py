"""Build-once files shared by every process of a run (and by later runs).

Sixteen ranks starting together must not train sixteen tokenizers or race on one file: the
first process to take the lock builds into a temporary name and renames it into place
atomically; the others wait on the lock and then read the finished file.
"""
import fcntl
import os
import shutil
from pathlib import Path
from typing import Callable


def default_cache_dir() -> Path:
    return Path(os.environ.get("GPT3D_CACHE", Path.home() / ".cache" / "gpt3d"))


def build_once(path: Path, build: Callable[[Path], None]) -> Path:
    """Return `path` (a file or a directory), calling `build(tmp_path)` first if it does not
    exist yet. A failed build removes its temporary output; a killed one leaves only that
    temporary name, never a half-written `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        return path
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            tmp = path.parent / f".{path.name}.tmp{os.getpid()}{path.suffix}"
            try:
                build(tmp)
            except BaseException:
                if tmp.is_dir():
                    shutil.rmtree(tmp, ignore_errors=True)
                else:
                    tmp.unlink(missing_ok=True)
                raise
            os.replace(tmp, path)
    return path
