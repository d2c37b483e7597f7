"""Start launch/train.py on N CPU processes: through DeepSpeed's launcher, as a user does (launch),
or forked from tests/helpers/rank_server.py with the launcher's environment (launch_forked, the same run
without importing torch and DeepSpeed again in every rank)."""
import json
import os
import subprocess
from pathlib import Path
from typing import Dict, List, Optional

from helpers.forked import run_forked
from launch.engine.distributed import free_port, launcher_command

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "tiny.yaml"
LLAMA_TINY = REPO / "recipes" / "llama-tiny.yaml"
MOE_TINY = REPO / "recipes" / "moe-tiny.yaml"
# DeepSpeed's launcher, once a rank has exited, SIGTERMs the others and waits this long before its
# SIGKILL (deepspeed/launcher/launch.py: terminate_process_tree): a frozen rank ignores the SIGTERM,
# so without a sibling's SIGKILL a job ends no sooner than the heartbeat bound plus this.
LAUNCHER_KILL_WAIT_S = 30
# The fast tier's rule (docs/testing.md, The fast tier): a fast test starts no run of its own.
# conftest.py sets this to the fast test running now (None during a slow one).
fast_test: Optional[str] = None


def refuse_in_fast_tier(what: str) -> None:
    if fast_test is not None:
        raise AssertionError(f"{fast_test} is in the fast tier but starts {what}: mark it slow or test the "
                             f"contract in process (docs/testing.md, The fast tier)")


def launch(num_procs: Optional[int], args: List[str], env: Optional[Dict[str, str]] = None,
           timeout: int = 600) -> subprocess.CompletedProcess:
    """`deepspeed [--num_gpus N] launch/train.py ARGS`; None leaves the launcher's default."""
    cmd = launcher_command(num_procs, REPO / "launch" / "train.py") + args
    return subprocess.run(cmd, cwd=REPO, env=dict(os.environ, **(env or {})), capture_output=True,
                          text=True, timeout=timeout)


def launch_forked(num_procs: int, args: List[str], env: Optional[Dict[str, str]] = None,
                  timeout: int = 600, script: str = "train.py", acceptance: bool = False
                  ) -> subprocess.CompletedProcess:
    """The run `launch(num_procs, args, env)` starts (of launch/SCRIPT), its ranks forked from
    tests/helpers/rank_server.py: what each rank sees is the same (environment, argv, working directory;
    output in one stdout and one stderr), without every rank importing torch and DeepSpeed again.
    For the runs whose subject is what the ranks do (train, refuse, fail); the tests of the launcher
    itself, signals, frozen ranks and the console use `launch`. `acceptance`: one of the session's shared
    acceptance runs (conftest.py: ParityRuns), the only runs a fast test may start."""
    if not acceptance:
        refuse_in_fast_tier(f"launch/{script} on {num_procs} forked ranks")
    cmd = ["launch_forked", str(num_procs), script] + [str(a) for a in args]
    reply, stdout, stderr = run_forked({"script": str(REPO / "launch" / script), "world": num_procs,
                                        "args": cmd[3:], "env": dict(env or {}, MASTER_ADDR="127.0.0.1",
                                                                     MASTER_PORT=str(free_port()))}, timeout)
    if reply["timed_out"]:
        raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
    return subprocess.CompletedProcess(cmd, reply["returncode"], stdout, stderr)


def read_metrics(path: Path) -> List[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]
