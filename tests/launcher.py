"""Start launch/train.py on N CPU processes: through DeepSpeed's launcher, as a user does (launch),
or forked from tests/rank_server.py with the launcher's environment (launch_forked, the same run
without importing torch and DeepSpeed again in every rank)."""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

from distributed import free_port

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "recipes" / "tiny.yaml"


def deepspeed_cli() -> str:
    """The `deepspeed` script of the Python running the tests (a venv's bin/)."""
    return str(Path(sys.executable).parent / "deepspeed")


def launch(num_procs: Optional[int], args: List[str], env: Optional[Dict[str, str]] = None,
           timeout: int = 600) -> subprocess.CompletedProcess:
    """`deepspeed [--num_gpus N] launch/train.py ARGS`; None leaves the launcher's default."""
    procs = [] if num_procs is None else ["--num_gpus", str(num_procs)]
    cmd = ([deepspeed_cli()] + procs + ["--master_port", str(free_port()), str(REPO / "launch" / "train.py")]
           + args)
    return subprocess.run(cmd, cwd=REPO, env=dict(os.environ, **(env or {})), capture_output=True,
                          text=True, timeout=timeout)


_rank_server = None  # started by the first launch_forked of the session; it exits when its stdin closes


def launch_forked(num_procs: int, args: List[str], env: Optional[Dict[str, str]] = None,
                  timeout: int = 600, script: str = "train.py") -> subprocess.CompletedProcess:
    """The run `launch(num_procs, args, env)` starts (of launch/SCRIPT), its ranks forked from tests/rank_server.py
    (what each rank sees is the same: environment, argv, working directory; output in one
    stdout and one stderr). For the many training runs whose subject is what they compute;
    tests of the launcher itself, signals and failures use `launch`."""
    global _rank_server
    if _rank_server is None or _rank_server.poll() is not None:
        _rank_server = subprocess.Popen([sys.executable, str(Path(__file__).with_name("rank_server.py"))],
                                        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        request = {"script": str(REPO / "launch" / script), "world": num_procs, "args": [str(a) for a in args], "cwd": str(REPO), "timeout": timeout,
                   "env": dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), **(env or {})),
                   "stdout": str(out), "stderr": str(err)}
        _rank_server.stdin.write(json.dumps(request) + "\n")
        _rank_server.stdin.flush()
        reply = _rank_server.stdout.readline()
        assert reply, "tests/rank_server.py exited"
        reply = json.loads(reply)
        global _last_cpu; _last_cpu = reply["cpu_s"]
        stdout, stderr = (path.read_text() if path.exists() else "" for path in (out, err))
    if reply["timed_out"]:
        raise subprocess.TimeoutExpired(["launch_forked"] + request["args"], timeout, stdout, stderr)
    return subprocess.CompletedProcess(["launch_forked"] + request["args"], reply["returncode"], stdout, stderr)


def read_metrics(path: Path) -> List[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]
