"""Transformers weights in safetensors: read this rank's shards lazily (`--init-from-hf`), and
write an export shard by shard (issue 24, item 7; the experts of a mixture of experts, issue 26).

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

import json
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Dict, Iterable, List, Optional, Tuple

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


def safetensors_weight_map(source: str) -> Dict[str, Path]:
    """{transformers tensor name: the safetensors file holding it} of `source`, or a ConfigError."""
    from safetensors import safe_open
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
    with safe_open(single, framework="pt", backend="pread") as f:
        return {name: Path(single) for name in f.keys()}


def _index_weight_map(source: str, index: Path) -> Dict[str, str]:
    """The index's {tensor name: shard file}, each shard a relative path inside the model directory.
    The names come from the source: "../../etc/hostname" or "/etc/hostname" would be read from
    outside it (transformers' cached_file joins the name to the directory as it is). Checked by name,
    not by where links lead: a hub cache's snapshot files are links into its blobs/ directory."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--init-from-hf {source!r}: {INDEX} cannot be read ({type(e).__name__}: "
                          f"{str(e)[:200]!r}); download the whole model directory") from None
    if not isinstance(weight_map, dict):
        raise ConfigError(f"--init-from-hf {source!r}: {INDEX}'s weight_map is a {type(weight_map).__name__}, "
                          f"not a mapping of tensor names to shard files")
    for tensor, name in weight_map.items():
        parts = PurePosixPath(name).parts if isinstance(name, str) else ()
        if not parts or parts[0] == "/" or ".." in parts:
            raise ConfigError(f"--init-from-hf {source!r}: {INDEX} names {name!r} for {tensor!r}, which is not a "
                              f"file inside the model directory; only shard files inside it are read")
    return weight_map


def _by_file(weight_map: Dict[str, Path], names) -> Dict[Path, List[str]]:
    out: Dict[Path, List[str]] = {}
    for name in names:
        out.setdefault(weight_map[name], []).append(name)
    return out


def stored_shapes(weight_map: Dict[str, Path]) -> Dict[str, Tuple[int, ...]]:
    """The stored shape of every tensor (safetensors headers only)."""
    from safetensors import safe_open
    shapes = {}
    for path, names in _by_file(weight_map, weight_map).items():
        with safe_open(str(path), framework="pt", backend="pread") as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in names})
    return shapes


def load_hf_shards_into(module: torch.nn.Module, source: str, config: GPTConfig, pipeline: bool, tp_rank: int,
                        tp_size: int, *, ep_rank: int = 0, ep_size: int = 1) -> None:
    """Copy this rank's shard of every parameter of `module` (a PipelineModule stage when
    `pipeline`, else a dense GPT holding TP shards, and of a mixture of experts the experts of EP
    rank `ep_rank` of `ep_size`) from the safetensors of `source`, in place. Experts are read from
    one tensor per expert (save_pretrained's and the hub's format) or from transformers' fused
    (E, ., .) tensors (save_pretrained(save_original_format=False)), whichever the files hold."""
    import torch
    from safetensors import safe_open

    from model.hf.convert import dense_name
    from model.hf.shards import hf_sources, shard_plan
    weight_map = safetensors_weight_map(source)
    shapes = stored_shapes(weight_map)
    fused = any(name.endswith(".mlp.experts.gate_up_proj") for name in shapes)
    sources = hf_sources(config, fused_experts=fused)
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
            with safe_open(str(path), framework="pt", backend="pread") as f:
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
