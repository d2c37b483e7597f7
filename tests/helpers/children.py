"""Forked children of a test process, for tests that time what happens inside ranks (heartbeats,
stop requests, hangs) without a launcher or the rank server: fork one, send its output to a file,
wait for its exit with a limit, end it. And ForkedRun: a training run whose ranks the rank server
forks, for a test that signals or kills them."""
import os
import shutil
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


# Each rank of a ForkedRun runs this first (the rank server runs a sitecustomize.py on the run's
# PYTHONPATH, as Python does at its start): its pid, under its rank, beside this file.
_SAY_PID = """import os
from pathlib import Path
said = Path(__file__).with_name(f"rank_{os.environ['RANK']}.pid")
if not said.exists():  # once: a Python the rank starts finds this file too
    tmp = said.with_suffix(f".{os.getpid()}")
    tmp.write_text(str(os.getpid()))
    tmp.rename(said)  # whole or not there
"""


class ForkedRun:
    """launch_forked(num_procs, args, env) in a thread, for a test that signals or kills ranks of a
    run whose subject is what the ranks do (a checkpoint, a stop's grace), not DeepSpeed's launcher:
    the same ranks without each importing torch and DeepSpeed again. Each rank writes its pid
    first (_SAY_PID), so `ranks()` finds them by rank wherever the rank server forks them."""

    def __init__(self, num_procs: int, args, env=None, timeout: int = 600):
        import tempfile
        import threading
        from helpers import launcher
        self.num_procs, self.proc, self.error, self._ranks = num_procs, None, None, None
        self.pid_dir = Path(tempfile.mkdtemp(prefix="forked-run-"))
        (self.pid_dir / "sitecustomize.py").write_text(_SAY_PID)
        env = dict(env or {})
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.pid_dir), env.get("PYTHONPATH"),
                                                          os.environ.get("PYTHONPATH")]))

        def run():
            try:
                self.proc = launcher.launch_forked(num_procs, args, env=env, timeout=timeout)
            except BaseException as e:  # noqa: B036 (reported by result())
                self.error = e
        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def _pids(self):
        return {int(f.name.split("_")[1].split(".")[0]): int(f.read_text()) for f in self.pid_dir.glob("rank_*.pid")}

    def ranks(self, timeout: float = 300):
        """The running ranks as psutil processes, rank 0 first (waits until every rank has said its pid)."""
        import psutil
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self._thread.is_alive():
            pids = self._pids()
            if len(pids) == self.num_procs:
                self._ranks = [psutil.Process(pids[rank]) for rank in range(self.num_procs)]
                return self._ranks
            time.sleep(0.05)
        raise AssertionError(f"the {self.num_procs} forked ranks did not all start: {self.error!r}")

    def result(self, timeout: float = 600):
        """The run's CompletedProcess (returncode, stdout, stderr) once every rank has exited."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise AssertionError(f"the forked run still runs after {timeout} s")
        shutil.rmtree(self.pid_dir, ignore_errors=True)
        if self.error is not None:
            raise self.error
        return self.proc

    def kill(self) -> None:
        """A failed check: SIGKILL every rank still running (the rank server then replies)."""
        import psutil
        if self._thread.is_alive():
            for p in self._ranks or list(self._pids().values()):
                try:
                    # psutil's, once ranks() has found them: never a process that took a reaped rank's pid
                    (p if isinstance(p, psutil.Process) else psutil.Process(p)).kill()
                except psutil.NoSuchProcess:
                    pass
        self._thread.join(60)
