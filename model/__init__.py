"""Pure GPT model, Megatron-style tensor-parallel layers and pipeline assembly.

Nothing here reads the command line, YAML or the environment: callers pass everything in.
"""
