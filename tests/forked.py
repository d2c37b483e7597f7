"""The test session's client of tests/rank_server.py: start it on first use, send it a request
(the ranks to fork), return its reply. The server exits when the session closes its stdin."""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Tuple

REPO = Path(__file__).resolve().parent.parent
_server = None


def run_forked(request: dict, timeout: int) -> Tuple[dict, str, str]:
    """(reply, stdout, stderr) of `request`'s ranks (rank_server.py: the protocol); the
    environment is this process's with request["env"] on top, the directory the repository."""
    global _server
    if _server is None or _server.poll() is not None:
        _server = subprocess.Popen([sys.executable, str(Path(__file__).with_name("rank_server.py"))], cwd=REPO,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        request = dict(request, env=dict(os.environ, **request.get("env", {})), cwd=str(REPO), timeout=timeout,
                       stdout=str(out), stderr=str(err))
        _server.stdin.write(json.dumps(request) + "\n")
        _server.stdin.flush()
        reply = _server.stdout.readline()
        assert reply, "tests/rank_server.py exited"
        return (json.loads(reply),) + tuple(path.read_text() if path.exists() else "" for path in (out, err))


def stop_rank_server() -> None:
    """At the end of the session: close the server's stdin (it exits) and wait for it, so that
    its CPU time counts as the session's."""
    global _server
    if _server is not None:
        _server.stdin.close()
        _server.wait(timeout=60)
        _server = None
