"""Learning rate: linear warmup to the peak, then cosine decay to peak * min_lr_ratio.

Ours rather than DeepSpeed's `WarmupCosineLR`, which (0.19.8) runs the first two optimizer
steps at lr 0: it reports 0 before its first `step()` and its linear warmup starts at ratio 0.
Here step 1 already uses peak / warmup_steps (Megatron, nanoGPT).
The peak is each param group's own lr (LambdaLR keeps every group's initial lr and multiplies it by
the same ratio): with train.optimizer=muon the Muon matrices' train.lr and the AdamW group's
train.muon_adamw_lr follow one schedule.
"""
import math
from typing import Callable

import torch


def lr_ratio(step_index: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr for the optimizer step with 0-based `step_index`."""
    if step_index < warmup_steps:
        return (step_index + 1) / warmup_steps
    progress = min(1.0, (step_index - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine(warmup_steps: int, total_steps: int, min_lr_ratio: float
                  ) -> Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LambdaLR]:
    """A factory DeepSpeed calls with its optimizer (`deepspeed.initialize(lr_scheduler=...)`)."""
    def make(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda i: lr_ratio(i, warmup_steps, total_steps, min_lr_ratio))
    return make
