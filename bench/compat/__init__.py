"""The code on another torch than the pinned one, in an environment of its own: a cluster's torch
is the build its CUDA driver allows (the GPU images here carry 2.11), not requirements.txt's."""
