"""complete.json, a checkpoint's manifest: what a save records (store.py writes it last, as the
commit) and the check that a manifest read back is one this version can resume, export or
evaluate: its format (CHECKPOINT_FORMAT), every key of its type and range, and a saved model this
version knows. Anything else is refused in one line naming the key, not as a TypeError or
KeyError wherever the key is first read."""
import dataclasses
import json
import types
import typing
from pathlib import Path, PurePosixPath
from typing import Any, Dict, Optional

from launch.errors import ConfigError
from model.config import ModelConfig
from model.moe_config import MoEConfig

COMPLETE = "complete.json"
CHECKPOINT_FORMAT = 2
"""complete.json's "format": what its keys and the files beside it mean. This version reads this
format only, and a checkpoint of any other (or of none) is refused in one line at --load: it is
resumed by the version that wrote it. A change to what a save writes that an older reader would
misread (a key renamed or its meaning changed, a weight renamed, files laid out anew) raises it,
and then every key the new format writes is required, so no reader keeps a branch per older save.
Format 2: the layout records train.virtual_stages and the chunks' boundaries (a rank's ZeRO-1
partition holds its v chunks' parameters, so a reader of format 1 would restore it into other layers)."""
ENGINE_ZERO_STAGE = "engine_zero_stage"
"""complete.json's ZeRO stage of the engine that saved (launch/analysis/engine_memory.py:
built_zero_stage), which may differ from the recipe's train.zero_stage."""
REQUIRED = ("format", "step", "samples", "layout", "recipe", "files", ENGINE_ZERO_STAGE, "world_size",
            "wandb_run_id", "data_state", "data_fingerprint", "data_origin_samples", "parent", "layout_auto")
"""Every key store.save writes into complete.json in CHECKPOINT_FORMAT."""


def read_complete(path: Path) -> Optional[Dict[str, Any]]:
    """complete.json of tag directory `path`, or None if it has none (an interrupted save). One
    that exists but cannot be read, or is no manifest (`check_manifest`), is an error: loading an
    older checkpoint instead would silently throw away training."""
    manifest = path / COMPLETE
    if not manifest.exists():
        return None
    try:
        meta = json.loads(manifest.read_text(encoding="utf-8"))
    # ValueError: not UTF-8, not JSON, or an integer past 4300 digits; RecursionError: nested too deep
    except (OSError, ValueError, RecursionError) as e:
        raise _unreadable(path, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}") from None
    check_manifest(path, meta)
    return meta


def _unreadable(path: Path, why: str) -> ConfigError:
    return ConfigError(f"checkpoint {str(path)!r} has an unreadable {COMPLETE} ({why}); restore it or load another "
                       f"checkpoint (a tag directory) explicitly")


INT64_MAX = 2 ** 63 - 1
"""The largest count a manifest holds: steps, samples and sizes become torch's int64."""
STAGES = (0, 1, 2, 3)


def _count(value: Any, least: int = 0) -> bool:
    return type(value) is int and least <= value <= INT64_MAX  # type(): a JSON true is no count


def _name(value: Any) -> bool:
    return type(value) is str and value.isprintable()


def _optional(value: Any, kind: type) -> bool:
    return value is None or type(value) is kind


_ABSENT = object()
"""A manifest's key that is not there (its message says "no KEY")."""


def shown_value(value: Any) -> str:
    """A value read from a file, for a one-line message: a string as repr, anything else as JSON
    spells it (true, null), control characters escaped by both; a long one cut."""
    text = repr(value) if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 100 else text[:100] + "..."


def inside_tag_dir(name: Any) -> bool:
    """Whether a manifest's file name lies inside the tag directory: a relative path, no `..` (also
    what object storage downloads of a manifest it has not checked yet)."""
    if not isinstance(name, str):
        return False
    parts = PurePosixPath(name).parts
    return bool(parts) and not PurePosixPath(name).is_absolute() and ".." not in parts


