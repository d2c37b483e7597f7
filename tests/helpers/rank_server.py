"""The test session's one rank server: forks the ranks of a multi-process test, and xdist's workers,
from a process that has already imported torch, DeepSpeed, transformers, datasets and pytest, so that
no rank spends its ~10 s of CPU importing them again, and no worker its ~5 s (docs/testing.md, Helpers).

The session's process (the xdist controller, or pytest itself under `-n 0`) starts it
(tests/helpers/forked.py: start_rank_server) with a listening unix socket and a pipe on its stdin;
it imports the heavy packages when the first request comes (under xdist a worker's start), with
that request's environment and test directories (a test's: the requesting worker's, as if it had
started the server itself; a worker's: the session's, this process's own). Its loop only
accepts: each connection gets a handler forked from it, which reads the request, forks the ranks,
waits for them, writes the reply and exits, so that the requests of different workers run at the
same time. Nothing here runs a torch op or starts a thread before forking: each rank starts its own
thread pools. When the session ends or dies (its pipe closes, or this process is re-parented) the
server exits, and every handler stops its ranks and exits with it.

The server runs at the session's priority; a handler and its ranks at the requesting worker's
(tests/conftest.py renices the computing workers, not the waiting one).

A rank runs a script (launch/train.py, launch/evaluate.py) as `__main__` with the environment and
`--local_rank` DeepSpeed's launcher gives it, or a test body, fn(*args) in a gloo process group
(tests/helpers/distributed.py: run_body). The ranks share the request's stdout and stderr files; the
first rank to exit non-zero stops the others, and its code is the run's.

Protocol: one JSON request per connection, one line: {"world", "env", "cwd", "stdout", "stderr",
"timeout", "nice", "server_env", "path"} and either {"script", "args"} or {"call"} (base64 of the
pickled (fn, args)); one JSON reply line: {"returncode", "timed_out", "cpu_s"}, cpu_s the CPU
seconds spent on the request: its ranks', its handler's and the server's own since the previous
request (the imports, for the first). A worker's client (worker_client.py) sends {"worker" (the
code execnet gave `python -c`), "env", "cwd", "nice"} with its stdin, stdout and stderr attached
(SCM_RIGHTS); the reply is the worker's {"returncode"}."""
import atexit
import base64
import gc
import importlib
import json
import os
import pickle
import pkgutil
import resource
import runpy
import select
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

# Library output goes to stderr, never to a reply.
os.dup2(2, 1)

STOP_GRACE_S = 5  # after one rank failed, the others get this long to exit on their own
SESSION = os.getppid()  # the test session; if it dies (killed, Ctrl-C), the server and the ranks stop with it
SESSION_PIPE = 0  # stdin: the session's pipe, at EOF once the session has closed it or died
run_body = None  # helpers.distributed.run_body, once loaded


