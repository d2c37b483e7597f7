"""Transformers weights in safetensors: read this rank's shards lazily (`--init-from-hf`), and
write an export shard by shard (the experts of a mixture of experts).

Each parameter of the local stage gets its plan (model/hf/shards.py: which stored tensors and
which slices of them); each piece is read with safetensors' `get_slice(name)[index]` straight
into its place in the parameter, so a rank holds its own shard plus one piece at a time, never
the model; of an expert weight it reads its EP rank's experts only, each's TP slice.
The files are opened with safetensors' `pread` backend: bytes are read, not memory-mapped, so
pages of tensors other ranks hold never count in this rank's memory.

Files are found as transformers finds them (`cached_file`: a local directory, the hub cache, or
the hub): `model.safetensors.index.json` and its shards (each a relative path inside the model
directory, else a one-line error), or one `model.safetensors`. A source with only
`pytorch_model.bin` is refused before any process group starts (docs/checkpoints.md says how to
convert it once).
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Dict, Iterable, Iterator, List, Optional, Tuple

from data.json_files import json_kind, one_line, read_json_object
from launch.errors import ConfigError

if TYPE_CHECKING:  # annotations only: the checks before the start import no torch
    import torch

    from model.config import GPTConfig

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def _cached(source: str, filename: str) -> Optional[str]:
    from transformers.utils import cached_file

    from data.hub import hub_errors_only
    with hub_errors_only():
        return cached_file(source, filename, _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False)


def read_hf_json(source: str, path: Path) -> Dict[str, Any]:
    """The JSON object in `path`, a file of `source`, or a ConfigError naming the file and why."""
    value, why = read_json_object(path)
    if value is None:
        raise ConfigError(f"--init-from-hf {source!r}: {path.name} {why}; download the whole model directory "
                          f"again (or save it with save_pretrained)")
    return value


@contextlib.contextmanager
def open_safetensors(source: str, path: Path) -> Iterator[Any]:
    """safetensors' safe_open of `path` (pread, framework pt), a file of `source`; a header it cannot
    read (an empty file: "header too small"; a length past the file's end: "invalid header length";
    not JSON) is a ConfigError naming the file instead of a SafetensorError."""
    from safetensors import SafetensorError, safe_open
    try:
        handle = safe_open(str(path), framework="pt", backend="pread")
    except (SafetensorError, OSError) as e:
        raise ConfigError(f"--init-from-hf {source!r}: {path.name} is not a safetensors file ({one_line(e)}, "
                          f"{_size(path)}); download the whole model directory again") from None
    with handle as f:
        yield f


def _size(path: Path) -> str:
    try:
        return f"{path.stat().st_size} bytes"
    except OSError as e:
        return type(e).__name__


def safetensors_weight_map(source: str) -> Dict[str, Path]:
    """{transformers tensor name: the safetensors file holding it} of `source`, or a ConfigError."""
    index = _cached(source, INDEX)
    if index is not None:
        files = _index_weight_map(source, Path(index))
        paths = {name: _cached(source, name) for name in sorted(set(files.values()))}
        missing = [name for name, path in paths.items() if path is None]
        if missing:
            raise ConfigError(f"--init-from-hf {source!r}: {INDEX} names {missing[0]}, which is not there; "
                              f"download the whole model directory")
        return {tensor: Path(paths[name]) for tensor, name in files.items()}
    single = _cached(source, SINGLE)
    if single is None:
        raise ConfigError(f"--init-from-hf {source!r} has no {SINGLE} or {INDEX} (only safetensors weights are "
                          f"read, lazily, shard by shard); convert it once: python -c \"from transformers import "
                          f"AutoModelForCausalLM as M; M.from_pretrained('SRC').save_pretrained('DST')\"")
    with open_safetensors(source, Path(single)) as f:
        return {name: Path(single) for name in f.keys()}


def _index_weight_map(source: str, index: Path) -> Dict[str, str]:
    """The index's {tensor name: shard file}, each shard a relative path inside the model directory.
    The names come from the source: "../../etc/hostname" or "/etc/hostname" would be read from
    outside it (transformers' cached_file joins the name to the directory as it is). Checked by name,
    not by where links lead: a hub cache's snapshot files are links into its blobs/ directory."""
    weight_map = read_hf_json(source, index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ConfigError(f"--init-from-hf {source!r}: {INDEX}'s weight_map is "
                          f"{'missing' if weight_map is None else json_kind(weight_map)}, not a mapping of tensor "
                          f"names to shard files; download the whole model directory again")
    for tensor, name in weight_map.items():
        if not isinstance(name, str):
            raise ConfigError(f"--init-from-hf {source!r}: {INDEX}'s weight_map[{tensor!r}] is {json_kind(name)} "
                              f"({json.dumps(name)[:60]}), not a shard file's name; download the whole model "
                              f"directory again")
        parts = PurePosixPath(name).parts
        if not parts or parts[0] == "/" or ".." in parts:
            raise ConfigError(f"--init-from-hf {source!r}: {INDEX} names {name!r} for {tensor!r}, which is not a "
                              f"file inside the model directory; only shard files inside it are read")
    return weight_map


def _by_file(weight_map: Dict[str, Path], names) -> Dict[Path, List[str]]:
    out: Dict[Path, List[str]] = {}
    for name in names:
        out.setdefault(weight_map[name], []).append(name)
    return out


def stored_shapes(source: str, weight_map: Dict[str, Path]) -> Dict[str, Tuple[int, ...]]:
    """The stored shape of every tensor (safetensors headers only); a ConfigError for a file that is
    not safetensors or lacks a tensor the index places in it."""
    shapes = {}
    for path, names in _by_file(weight_map, weight_map).items():
        with open_safetensors(source, path) as f:
            held = set(f.keys())
            absent = [name for name in names if name not in held]
            if absent:
                raise ConfigError(f"--init-from-hf {source!r}: {INDEX} places {absent[0]!r} in {path.name}, which "
                                  f"does not hold it; download the whole model directory again")
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in names})
    return shapes


