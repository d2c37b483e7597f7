"""Methods torch.compile must not trace, made opaque only when a block is compiled.

`torch.compiler.disable` as a decorator imports torch._dynamo where the class is defined: about a
second of CPU in every process that imports the model (each rank of each launch), and most runs
never compile. `@opaque_to_compile` marks a method instead; `Block.compile` (the one way a block is
compiled: model/gpt/compiled.py, the tests) wraps every marked method in `torch.compiler.disable`
before dynamo first sees one. Each marked method's comment says why dynamo must not trace it."""
from typing import Callable, List, Tuple

import torch

_MARKED: List[Tuple[type, str]] = []


class opaque_to_compile:
    """Decorator for a method: recorded with its class, left as the plain function until
    `make_marked_methods_opaque` runs."""

    def __init__(self, method: Callable):
        self.method = method

    def __set_name__(self, owner: type, name: str) -> None:
        _MARKED.append((owner, name))
        setattr(owner, name, self.method)


def make_marked_methods_opaque() -> None:
    """Wrap every marked method in torch.compiler.disable (once; later calls change nothing)."""
    for owner, name in _MARKED:
        method = owner.__dict__[name]
        if not getattr(method, "_torchdynamo_disable", False):
            setattr(owner, name, torch.compiler.disable(method))
