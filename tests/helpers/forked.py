"""The client of tests/helpers/rank_server.py, the test session's one rank server: the session's
process starts it (start_rank_server: the xdist controller, or pytest itself under `-n 0`), every
worker sends it requests (run_forked: the ranks to fork) on a unix socket named by the session, and
the session's end stops it (stop_rank_server)."""
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Tuple

REPO = Path(__file__).resolve().parents[2]
_server = None  # the server, in the session's process
# The CPU seconds of the requests this process sent (their ranks', handlers' and the server's share):
# the CPU plugin's (helpers/cpu_usage.py) measure of what a test cost in forked ranks.
cpu_seconds = 0.0
# Read now, before any test can change TMPDIR: the session's processes agree on it. A unix socket's
# path holds at most 107 bytes (sun_path), so a long TMPDIR gives way to /tmp.
_TMP = tempfile.gettempdir() if len(tempfile.gettempdir()) <= 60 else "/tmp"


def _session() -> int:
    """The test session's process: under xdist the controller (it names itself to its workers, whose
    parent is a rank server's handler: forked_worker_python), else this process."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        return int(os.environ.get(SESSION_VARIABLE) or os.getppid())
    return os.getpid()


SESSION_VARIABLE = "GPT3D_TEST_SESSION"


def forked_worker_python() -> str:
    """What an execnet spec's `python=` names so that xdist's workers are forked by this session's
    rank server instead of started afresh (worker_client.py); set in the controller before its
    workers start, with the session named in their environment."""
    os.environ[SESSION_VARIABLE] = str(os.getpid())
    client = Path(__file__).with_name("worker_client.py")
    return shlex.join([sys.executable, "-I", "-S", str(client), str(_socket_path(os.getpid()))])


def _socket_path(session: int) -> Path:
    return Path(_TMP) / f"gpt3d-rank-server-{session}.sock"


def _test_path() -> list:
    """The session's test directories on sys.path: test bodies travel pickled by module name
    (`test_tp_layers._body`), and pytest imports each test file under its basename from its own
    directory (tests/model/, tests/data/, ...), `helpers` from tests/."""
    tests = REPO / "tests"
    return [p for p in sys.path if p and Path(p).resolve().is_relative_to(tests)]


def _server_env() -> dict:
    """This environment, with the session's test directories on PYTHONPATH: the server's, as if this
    process had started it."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(_test_path() + [os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))


def start_rank_server() -> None:
    """In the session's process, at its start: the server, idle until a worker first needs it (it
    imports torch and the rest then), its socket bound and listening here, before any worker
    starts, so that no worker can find it missing. (A process that finds no server for its session
    starts one of its own the same way, on first use, and stops it at its end.)"""
    global _server
    path = _socket_path(os.getpid())
    path.unlink(missing_ok=True)  # a session of the same pid that was killed
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(64)
    try:
        with open(path.with_suffix(".log"), "w") as log:
            _server = subprocess.Popen([sys.executable, str(Path(__file__).with_name("rank_server.py")),
                                        str(listener.fileno()), str(path)], cwd=REPO, stdin=subprocess.PIPE,
                                       stderr=log, pass_fds=(listener.fileno(),), env=_server_env())
    finally:
        listener.close()


def session_socket() -> Path:
    """The socket of this session's rank server."""
    return _socket_path(_session())


def run_forked(request: dict, timeout: int) -> Tuple[dict, str, str]:
    """(reply, stdout, stderr) of `request`'s ranks (rank_server.py: the protocol); the
    environment is this process's with request["env"] on top, the directory the repository, the
    priority this process's."""
    global cpu_seconds
    path = session_socket()
    if not path.exists():  # a session whose process did not start one (tests/conftest.py does): one of our own
        if _server is None:
            start_rank_server()
        path = _socket_path(os.getpid())
    with tempfile.TemporaryDirectory() as tmp, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        request = dict(request, env=dict(os.environ, **request.get("env", {})), cwd=str(REPO), timeout=timeout,
                       stdout=str(out), stderr=str(err), nice=os.nice(0), server_env=_server_env(), path=_test_path())
        try:
            conn.connect(str(path))
        except OSError as e:
            raise AssertionError(f"no rank server at {path} ({e}): tests/conftest.py starts it with the session") from e
        conn.sendall((json.dumps(request) + "\n").encode())
        reply = conn.makefile("r").readline()
        if not reply:
            log = path.with_suffix(".log")
            raise AssertionError("tests/helpers/rank_server.py gave no reply; its log, "
                                 f"{log}:\n{log.read_text()[-3000:] if log.exists() else ''}")
        reply = json.loads(reply)
        cpu_seconds += reply["cpu_s"]
        return (reply,) + tuple(p.read_text() if p.exists() else "" for p in (out, err))


def stop_rank_server() -> None:
    """At the end of the session, in its process: close the server's stdin (it exits, and so would
    it if the session died) and wait for it, so that its CPU time counts as the session's."""
    global _server
    if _server is not None:
        _server.stdin.close()
        _server.wait(timeout=60)
        path = _socket_path(os.getpid())
        path.unlink(missing_ok=True)
        path.with_suffix(".log").unlink(missing_ok=True)
        _server = None
