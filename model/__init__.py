"""The pure GPT model: tensor-parallel primitives, transformer blocks, the model assembled as one
module or as DeepSpeed pipeline stages, and conversions to and from transformers.

Subpackages, each importing only those above it in this list (tests/model/test_imports.py):
  parallel/     process groups, Megatron's collectives, the TP layers, vocab-parallel loss
  moe_config, config   the model-shape dataclasses (pure data)
  transformer/  attention, positions, norms, MLPs, experts, the block
  gpt/          the whole model: the layer table, the dense GPT, the PipelineModule
  hf/           transformers' GPT-2, Llama and MoE layouts <-> ours, per TP/EP shard

Nothing here reads the command line, YAML or the environment: callers pass everything in.
"""
