"""The first run on a GPU machine (gpu_check.py: correct, how fast, how big) and the MFU of the
recipes on one GPU (gpu_mfu.py)."""
