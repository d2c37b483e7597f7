"""Build-once files shared by every process of a run (and by later runs).

Sixteen ranks starting together must not train sixteen tokenizers or race on one file: the
first process to take the lock builds into a temporary name and renames it into place
atomically; the others wait on the lock (bounded) and then read the finished file. The lock
file names its holder (pid, host, since when), so a waiter that gives up can say who.
"""
import fcntl
import os
import shutil
import socket
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, IO

from data.spec import DataError

LOCK_TIMEOUT_ENV = "GPT3D_CACHE_LOCK_TIMEOUT_S"
DEFAULT_LOCK_TIMEOUT_S = 7200.0
"""How long a process waits for another one's build: long enough for tokenizing a large corpus,
bounded so that a hung builder ends the run with its name instead of a silent hang."""


def default_cache_dir() -> Path:
    return Path(os.environ.get("GPT3D_CACHE", Path.home() / ".cache" / "gpt3d"))


def lock_timeout_s() -> float:
    value = os.environ.get(LOCK_TIMEOUT_ENV)
    try:
        timeout = float(value) if value else DEFAULT_LOCK_TIMEOUT_S
    except ValueError:
        timeout = -1.0
    if not timeout > 0:
        raise DataError(f"{LOCK_TIMEOUT_ENV}={value!r} must be a positive number of seconds")
    return timeout


def _acquire(lock: IO[str], lock_path: Path, timeout_s: float) -> None:
    """Take the lock within `timeout_s`, then write who holds it; else a DataError naming the holder."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                holder = lock_path.read_text().strip() or "an unknown process"
                raise DataError(f"gave up after {timeout_s:g} s waiting for {holder} to build the data cache "
                                f"(lock {lock_path}); if that process hangs, stop it and run again, or raise "
                                f"{LOCK_TIMEOUT_ENV} for a longer build") from None
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    lock.seek(0)
    lock.truncate()
    since = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    lock.write(f"pid {os.getpid()} on host {socket.gethostname()} since {since}\n")
    lock.flush()


def build_once(path: Path, build: Callable[[Path], None]) -> Path:
    """Return `path` (a file or a directory), calling `build(tmp_path)` first if it does not
    exist yet. A failed build removes its temporary output; a killed one leaves only that
    temporary name, never a half-written `path`. Waits for another process's build at most
    GPT3D_CACHE_LOCK_TIMEOUT_S seconds (DataError naming that process)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        return path
    lock_path = path.parent / f".{path.name}.lock"
    with open(lock_path, "a+") as lock:  # not "w": that would erase the holder's name
        _acquire(lock, lock_path, lock_timeout_s())
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