def check_manifest(path: Path, meta: Any) -> None:
    """The keys of complete.json that a resume, an export or an evaluation reads, each of its type
    and range: a manifest of another shape (hand-edited, cut, another program's) is refused here
    in one line naming the key, not as a TypeError or KeyError wherever the key is first read."""
    def need(key: str, value: Any, ok: bool, expected: str) -> None:
        if not ok:
            found = f"no {key}" if value is _ABSENT else f"{key}={shown_value(value)}"
            raise _unreadable(path, f"{found}, expected {expected}")
    if not isinstance(meta, dict):
        raise _unreadable(path, f"it holds {shown_value(meta)}, not a JSON object")
    check_format(path, meta)
    missing = [key for key in REQUIRED if key not in meta]
    if missing:
        raise _unreadable(path, f"no {', '.join(missing)}")
    for key in ("step", "samples"):
        need(key, meta[key], _count(meta[key]), f"an integer from 0 to {INT64_MAX}")
    origin = meta["data_origin_samples"]
    need("data_origin_samples", origin, _count(origin) and origin <= meta["samples"], "an integer from 0 to samples")
    need("world_size", meta["world_size"], _count(meta["world_size"], 1), "an integer >= 1")
    for key in ("parent", "wandb_run_id"):
        need(key, meta[key], _optional(meta[key], str), "a string or null")
    for key in ("data_state", "data_fingerprint", "layout_auto"):  # null: no stream positions, no data, no auto
        need(key, meta[key], _optional(meta[key], dict), "an object or null")
    stage = meta[ENGINE_ZERO_STAGE]
    need(ENGINE_ZERO_STAGE, stage, type(stage) is int and stage in STAGES, "0, 1, 2 or 3")
    files = meta["files"]
    need("files", files, isinstance(files, dict), "an object of file names and sizes")
    for name, size in files.items():
        need("a file name in files", name, inside_tag_dir(name), "a path inside the checkpoint directory")
        need(f"files[{shown_value(name)}]", size, _count(size), "a size in bytes")
    recipe = meta["recipe"]
    need("recipe", recipe, isinstance(recipe, dict), "an object")
    for key in ("model", "train", "data"):
        need(f"recipe.{key}", recipe.get(key, _ABSENT), isinstance(recipe.get(key), dict), "an object")
    tokenizer = recipe["data"].get("tokenizer", _ABSENT)  # an export's, unless it names its own
    need("recipe.data.tokenizer", tokenizer, type(tokenizer) is str, "a tokenizer's name or directory")
    _check_saved_train(need, recipe["train"])
    _check_saved_layout(need, meta["layout"], _check_saved_model(path, recipe["model"]).n_layer)


def check_format(path: Path, meta: Dict[str, Any]) -> None:
    """A complete.json of another CHECKPOINT_FORMAT than this version's, or of none, in one line."""
    found = meta.get("format", _ABSENT)
    if type(found) is not int or found != CHECKPOINT_FORMAT:  # type(): a JSON true is no format
        shown = "no format" if found is _ABSENT else f"format {shown_value(found)}"
        raise ConfigError(f"checkpoint {str(path)!r} has {shown}; this version reads format {CHECKPOINT_FORMAT}: "
                          f"resume it with the version that wrote it")


def _check_saved_train(need, train: Dict[str, Any]) -> None:
    """What a resume compares with the run's recipe (check_compatible) and an export reads."""
    stage, batch, precision, optimizer, seed = (train.get(key, _ABSENT) for key in
                                                ("zero_stage", "global_batch_size", "precision", "optimizer", "seed"))
    need("recipe.train.zero_stage", stage, type(stage) is int and stage in STAGES, "0, 1, 2 or 3")
    need("recipe.train.global_batch_size", batch, _count(batch, 1), "an integer >= 1")
    need("recipe.train.precision", precision, _name(precision), "a name such as fp32")
    need("recipe.train.optimizer", optimizer, _name(optimizer), "a name such as adamw")  # messages repeat it
    need("recipe.train.seed", seed, _fits(seed, int), "an integer")


