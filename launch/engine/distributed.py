"""Start torch.distributed through DeepSpeed, without DeepSpeed's CPU shared-memory all-reduce.

DeepSpeed 0.19.8 builds (JIT, about 2 minutes on 2 cores) and initialises a shared-memory
op on CPU for `inference_all_reduce`, which training never calls. Each rank's 69 MB buffer
(/dev/shm/deepspeed_allreduce_buffer_*) is never unlinked, so every CPU run leaks it into
RAM-backed /dev/shm until the machine runs out of memory (seen here: 19 GB after a few
dozen test runs, then the OOM killer). Without the op, DeepSpeed uses plain
torch.distributed collectives (gloo on CPU, NCCL on GPU), which is all we need.

Also the command line of DeepSpeed's launcher on a free port, for the tests and benches that start runs.
"""
import importlib
import os
import random
import socket
import sys
from datetime import timedelta
from pathlib import Path
from typing import List, Mapping, Optional

from launch.errors import ConfigError


def init_distributed(timeout_s: int, **kwargs) -> None:
    import deepspeed  # here, not at the top: the launchers below need no torch
    # Not `import deepspeed.comm.torch`: the package re-exports the real `torch` under that name.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(timeout=timedelta(seconds=timeout_s), **kwargs)


def threads_per_rank(env: Mapping[str, str], cpu_count: int, world_size: int) -> int:
    """Each rank's CPU threads: OMP_NUM_THREADS when it is set (the user's choice, torchrun's 1,
    DeepSpeed's --bind_cores_to_rank share), else this node's cores shared by its ranks. The ranks
    on a node: LOCAL_WORLD_SIZE (torchrun), LOCAL_SIZE (DeepSpeed's launcher, which sets no
    LOCAL_WORLD_SIZE), else the world (one node)."""
    explicit = env.get("OMP_NUM_THREADS", "")
    if explicit.isdigit() and int(explicit) > 0:
        return int(explicit)
    local_world = int(env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE") or world_size)
    return max(1, cpu_count // local_world)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask: what taskset, cgroup cpusets and SLURM
    allot), where os.cpu_count() counts every CPU of the machine."""
    if hasattr(os, "sched_getaffinity"):  # Linux; macOS and Windows have no affinity masks
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def start_rank(world_size: int, timeout_s: int) -> None:
    """The start of every rank of train.py and evaluate.py: a fair share of the CPU threads
    per local rank, this rank's accelerator (before NCCL picks a device), then torch.distributed
    with a bounded wait, so that if a rank dies the others fail their next collective instead
    of hanging."""
    import torch
    from deepspeed.accelerator import get_accelerator
    torch.set_num_threads(threads_per_rank(os.environ, usable_cpus(), world_size))
    get_accelerator().set_device(int(os.environ["LOCAL_RANK"]))
    record_collectives(os.environ)
    init_distributed(timeout_s)


FLIGHT_RECORDER_ENTRIES = 2000
"""Collectives each rank's flight recorder keeps (torch's default: 0, off; torchtitan turns it on with
20,000). A ring of small records; the hang watchdog dumps it beside the stacks
(launch/resilience/hang_watchdog.py)."""


def record_collectives(environ) -> None:
    """Turn torch's flight recorder on, unless the user chose its size: on NCCL a collective returns
    before it completes and a hang surfaces at a later synchronize, so only the recorder says which
    collective each rank entered and which never completed. Read when the process group starts."""
    if "TORCH_FR_BUFFER_SIZE" not in environ and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in environ:
        # The name torch 2.11 and later read; TORCH_NCCL_TRACE_BUFFER_SIZE, the older one, warns there.
        environ["TORCH_FR_BUFFER_SIZE"] = str(FLIGHT_RECORDER_ENTRIES)


STORE_CLIENTS_PER_RANK = 2
"""Connections each rank keeps to the rendezvous store in rank 0's process: the process group's
and the failure watcher's (launch/resilience/failure.py)."""
_FILES_BESIDE_THE_STORE = 1024  # rank 0's own files, libraries and communication sockets


def ensure_open_file_limit(world_size: int, rank: int) -> None:
    """Rank 0's process holds one socket per store client: 8,192 at 4,096 ranks, above the common
    default limit of 1,024 open files. Raise its soft limit to what that needs, up to
    the hard limit; a hard limit below it is refused in one line, before the run starts."""
    import resource
    if rank != 0:
        return
    needed = STORE_CLIENTS_PER_RANK * world_size + _FILES_BESIDE_THE_STORE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise ConfigError(f"{world_size} ranks keep {STORE_CLIENTS_PER_RANK * world_size} connections to the "
                          f"store in rank 0's process, which needs an open-file limit of at least {needed}; its "
                          f"hard limit is {hard}: raise it on rank 0's node (ulimit -n {needed}, or LimitNOFILE / "
                          f"limits.conf / SLURM's PropagateResourceLimits)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def shut_down_distributed() -> None:
    """Tear the process groups down while every rank is still here: left to interpreter exit,
    gloo's threads were sometimes destroyed while joinable ("terminate called without an
    active exception", exit -6) on a pipeline run that had finished its steps."""
    import torch.distributed as dist
    dist.barrier()
    dist.destroy_process_group()


def on_cpu() -> bool:
    from deepspeed.accelerator import get_accelerator
    return get_accelerator().device_name() == "cpu"


def check_precision_supported(precision: str) -> None:
    """deepspeed.initialize refuses fp16 where the accelerator declares none (DeepSpeed's CPU
    accelerator on CPUs without oneDNN fp16 kernels): say so before the start."""
    from deepspeed.accelerator import get_accelerator
    if precision == "fp16" and not get_accelerator().is_fp16_supported():
        raise ConfigError(f"train.precision=fp16: the {get_accelerator().device_name()} accelerator does not "
                          f"support fp16 here; use fp32 or bf16")


def ensure_single_process_env() -> None:
    """`python launch/train.py` without a launcher: a world of one, on a free local port."""
    if "RANK" in os.environ:
        return
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def free_port() -> int:
    """A TCP port unused on this host now: several launches in a row, and other jobs beside them,
    each get their own instead of everyone's 29500.

    Drawn at random below the kernel's ephemeral range, not with bind(port 0): a port from that
    range, once closed here, can be handed to any outgoing connection (gloo opens many) before the
    store binds it, and the run dies with EADDRINUSE (seen in CI with two test workers)."""
    ephemeral_low = _ephemeral_port_range()[0]
    draw = random.Random()  # its own seed from the OS: forked workers must not share a sequence
    for _ in range(64):
        port = draw.randrange(min(20000, ephemeral_low - 1024), ephemeral_low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    with socket.socket() as s:  # every draw taken: let the kernel choose
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_port_range() -> tuple:
    """Linux's ip_local_port_range (IANA's 49152-65535 elsewhere)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535


def launcher_command(num_procs: Optional[int], script: Path) -> List[str]:
    """`deepspeed [--num_gpus N] --master_port PORT SCRIPT`: the launcher of the Python running this
    (a venv's bin/), on a free port; None leaves the launcher's default number of processes."""
    procs = [] if num_procs is None else ["--num_gpus", str(num_procs)]
    return [str(Path(sys.executable).parent / "deepspeed")] + procs + ["--master_port", str(free_port()), str(script)]
