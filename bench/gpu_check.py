"""The first command on a GPU machine: `python bench/gpu_check.py` (its options: `--help`). The
checks live in bench/gpu/gpu_check.py; this path stays where the GPU machines' instructions name it."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # as `python bench/gpu_check.py` from anywhere

from bench.gpu.gpu_check import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
