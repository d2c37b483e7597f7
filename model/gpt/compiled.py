"""`train.compile`: each transformer block compiled in place with torch.compile, as torchtitan
does, not the whole PipelineModule: between the blocks are DeepSpeed's pipeline engine and its
full-recompute checkpoint, which dynamo should not trace. In place (`nn.Module.compile`), a block
stays a `Block`: DeepSpeed's `checkpointable_layers` and `partition_method="type:Block"` still
match it and its parameters keep their names. One compiled graph serves every block. What dynamo
traces and where it breaks the graph (the same results either way): docs/configuration.md,
"Compiled blocks"."""
import torch.nn as nn

from model.transformer.block import Block


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