def check_hf_tensors(source: str, config: GPTConfig) -> None:
    """Every tensor the run's model is read from is in `source`'s safetensors, their headers read
    (before any process group: `load_hf_shards_into` would fail on the first one missing)."""
    from model.hf.shards import hf_sources
    shapes = stored_shapes(source, safetensors_weight_map(source))
    wanted = [name for held in hf_sources(config, fused_experts=_fused(shapes)).values() for name in held.names]
    missing = [name for name in wanted if name not in shapes]
    if missing:
        raise ConfigError(f"--init-from-hf {source!r} has no tensor {missing[0]!r} ({len(missing)} of the "
                          f"{len(wanted)} this run's model reads are missing); pass a complete {config.arch} model "
                          f"directory as transformers' save_pretrained writes it")


def _fused(shapes: Dict[str, Tuple[int, ...]]) -> bool:
    """Whether the experts are stored fused (one (E, ., .) tensor), not one tensor per expert."""
    return any(name.endswith(".mlp.experts.gate_up_proj") for name in shapes)


def load_hf_shards_into(module: torch.nn.Module, source: str, config: GPTConfig, pipeline: bool, tp_rank: int,
                        tp_size: int, *, ep_rank: int = 0, ep_size: int = 1) -> None:
    """Copy this rank's shard of every parameter of `module` (a PipelineModule stage when
    `pipeline`, else a dense GPT holding TP shards, and of a mixture of experts the experts of EP
    rank `ep_rank` of `ep_size`) from the safetensors of `source`, in place. Experts are read from
    one tensor per expert (save_pretrained's and the hub's format) or from transformers' fused
    (E, ., .) tensors (save_pretrained(save_original_format=False)), whichever the files hold."""
    import torch

    from model.hf.convert import dense_name
    from model.hf.shards import hf_sources, shard_plan
    weight_map = safetensors_weight_map(source)
    shapes = stored_shapes(source, weight_map)
    sources = hf_sources(config, fused_experts=_fused(shapes))
    plans = {}
    for name, param in module.named_parameters():
        key = dense_name(name, config) if pipeline else name
        source_of = sources.get(key)
        missing = [n for n in (source_of.names if source_of else [key]) if n not in shapes]
        if source_of is None or missing:
            raise KeyError(f"no weights for {key} (parameter {name}) in {source}: {missing[:4] or 'no source'}")
        plan = shard_plan(key, source_of, {n: shapes[n] for n in source_of.names}, tp_rank, tp_size,
                          config.padded_vocab_size(tp_size), ep_rank=ep_rank, ep_size=ep_size, config=config)
        if plan.shape != tuple(param.shape):
            raise ValueError(f"{key}: the weights give a shard of {plan.shape} on tp rank {tp_rank} of {tp_size}"
                             f"{f' and ep rank {ep_rank} of {ep_size}' if ep_size > 1 else ''}, the model has "
                             f"{tuple(param.shape)}")
        plans[name] = (param, plan)
    # One file open at a time; within it, each piece read and copied to its place before the next.
    destinations: Dict[str, List[Tuple[torch.Tensor, object, bool]]] = {}
    with torch.no_grad():
        for param, plan in plans.values():
            for piece in plan.pieces:
                destinations.setdefault(piece.name, []).append((param[piece.at], piece, plan.transpose))
            if plan.padding is not None:
                param[plan.padding:].zero_()  # vocab padding rows, zeros as at init (contract 4)
        for path, names in _by_file(weight_map, destinations).items():
            with open_safetensors(source, path) as f:
                for name in names:
                    for place, piece, transpose in destinations[name]:
                        value = f.get_slice(name)[piece.index]
                        place.copy_(value.t() if transpose else value)  # Conv1D (in, out) -> ours (out, in)


def write_safetensors(out: Path, tensors: Iterable[Tuple[str, torch.Tensor]], max_shard_bytes: int) -> torch.dtype:
    """Write (name, tensor) pairs as they come into safetensors files of at most `max_shard_bytes`
    (a larger tensor gets one of its own): `model.safetensors` when one is enough, else
    transformers' `model-0000i-of-0000N.safetensors` and `model.safetensors.index.json`. Holds
    one shard at a time; returns the tensors' dtype (for config.json)."""
    import torch
    from safetensors.torch import save_file
    shards: List[List[str]] = []
    pending: Dict[str, torch.Tensor] = {}
    size, total, dtype = 0, 0, torch.float32

    def flush() -> None:
        save_file(pending, str(out / f".shard-{len(shards):05d}.tmp"), metadata={"format": "pt"})
        shards.append(list(pending))
        pending.clear()

    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if pending and size + nbytes > max_shard_bytes:
            flush()
            size = 0
        pending[name], dtype = tensor.contiguous(), tensor.dtype
        size += nbytes
        total += nbytes
    if pending:
        flush()
    names = [SINGLE] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                               for i in range(len(shards))]
    for i, name in enumerate(names):
        (out / f".shard-{i:05d}.tmp").replace(out / name)
    if len(shards) > 1:
        weight_map = {tensor: name for name, held in zip(names, shards) for tensor in held}
        (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return dtype
