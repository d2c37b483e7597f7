"""Stands in for `python` when pytest-xdist starts a worker (tests/conftest.py: the controller's
execnet specs run `python worker_client.py SOCKET -u -c CODE`): it asks the session's rank server
(rank_server.py) for a worker forked from it, with torch, DeepSpeed, datasets, transformers and
pytest imported already, hands that worker this process's stdin, stdout and stderr (execnet's pipes),
and exits with its exit code. A worker started so skips about 5 CPU-s of imports, three times per
session (docs/testing.md, Helpers). Imports only the standard library: it starts in milliseconds."""
import json
import os
import socket
import sys


def main() -> int:
    path, code = sys.argv[1], sys.argv[-1]  # execnet's arguments end with `-c CODE`
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(path)
        request = {"worker": code, "env": dict(os.environ), "cwd": os.getcwd(), "nice": os.nice(0)}
        socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
        reply = conn.makefile("r").readline()
    if not reply:  # the server failed (an import error, say): say why here, where xdist shows it
        log = path[:-len(".sock")] + ".log"
        tail = open(log).read()[-3000:] if os.path.exists(log) else ""
        print(f"tests/helpers/worker_client.py: the rank server gave no worker; its log, {log}:\n{tail}",
              file=sys.stderr)
    return json.loads(reply)["returncode"] if reply else 1


if __name__ == "__main__":
    sys.exit(main())
