"""Benchmarks: each script measures one thing against a peer run in the same process; `python bench/NAME.py --help`."""
