"""`train.compile`: each transformer block compiled with torch.compile, as torchtitan does, not
the whole PipelineModule.

Per block, because what lies between the blocks is DeepSpeed's: the pipeline engine calls the
layers one by one and full recompute wraps blocks in its own checkpoint function, neither of
which dynamo should trace. A block is compiled in place (`nn.Module.compile`), so it stays a
`Block`: DeepSpeed's `checkpointable_layers=["Block"]` and `partition_method="type:Block"` match
its class name, and its parameters keep their names in checkpoints and exports. Every block has
the same code and shapes, so one compiled graph serves them all (dynamo guards on the code and on
the tensors, not on which block it is); the variants are training, DeepSpeed's no-grad forward
under full recompute, and evaluation.

Measured with torch 2.13 on CPU: dynamo traces our collectives and their autograd Functions
(tensor and sequence parallelism, the gathered key/value heads of grouped-query attention) and
selective recompute's checkpoint into the block's graph without a break. What it cannot trace
runs eagerly between compiled pieces (a graph break), with the same results: the dropout RNG
tracker's fork (DeepSpeed's; it swaps the generator state; model/pipe.py leaves it out when
dropout is 0) and the document mask's per-micro-batch cache (model/documents.py).
"""
import torch.nn as nn

from model.gpt import Block


def compile_blocks(module: nn.Module) -> int:
    """Compile every Block inside `module` in place (compiled on first call); the number compiled."""
    import torch._inductor.config

    # Inductor's own random numbers would draw other dropout masks than eager's, and draw them per
    # compiled graph: the forward of full recompute (no grad) and its replay (with grad) are two
    # graphs. With aten's random ops the compiled blocks draw exactly eager's masks from the same
    # generators, so the dropout contracts (docs/design.md 9 and 10) hold as they are. Process-wide;
    # without dropout there are no random ops to compile.
    torch._inductor.config.fallback_random = True
    blocks = [m for m in module.modules() if isinstance(m, Block)]
    for block in blocks:
        block.compile()
    return len(blocks)
