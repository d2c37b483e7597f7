"""Start torch.distributed through DeepSpeed, without DeepSpeed's CPU shared-memory all-reduce.

DeepSpeed 0.19.8 builds (JIT, about 2 minutes on 2 cores) and initialises a shared-memory
op on CPU for `inference_all_reduce`, which training never calls. Each rank's 69 MB buffer
(/dev/shm/deepspeed_allreduce_buffer_*) is never unlinked, so every CPU run leaks it into
RAM-backed /dev/shm until the machine runs out of memory (seen here: 19 GB after a few
dozen test runs, then the OOM killer). Without the op, DeepSpeed uses plain
torch.distributed collectives (gloo on CPU, NCCL on GPU), which is all we need.
"""
import importlib
from datetime import timedelta

import deepspeed


def init_distributed(timeout_s: int, **kwargs) -> None:
    # Not `import deepspeed.comm.torch`: the package re-exports the real `torch` under that name.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(timeout=timedelta(seconds=timeout_s), **kwargs)


def shut_down_distributed() -> None:
    """Tear the process groups down while every rank is still here: left to interpreter exit,
    gloo's threads were sometimes destroyed while joinable ("terminate called without an
    active exception", exit -6) on a pipeline run that had finished its steps."""
    import torch.distributed as dist
    dist.barrier()
    dist.destroy_process_group()