def _check_saved_layout(need, layout: Any, n_layer: int) -> None:
    """(tp, pp, dp, cp, ep, virtual_stages), the stage boundaries `parts`: pp + 1 layer indices from 0
    up, or [] (a pipeline cut by DeepSpeed, by counting blocks), and at v > 1 the chunks' boundaries
    `chunk_parts`: pp x v + 1 of them ([] at v = 1)."""
    need("layout", layout, isinstance(layout, dict), "an object of tp, pp, dp, cp, ep, virtual_stages, parts, "
                                                     "chunk_parts")
    for key in ("tp", "pp", "dp", "cp", "ep", "virtual_stages"):
        value = layout.get(key, _ABSENT)
        need(f"layout.{key}", value, _count(value, 1), "an integer >= 1")
    need("layout.pp", layout["pp"], layout["pp"] <= n_layer, f"at most model.n_layer={n_layer} (a block per stage)")
    parts = layout.get("parts", _ABSENT)
    need("layout.parts", parts, parts == [] or _boundaries(parts, layout["pp"]),
         f"{layout['pp'] + 1} layer indices from 0 up (the stage boundaries) or []")
    v, chunks = layout["virtual_stages"], layout.get("chunk_parts", _ABSENT)
    if v == 1:
        need("layout.chunk_parts", chunks, chunks == [], "[] at virtual_stages=1 (no chunks)")
    else:
        need("layout.chunk_parts", chunks, _boundaries(chunks, layout["pp"] * v),
             f"{layout['pp'] * v + 1} layer indices from 0 up (the boundaries of pp x virtual_stages chunks)")


def _boundaries(found: Any, stages: int) -> bool:
    """`stages` + 1 layer indices from 0 up: where each stage's layers begin, and the end."""
    return (isinstance(found, list) and len(found) == stages + 1 and all(_count(p) for p in found)
            and found[0] == 0 and found == sorted(found))


MODEL_KEYS, MOE_KEYS = ({f.name for f in dataclasses.fields(kind)} for kind in (ModelConfig, MoEConfig))


def _check_saved_model(path: Path, model: Dict[str, Any]) -> ModelConfig:
    """The saved recipe's model: every key of it (a save writes the model resolved, every switch
    set), all known to this version (else a newer version saved it, and the model it names cannot
    be built here), each of its field's type, and valid."""
    moe = model.get("moe", _ABSENT)
    if not isinstance(moe, dict):
        raise _unreadable(path, "no recipe.model.moe" if moe is _ABSENT else f"recipe.model.moe={shown_value(moe)}, "
                                                                           f"expected an object")
    unknown = sorted(set(model) - MODEL_KEYS) + sorted(f"moe.{key}" for key in set(moe) - MOE_KEYS)
    if unknown:
        raise ConfigError(f"checkpoint {str(path)!r} was written by a newer version: its recipe has "
                          f"model.{shown_value(unknown[0])[1:-1]}, a key this version does not know; resume or export it "
                          f"with the version that saved it (or a newer one)")
    missing = sorted(MODEL_KEYS - set(model)) + sorted(f"moe.{key}" for key in MOE_KEYS - set(moe))
    if missing:
        raise _unreadable(path, f"no recipe.model.{missing[0]}")
    hints, moe_hints = typing.get_type_hints(ModelConfig), typing.get_type_hints(MoEConfig)
    fields = [(f"model.{key}", value, hints[key]) for key, value in model.items() if key != "moe"]
    fields += [(f"model.moe.{key}", value, moe_hints[key]) for key, value in moe.items()]
    for key, value, kind in fields:
        if not _fits(value, kind):
            name = str(kind).replace("typing.", "") if typing.get_origin(kind) else kind.__name__
            raise _unreadable(path, f"recipe.{key}={shown_value(value)}, expected {name}")
    try:
        config = ModelConfig(**model)
        config.validate()
    except ValueError as e:  # model/config.py names the field and its value
        raise _unreadable(path, f"recipe.{str(e).splitlines()[0][:300]}") from None
    return config


def _fits(value: Any, kind: Any) -> bool:
    """Whether a JSON value is of a config field's type: an int no bool, a float any finite number."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):  # Optional[T], T | None
        return any(_fits(value, choice) for choice in typing.get_args(kind))
    if kind is float:
        return _count(abs(value)) if type(value) is int else type(value) is float and abs(value) < float("inf")
    if kind is int:
        return type(value) is int and _count(abs(value))
    return type(value) is (typing.get_origin(kind) or kind)  # str, bool, NoneType, a dict
