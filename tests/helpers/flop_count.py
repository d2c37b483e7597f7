"""What torch counts in the built model: the reference the FLOP formulas are held against."""
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode


def counted_flops(module: torch.nn.Module, inputs: torch.Tensor, recompute: bool = False) -> int:
    """FLOPs torch's counter sees in one forward and backward of `module`. Attention runs on the
    math kernel, as plain matmuls the counter sees (the CPU's fused kernel it does not count); a
    recompute reruns the whole forward, as DeepSpeed's activation checkpointing does (torch's own
    checkpoint would otherwise stop once backward has what it needs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # toy matmuls gain nothing from more; on a busy CPU, threads waiting cost seconds
    try:
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            if recompute:
                with set_checkpoint_early_stop(False):
                    checkpoint(module, inputs, use_reentrant=False).float().sum().backward()
            else:
                module(inputs).float().sum().backward()
    finally:
        torch.set_num_threads(threads)
    return counter.get_total_flops()
