"""Run a test body on N CPU processes joined by a gloo process group (no DeepSpeed launcher)."""
import os
import socket
import sys
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn, args, errors) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    torch.set_num_threads(1)
    try:
        if fn.__dict__.get("uses_deepspeed"):
            from launch.runtime.distributed import init_distributed
            init_distributed(600, dist_backend="gloo", verbose=False)
        else:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        fn(*args)
        dist.barrier()
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args) -> None:
    """Call fn(*args) on `world_size` spawned processes; re-raise the first rank's failure."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    try:
        mp.start_processes(_entry, args=(world_size, free_port(), fn, args, errors),
                           nprocs=world_size, start_method="spawn")
    except mp.ProcessRaisedException as e:
        raise AssertionError(str(e)) from None
    except mp.ProcessExitedException:
        raise AssertionError(errors.get() if not errors.empty() else "a rank exited") from None


def uses_deepspeed(fn):
    """Mark a test body that needs DeepSpeed's communication backend initialised."""
    fn.uses_deepspeed = True
    return fn
