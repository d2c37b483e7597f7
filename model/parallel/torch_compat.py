"""The calls whose name or form changed between the torch releases we run on, resolved once.

The range is the GPU images' and clusters' torch, 2.11 to 2.15, not only the pinned one: a node's
torch is the build its CUDA driver allows. Each name below is the newest spelling where the torch
in use has it, else the older one with the same semantics; nothing else in the repository branches
on torch's version.
"""
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single and deprecated the
# old names (which now forward to the new ones); 2.11 and 2.12 have only the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""(output, input, group=None, async_op=False): every rank's equal-sized input into one tensor, rank-major."""
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""(output, input, op=SUM, group=None, async_op=False): this rank's chunk of the inputs' sum."""
