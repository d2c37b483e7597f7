"""The import graph of model/, data/, launch/ and bench/, read with ast (function-local and
TYPE_CHECKING imports included): no cycle, model/ and data/ never import launch/, and model/ and
launch/ each follow their layers (model/__init__.py; docs/design.md, Layers of launch/)."""
import ast
import functools
from pathlib import Path
from typing import Dict, List, Optional, Set

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("model", "data", "launch", "bench")
# Each package's layers, lowest first: a module may import its own subpackage and the layers
# below, never a sibling of its own layer or anything above. launch/'s entry points are launch/*.py.
LAYERS = {
    "model": (("model.parallel",), ("model.moe_config",), ("model.config",), ("model.transformer",),
              ("model.gpt",), ("model.hf",)),
    "launch": (("launch.errors",), ("launch.config",), ("launch.analysis",),
               ("launch.instruments", "launch.checkpoints"),
               ("launch.optim", "launch.resilience", "launch.feed"),
               ("launch.engine",),
               ("launch.autotune", "launch.evaluation"),
               ("launch.trainer",)),
}


def module_names() -> Dict[str, Path]:
    """Dotted name -> file of every module of PACKAGES (a package under its own name)."""
    names = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            names[".".join(parts)] = path
    return names


def imports_of(name: str, path: Path, known: Dict[str, Path]) -> Set[str]:
    """The repository's modules that `name` imports anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports the submodule; `from mod import name` the module.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` of a name inside a module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


@functools.cache  # read once per session (about 2 s): every test of this file reads the same tree
def import_graph() -> Dict[str, Set[str]]:
    known = module_names()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One cycle as [a, b, ..., a], or None."""
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []

    def visit(node: str) -> Optional[List[str]]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def layer_of(name: str) -> Optional[int]:
    """The layer index of a module of a layered package; len(its layers) for a module in none of
    them (launch/'s entry points, model/__init__); None outside the layered packages."""
    layers = LAYERS.get(name.split(".")[0])
    if layers is None:
        return None
    for index, layer in enumerate(layers):
        if any(name == prefix or name.startswith(prefix + ".") for prefix in layer):
            return index
    return len(layers)


def home_of(name: str) -> str:
    """The subpackage (or module) of its layered package that `name` belongs to."""
    layers = LAYERS.get(name.split(".")[0], ())
    return next((p for layer in layers for p in layer if name == p or name.startswith(p + ".")), name)


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_model_and_data_never_import_launch():
    bad = [f"{a} -> {b}" for a, targets in import_graph().items() if a.split(".")[0] in ("model", "data")
           for b in targets if b.split(".")[0] == "launch"]
    assert not bad, "model/ and data/ import launch/: " + ", ".join(sorted(bad))


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_package_follows_its_layers(package):
    bad = []
    for a, targets in import_graph().items():
        for b in targets:
            if a.split(".")[0] != package or b.split(".")[0] != package:
                continue
            la, lb = layer_of(a), layer_of(b)
            if home_of(a) == home_of(b):
                continue
            if lb >= la:  # upward, or sideways between the siblings of one layer
                bad.append(f"{a} (layer {la}) -> {b} (layer {lb})")
    assert not bad, f"{package}/ imports against its layers:\n" + "\n".join(sorted(bad))


def test_every_model_module_has_a_layer():
    """A new subpackage of model/ must be given its place (else it would sit above every layer)."""
    loose = [name for name in module_names() if name.startswith("model.") and layer_of(name) == len(LAYERS["model"])]
    assert not loose, f"model/ modules in no layer of LAYERS['model']: {loose}"


def test_every_launch_subpackage_has_a_layer():
    """Only the entry points launch/*.py sit above the layers: a new folder of launch/ must be given its place."""
    loose = [name for name, path in module_names().items() if name.startswith("launch.")
             and layer_of(name) == len(LAYERS["launch"]) and path.parent != ROOT / "launch"]
    assert not loose, f"launch/ modules in no layer of LAYERS['launch']: {loose}"


def test_the_graph_is_read():
    """The parser sees function-local imports and `from pkg import module` (else the tests above pass empty)."""
    graph = import_graph()
    assert "launch.trainer.loop" in graph["launch.train"]  # imported inside main()
    assert "launch.analysis.formulas" in graph["launch.analysis.partition"]  # from launch.analysis import formulas
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
