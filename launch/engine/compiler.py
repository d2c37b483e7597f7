"""Whether `train.compile` can compile here: decided before the engine is built, in milliseconds,
so that a machine without the compiler's toolchain trains eagerly after one line instead of
failing inside the first step, on every rank, after the start-up.

torch.compile's default backend, inductor, writes C++ (compiled with the system's C++ compiler)
for CPU kernels and Triton for CUDA kernels. A trial compile would also catch a toolchain that is
present but broken, but it costs 10-20 s on a 2-core CPU; the checks here only look for the
pieces, the way inductor will look for them.
"""
import subprocess
import sys
from typing import Optional


def cpp_compiler_candidates() -> list:
    """The C++ compilers inductor tries, in order: `$CXX`, else g++ (clang++ on macOS), as read by
    `torch._inductor.config.cpp.cxx` (its None entry, a conda download of gcc, is off by default)."""
    from torch._inductor import config
    cxx = config.cpp.cxx if isinstance(config.cpp.cxx, (list, tuple)) else (config.cpp.cxx,)
    return [name for name in cxx if name is not None]


def runs(command: list) -> bool:
    try:
        subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, timeout=30)
        return True
    except (OSError, subprocess.SubprocessError):
        return False


def compile_unavailable(device_type: str) -> Optional[str]:
    """Why torch.compile cannot build kernels for `device_type` ("cpu", "cuda") here; None if it can."""
    import torch._dynamo
    if not torch._dynamo.is_dynamo_supported():
        return f"torch.compile does not support this platform (Python {sys.version.split()[0]} on {sys.platform})"
    if device_type == "cpu":
        names = cpp_compiler_candidates()
        if not any(runs([name, "--version"]) for name in names):
            return (f"no working C++ compiler for inductor's CPU kernels (tried {', '.join(names)} on PATH; "
                    f"install g++ or set CXX)")
        return None
    if device_type == "cuda":
        from torch.utils._triton import has_triton
        return None if has_triton() else "Triton, which inductor needs for CUDA kernels, is not installed"
    return None  # another accelerator (xpu, ...): its own inductor backend, nothing we can check cheaply


def blocks_to_compile(requested: bool, device_type: str, logging_rank: bool) -> bool:
    """`train.compile` as it can be honoured here; the logging rank prints one line either way."""
    if not requested:
        return False
    reason = compile_unavailable(device_type)
    if logging_rank:
        print(f"compile: off, training eagerly: {reason}" if reason else
              "compile: each transformer block with torch.compile (inductor), compiled in the first steps",
              flush=True)
    return reason is None
