"""YAML as a recipe reads it: PyYAML's safe loader, refusing what it would accept silently or
answer with a traceback. A key given twice (two `train:` sections: PyYAML keeps the last), text that
is not UTF-8, nesting deeper than any recipe needs (PyYAML recurses per level: 3,000 levels raise
RecursionError) and aliases that multiply into more values than a recipe holds (YAML's
"billion laughs": a few lines that expand to 10**9 values when the recipe is copied or saved)."""
import copy
import functools
from pathlib import Path
from typing import Any

import yaml

from launch.errors import ConfigError

MAX_DEPTH = 32
"""Levels of nesting a recipe may use; the deepest real one (a deepspeed: pass-through) uses 4."""
MAX_VALUES = 100_000
"""Values (mappings, lists and scalars, an alias counted each time it is used) a recipe may hold."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a mapping with the same key twice."""

    def construct_mapping(self, node, deep=False):
        first_line = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                repeated = key in first_line
            except TypeError:  # a list or mapping as a key: PyYAML's own error says so
                break
            if repeated:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice (lines {first_line[key]} and "
                                f"{key_node.start_mark.line + 1}); keep one", key_node.start_mark)
            first_line[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def parse_yaml(text: str, where: str) -> Any:
    """The value of YAML `text`; ConfigError naming `where` on anything a recipe cannot be. A copy
    of the value parsed before for the same text, if any: PyYAML is pure Python (about 3 ms for a
    recipe, its C loader would lose the line numbers of a key given twice), and the planner, the
    evaluation and the tests read the same recipe many times."""
    return copy.deepcopy(_parse_yaml(text, where))


@functools.lru_cache(maxsize=64)  # values only: an error is raised again each time
def _parse_yaml(text: str, where: str) -> Any:
    try:
        value = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{where} is not valid YAML: {_first_line(e)}") from None
    except ValueError as e:  # an integer past Python's 4,300 digits (sys.get_int_max_str_digits)
        raise ConfigError(f"{where} holds a number Python will not read: {str(e).split(';')[0]}") from None
    except RecursionError:
        raise ConfigError(f"{where} is nested too deeply for YAML to read (at most {MAX_DEPTH} levels)") from None
    _check_size(value, where)
    return value


def read_yaml_file(path: Path, where: str) -> Any:
    """The value of the YAML file at `path` (UTF-8)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{where} cannot be read: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                          f"save it as UTF-8") from None
    return parse_yaml(text, where)


def _first_line(error: yaml.YAMLError) -> str:
    """PyYAML's messages span lines (the problem, then the snippet); the problem and its place."""
    problem = getattr(error, "problem", None)
    mark = getattr(error, "problem_mark", None)
    if problem and mark is not None:
        return f"{problem} (line {mark.line + 1}, column {mark.column + 1})"
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _check_size(value: Any, where: str) -> None:
    """Walk `value` (without recursion: it may be a cycle, `&a [*a]`) up to the bounds above."""
    stack, count = [(value, 1)], 0
    while stack:
        item, depth = stack.pop()
        count += 1
        if depth > MAX_DEPTH:
            raise ConfigError(f"{where} is nested more than {MAX_DEPTH} levels deep; a recipe needs a few")
        if count > MAX_VALUES:
            raise ConfigError(f"{where} holds more than {MAX_VALUES} values (YAML aliases count each time "
                              f"they are used); a recipe needs a few hundred")
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for pair in item.items() for v in pair)
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
