"""Loaded at start-up by every rank of the fp16 test runs (tests/conftest.py: FP16_ON_CPU).

DeepSpeed's CPU accelerator says fp16 is supported only where oneDNN has fp16 kernels, and the
engine refuses fp16 elsewhere. torch computes fp16 on any CPU with its own kernels, so this lifts
that one capability check; the engine's fp16 path (loss scaler, overflow checks, fp32 master
weights) runs unchanged. It must never be on the path of a real run.
"""
import torch
from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

CPU_Accelerator.is_fp16_supported = lambda self: True
CPU_Accelerator.supported_dtypes = lambda self: [torch.float, torch.bfloat16, torch.float16]
