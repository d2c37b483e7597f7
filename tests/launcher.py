"""Start launch/train.py the way a user does: through DeepSpeed's launcher, N CPU processes."""
import json
import os
import subprocess
import sys
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


def read_metrics(path: Path) -> List[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]
