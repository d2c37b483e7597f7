"""Forked children of a test process, for tests that time what happens inside ranks (heartbeats,
stop requests, hangs) without a launcher or the rank server: fork one, send its output to a file,
wait for its exit with a limit, end it."""
import os
import signal
import sys
import time
from pathlib import Path
from typing import Optional


def fork(fn, *args) -> int:
    """A child running fn(*args) (which must end the child itself, with os._exit); its pid."""
    pid = os.fork()
    if pid == 0:
        fn(*args)
    return pid


def redirect_output(out: Path, stdout: bool = True, append: bool = False) -> None:
    """In the child: stderr (and stdout) into `out`, for fd writes and print alike; `append` when
    several children share the file."""
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC))
    os.dup2(fd, 2)
    sys.stderr = open(fd, "w", buffering=1)  # pytest's capture replaced it
    if stdout:
        os.dup2(fd, 1)
        sys.stdout = sys.stderr


def wait_for_file(path: Path, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return path.exists()


def end(pid: int) -> None:
    """SIGKILL a forked child and reap it, if it has not exited and been reaped already."""
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def exit_code(pid: int, limit_s: float) -> Optional[int]:
    """The exit code of child `pid` once it exits, None if it still runs after limit_s."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    return None