def load(request: dict) -> None:
    """Import what the ranks and the xdist workers import (the heavy part of their start), in the
    environment of the first request's worker, with its test directories on sys.path where
    PYTHONPATH would have put them (a worker's request brings none: the session's, this process's own)."""
    global run_body
    if "server_env" in request:
        os.environ.clear()
        os.environ.update(request["server_env"])
        sys.path[1:1] = [p for p in request["path"] if p not in sys.path]
    import _pytest.python  # noqa: F401  (a worker's own imports: pytest's collection)
    import aiohttp  # noqa: F401  (fsspec's HTTP file system: the streaming runs over http)
    import matplotlib.pyplot  # noqa: F401
    import pytest  # noqa: F401
    import datasets  # noqa: F401
    import deepspeed  # noqa: F401
    import deepspeed.module_inject.auto_ep_layer  # noqa: F401  (DeepSpeed's engine, as it is built)
    import deepspeed.runtime.pipe.engine  # noqa: F401
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401  (DeepSpeed's optimizer check imports it)
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (torch.optim imports it when the optimizer is built)
    import transformers  # noqa: F401

    import data
    import launch
    import model
    # Every module of ours: a run imports most of them where it needs them (the model's as it is
    # built, the planner's for its step prediction), and a clean checkout has no bytecode of them.
    for package in (data, launch, model):
        for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            importlib.import_module(module.name)
    from helpers.distributed import run_body  # noqa: F811  (tests/ is on the path: the request's)
    sys.stdout.flush()
    # Out of the collector's reach: the handlers' and ranks' garbage collections then never visit
    # (and so never copy) the inherited objects (the gc.freeze documentation's advice for forking servers).
    gc.freeze()


def become_rank(request: dict, rank: int, conn: socket.socket) -> None:
    """In the forked child: the request's directory, environment and output files."""
    os.setpgrp()  # a group of its own, so that stopping it also stops anything it started
    conn.close()
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
    run_as_main(lambda: runpy.run_path(request["script"], run_name="__main__"))  # ends with sys.exit(main())


def run_as_main(run) -> None:
    """Call `run` and leave with the exit code `python` would give its __main__ (a SystemExit's
    code, its message printed; 1 after a traceback), through exit_rank; never returns."""
    try:
        run()
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


def session_gone(parent: int) -> bool:
    """The session closed its pipe or died (checked without blocking), or `parent` is gone."""
    return os.getppid() != parent or bool(select.select([SESSION_PIPE], [], [], 0)[0])


def run(request: dict, conn: socket.socket, server: int) -> dict:
    """In the handler: fork the ranks and wait for them; the reply to `request`. If the session or
    the server goes, stop the ranks and exit."""
    sys.stdout.flush()  # nothing of ours buffered, or each child would write it again
    gc.freeze()  # the request's own objects too (load: why)
    pids = {}
    for rank in range(request["world"]):
        pid = os.fork()
        if pid == 0:
            become_rank(request, rank, conn)
            (run_script if "script" in request else run_call)(request, rank)
        pids[pid] = rank
    deadline, stop_at, returncode, timed_out, cpu_s = time.monotonic() + request["timeout"], None, 0, False, 0.0
    while pids:
        pid, status, usage = os.wait4(-1, os.WNOHANG)
        if pid == 0:
            now = time.monotonic()
            if session_gone(server):
                stop(pids)
                os._exit(1)
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
    return {"returncode": -signal.SIGKILL if timed_out else returncode, "timed_out": timed_out, "cpu_s": cpu_s}


def set_nice(nice: int) -> None:
    """This process's priority to `nice`: up always; down only where allowed (root, RLIMIT_NICE)."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except PermissionError:
        pass


def read_request(conn: socket.socket):
    """The connection's request, or None if the client went before sending it. A worker's client
    (worker_client.py) sends its stdin, stdout and stderr with it: request["fds"]."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while data and not data.endswith(b"\n"):
        more = conn.recv(1 << 16)
        if not more:
            break
        data += more
    try:
        return dict(json.loads(data), fds=fds)
    except ValueError:
        return None


def serve_worker(request: dict, conn: socket.socket) -> dict:
    """In the handler: fork an xdist worker onto the client's descriptors and wait for it; the reply.
    If the client goes (execnet killed it) or the session does, stop the worker and exit."""
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        os.setpgrp()  # a group of its own, so that stopping it also stops what its tests started
        conn.close()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, received in zip((0, 1, 2), request["fds"]):
            os.dup2(received, fd)
            os.close(received)
        # What `python -u -c CODE` would have: text streams on the client's descriptors (execnet's
        # bootstrap reads its first line from sys.stdin, then talks over descriptors 0 and 1).
        sys.stdin = open(0, "r", closefd=False)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        sys.argv = ["-c"]
        sys.path[0] = ""  # `python -c`'s first entry: the directory, not this script's
        run_as_main(lambda: exec(compile(request["worker"], "<string>", "exec"), {"__name__": "__main__"}))
    for fd in request["fds"]:
        os.close(fd)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return {"returncode": os.waitstatus_to_exitcode(status), "timed_out": False, "cpu_s": 0.0}
        if session_gone(SERVER) or select.select([conn], [], [], 0.2)[0]:  # readable: the client went
            stop([pid])
            os._exit(1)


def handle(listener: socket.socket, conn: socket.socket, request, server_cpu_s: float) -> None:
    """The forked handler of one connection (its request, if the server read it already); never returns."""
    code = 1
    try:
        listener.close()
        request = request or read_request(conn)
        if request is None:
            os._exit(1)
        set_nice(request["nice"])  # the requesting worker's priority, for this handler and its ranks
        if "worker" in request:
            reply = serve_worker(request, conn)
        else:
            sys.path.extend(p for p in request["path"] if p not in sys.path)  # a worker that collected more
            reply = run(request, conn, SERVER)
        reply["cpu_s"] = round(reply["cpu_s"] + cpu_s() + server_cpu_s, 2)  # cpu_s: this handler's, since its fork
        conn.sendall((json.dumps(reply) + "\n").encode())
        code = 0
    except BaseException:
        traceback.print_exc()
    os._exit(code)


def cpu_s() -> float:
    """This process's CPU seconds (a forked handler's start at zero: fork resets them)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime


def reap() -> None:
    """Collect the handlers that have exited (SIGCHLD keeps its default: each handler's own wait4
    on its ranks needs it)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


SERVER = os.getpid()


def main() -> None:
    """argv: the listening socket's descriptor and path (forked.py: start_rank_server)."""
    listener, path = socket.socket(fileno=int(sys.argv[1])), Path(sys.argv[2])
    loaded, counted = False, 0.0
    while not session_gone(SESSION):
        reap()
        if not select.select([listener, SESSION_PIPE], [], [], 0.5)[0]:
            continue
        if select.select([SESSION_PIPE], [], [], 0)[0]:
            break
        conn, _ = listener.accept()
        request = None
        if not loaded:
            # The imports, in the server, with the first request's environment, at the session's
            # priority: every worker's first request waits for them, the un-niced waiting worker's too.
            request = read_request(conn)
            if request is None:
                conn.close()
                continue
            load(request)
            loaded = True
        now = cpu_s()
        sys.stdout.flush()
        if os.fork() == 0:
            handle(listener, conn, request, now - counted)
        counted = now
        conn.close()
        for fd in (request or {}).get("fds", []):  # a worker's pipes: open in its handler only
            os.close(fd)
    listener.close()
    path.unlink(missing_ok=True)
    path.with_suffix(".log").unlink(missing_ok=True)  # its readers were the session's clients
    while True:  # the handlers see the session's end too, stop their ranks and exit
        try:
            os.wait()
        except ChildProcessError:
            break


if __name__ == "__main__":
    main()
