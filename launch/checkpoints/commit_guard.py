"""A checkpoint's commit against the process leaving in the middle of it.

The commit (store.py: _commit; complete.json, then `latest`) is one rank's few small writes, made
once every rank's files are on disk. A rank that leaves because another rank failed
(launch/resilience/failure.py) or because a stop request's grace ran out (signals.py) leaves with
os._exit, which would cut a commit in progress on another thread: the checkpoint whose files are
all written would then be lost, and a requeued job would start from the one before. Such exits go
through `exit_after_commit`, which lets a commit in progress end first. Bounded: storage that
stalls must not keep a failed job alive."""
import contextlib
import os
import threading
from typing import Iterator

COMMIT_WAIT_S = 30.0  # the most an exit waits for a commit; DeepSpeed's launcher also allows a rank 30 s after SIGTERM
_committing = threading.RLock()  # re-entrant: a thread that fails inside the commit leaves without waiting on itself


@contextlib.contextmanager
def committing() -> Iterator[None]:
    """Around a commit: exits on other threads wait until it has ended."""
    with _committing:
        yield


def exit_after_commit(code: int) -> None:
    """os._exit(code) once no commit is in progress on another thread (at most COMMIT_WAIT_S)."""
    _committing.acquire(timeout=COMMIT_WAIT_S)
    os._exit(code)
