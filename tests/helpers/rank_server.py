"""Forks the ranks of a multi-process test from one process that has already imported torch,
DeepSpeed, transformers and datasets (started once per test session by tests/helpers/forked.py), so that
no rank spends its ~10 s of CPU importing them again (docs/testing.md, Helpers). Nothing here runs
a torch op or starts a thread before forking: each rank starts its own thread pools.

A rank runs a script (launch/train.py, launch/evaluate.py) as `__main__` with the environment and
`--local_rank` DeepSpeed's launcher gives it, or a test body, fn(*args) in a gloo process group
(tests/helpers/distributed.py: run_body). The ranks share the request's stdout and stderr files; the
first rank to exit non-zero stops the others, and its code is the run's.

Protocol: one JSON request per line on stdin: {"world", "env", "cwd", "stdout", "stderr",
"timeout"} and either {"script", "args"} or {"call"} (base64 of the pickled (fn, args)); one JSON
reply per line on the stdout it was started with: {"returncode", "timed_out", "cpu_s"} (the CPU
seconds of its ranks)."""
import atexit
import base64
import gc
import json
import os
import pickle
import runpy
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

# Replies go to the pipe that stdout is now; stdout itself goes to stderr, so that a library
# printing while it loads cannot garble them.
REPLIES = os.dup(1)
os.dup2(2, 1)

# What the ranks import (the heavy part of their start), before any fork.
import datasets  # noqa: F401,E402
import deepspeed  # noqa: F401,E402
import deepspeed.runtime.pipe.engine  # noqa: F401,E402
import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401,E402  (DeepSpeed's optimizer check imports it)
import torch  # noqa: F401,E402
import torch._dynamo  # noqa: F401,E402  (torch.optim imports it when the optimizer is built)
import transformers  # noqa: F401,E402

import data.run  # noqa: F401,E402
import launch.engine.engine  # noqa: F401,E402
import launch.evaluation.evaluation  # noqa: F401,E402
import launch.trainer.loop  # noqa: F401,E402
import launch.trainer.startup  # noqa: F401,E402
from helpers.distributed import run_body  # noqa: E402  (tests/ is on PYTHONPATH: helpers/forked.py)

STOP_GRACE_S = 5  # after one rank failed, the others get this long to exit on their own
SESSION = os.getppid()  # the test session; if it dies (killed, Ctrl-C), the ranks stop with it


def become_rank(request: dict, rank: int) -> None:
    """In the forked child: the request's directory, environment and output files."""
    os.setpgrp()  # a group of its own, so that stopping it also stops anything it started
    os.close(REPLIES)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644), fd)
    sys.stdout.reconfigure(line_buffering=True)  # `python -u`, as the launcher starts ranks
    sys.stderr.reconfigure(line_buffering=True)


def run_script(request: dict, rank: int) -> None:
    """Rank `rank` of `deepspeed --num_gpus WORLD SCRIPT ARGS`; never returns."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(request["world"]),
                      LOCAL_SIZE=str(request["world"]), CROSS_RANK="0", CROSS_SIZE="1")
    # A sitecustomize on the run's PYTHONPATH (tests/helpers/fp16_on_cpu) runs first, as at a Python start.
    for directory in request["env"].get("PYTHONPATH", "").split(os.pathsep):
        if directory and (Path(directory) / "sitecustomize.py").is_file():
            runpy.run_path(str(Path(directory) / "sitecustomize.py"))
    sys.argv = [request["script"], f"--local_rank={rank}"] + request["args"]
    # sys.path stays the server's: the scripts import only the installed packages (launch,
    # model, data), never a module beside them, so `python SCRIPT`'s script directory is not needed.
    try:
        runpy.run_path(request["script"], run_name="__main__")  # ends with sys.exit(main())
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    exit_rank(code)


def exit_rank(code: int) -> None:
    """What a normal interpreter exit does that a run can observe (wait for its non-daemon
    threads, run the atexit handlers: wandb's finish, DeepSpeed's and torch's cleanups, flush
    the output), then os._exit, as multiprocessing's forked children end. Skipped: tearing down
    every module and object of the heap inherited from this server, which touches (and so
    copies, page by page) the whole imported torch/DeepSpeed/transformers heap in every rank:
    about 20 s of a 16-rank run on the 2-core test machine, and nothing a run computes."""
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_call(request: dict, rank: int) -> None:
    """Rank `rank` of run_distributed(fn, WORLD, *args); never returns."""
    fn, args = pickle.loads(base64.b64decode(request["call"]))
    try:
        run_body(rank, request["world"], request["port"], fn, args)
    except BaseException:  # run_body printed it
        exit_rank(1)
    exit_rank(0)


def stop(pids) -> None:
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run(request: dict) -> dict:
    """Fork the ranks and wait for them; the reply to `request`."""
    sys.stdout.flush()  # nothing of ours buffered, or each child would write it again
    # Out of the collector's reach: the ranks' garbage collections then never visit (and so
    # never copy) the inherited objects (the gc.freeze documentation's advice for forking servers).
    gc.freeze()
    pids = {}
    for rank in range(request["world"]):
        pid = os.fork()
        if pid == 0:
            become_rank(request, rank)
            (run_script if "script" in request else run_call)(request, rank)
        pids[pid] = rank
    deadline, stop_at, returncode, timed_out, cpu_s = time.monotonic() + request["timeout"], None, 0, False, 0.0
    while pids:
        pid, status, usage = os.wait4(-1, os.WNOHANG)
        if pid == 0:
            now = time.monotonic()
            if os.getppid() != SESSION:
                stop(pids)
                sys.exit(1)
            if now > deadline or (stop_at is not None and now > stop_at):
                timed_out = now > deadline
                stop(pids)
                deadline = stop_at = float("inf")
            time.sleep(0.05)
            continue
        if pid not in pids:
            continue
        del pids[pid]
        cpu_s += usage.ru_utime + usage.ru_stime
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and returncode == 0:
            returncode = code
            stop_at = time.monotonic() + STOP_GRACE_S
    return {"returncode": -signal.SIGKILL if timed_out else returncode, "timed_out": timed_out,
            "cpu_s": round(cpu_s, 1)}


def main() -> None:
    for line in sys.stdin:
        os.write(REPLIES, (json.dumps(run(json.loads(line))) + "\n").encode())


if __name__ == "__main__":
    main()
