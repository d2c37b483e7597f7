"""The test session's client of tests/helpers/rank_server.py: start it on first use, send it a request
(the ranks to fork), return its reply. The server exits when the session closes its stdin."""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Tuple

REPO = Path(__file__).resolve().parents[2]
_server = None


def _server_env() -> dict:
    """This environment, with the session's test directories on PYTHONPATH: test bodies travel
    pickled by module name (`test_tp_layers._body`), and pytest imports each test file under its
    basename from its own directory (tests/model/, tests/data/, ...), `helpers` from tests/."""
    tests = REPO / "tests"
    seen = [p for p in sys.path if p and Path(p).resolve().is_relative_to(tests)]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(seen + [os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))


def run_forked(request: dict, timeout: int) -> Tuple[dict, str, str]:
    """(reply, stdout, stderr) of `request`'s ranks (rank_server.py: the protocol); the
    environment is this process's with request["env"] on top, the directory the repository."""
    global _server
    if _server is None or _server.poll() is not None:
        _server = subprocess.Popen([sys.executable, str(Path(__file__).with_name("rank_server.py"))], cwd=REPO,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_server_env())
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        request = dict(request, env=dict(os.environ, **request.get("env", {})), cwd=str(REPO), timeout=timeout,
                       stdout=str(out), stderr=str(err))
        _server.stdin.write(json.dumps(request) + "\n")
        _server.stdin.flush()
        reply = _server.stdout.readline()
        assert reply, "tests/helpers/rank_server.py exited"
        return (json.loads(reply),) + tuple(path.read_text() if path.exists() else "" for path in (out, err))


def stop_rank_server() -> None:
    """At the end of the session: close the server's stdin (it exits) and wait for it, so that
    its CPU time counts as the session's."""
    global _server
    if _server is not None:
        _server.stdin.close()
        _server.wait(timeout=60)
        _server = None
