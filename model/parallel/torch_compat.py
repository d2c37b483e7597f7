"""The calls whose name or form changed between the torch releases we run on, resolved at each call.

The range is the GPU images' and clusters' torch, 2.11 to 2.15, not only the pinned one: a node's
torch is the build its CUDA driver allows. Each function below calls the newest spelling where the
torch in use has it, else the older one with the same semantics; nothing else in the repository
branches on torch's version. Looked up at call time, not import time: a wrapper installed on
torch.distributed later (launch/instruments/comm_counter.py counts the collectives) is the one called.
"""
import torch.distributed as dist


def all_gather_single(output, input, group=None, async_op=False):
    """Every rank's equal-sized `input` into `output`, rank-major. torch 2.13 renamed
    all_gather_into_tensor to all_gather_single (the old name forwards to it, deprecated); 2.11
    and 2.12 have only the old name."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output, input, group=None, async_op=False):
    """This rank's chunk of the sum of every rank's `input`, into `output` (reduce_scatter_tensor
    before torch 2.13)."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, group=group, async_op=async_op)
