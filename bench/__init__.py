"""Benchmarks: each script measures one thing against a peer run in the same process, and says how
in its docstring (`python bench/FOLDER/NAME.py --help`). The folders group them by what they
measure: gpu/, step/, memory/, optim/, data/, faults/, and peers/ (against another project, in an
environment of its own)."""
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
"""The repository's root: the recipes, launch/train.py and the other entry points the benches start."""
