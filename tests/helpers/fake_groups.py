"""Run the layers' constructors as on one rank of a TP or EP group, with no process group: the
constructors ask a group for nothing but its size and rank (model/parallel/layers.py: group_size,
group_rank), so every model module that imported those two answers from the test's tables."""
import sys
from typing import Callable

import model.gpt.model  # noqa: F401 (imports every module that builds layers)


def fake_groups(monkeypatch, size: Callable[[object], int], rank: Callable[[object], int]) -> None:
    """group_size(g) -> size(g) and group_rank(g) -> rank(g) in every model.* module that has them."""
    for name, module in list(sys.modules.items()):
        if name == "model" or not name.startswith("model."):
            continue
        for attribute, answer in (("group_size", size), ("group_rank", rank)):
            if hasattr(module, attribute):
                monkeypatch.setattr(module, attribute, answer)
