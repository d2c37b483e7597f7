"""Resolve `data.name` to an HF `datasets.Dataset` (map-style mode; streaming reads files by
units, data/files.py and data/units.py): builtin, save_to_disk directory, local files / glob, or
hub id; and the identity of that source for the cache key.

Validation documents (when no `val_split` is given) are chosen by a hash of their text, not by
their index: a document is held out when its hash, mapped to [0, 1), is below val_fraction.
The rule depends on nothing but the document, whatever the file order. Identical texts land on
the same side, so a duplicate of a held-out document never trains. (Streaming holds out whole
units instead, by a hash of the unit: data/units.py.)
"""
import glob
import hashlib
import os
from pathlib import Path
from typing import List, Optional

import datasets

from data.builtin import BUILTIN, builtin_corpus, python_version
from data.files import refuse_hub_options
from data.hub import hub_errors_only
from data.spec import DataError, DataSpec

FILE_BUILDERS = {".txt": "text", ".md": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def local_files(name: str) -> Optional[List[str]]:
    """The files `name` points to when it is a file or glob, else None."""
    if os.path.isdir(name):
        return None
    if any(c in name for c in "*?[") or os.path.isfile(name):
        return sorted(glob.glob(name))
    return None


def looks_local(name: str) -> bool:
    return name.startswith((".", "/", "~")) or Path(name).suffix in FILE_BUILDERS


def source_identity(spec: DataSpec) -> list:
    """What identifies the raw data: local files by path, size and mtime; hub data by id,
    config, split and revision (pin `revision` to make the cache follow upstream changes)."""
    if spec.name == BUILTIN:
        return [BUILTIN, python_version()]
    files = local_files(spec.name)
    if files:
        return [(f, os.path.getsize(f), os.path.getmtime(f)) for f in files]
    if os.path.isdir(spec.name):
        state = Path(spec.name) / "dataset_info.json"
        return [spec.name, state.stat().st_mtime if state.exists() else None]
    return [spec.name, spec.config, spec.revision, spec.data_files_by_split()]


def _load_split(spec: DataSpec, split: str) -> datasets.Dataset:
    name = os.path.expanduser(spec.name)
    files = None if name == BUILTIN else local_files(name)
    if name == BUILTIN or files is not None or os.path.isdir(name):  # our own reading: hub options would be ignored
        refuse_hub_options(spec.name, spec.config, spec.revision, spec.data_files)
    if name == BUILTIN:
        if split != "train":
            raise DataError(f"data.name=builtin has only a 'train' split, not {split!r}; use data.val_fraction")
        return builtin_corpus()
    if files is not None:
        if not files:
            raise DataError(f"data.name={spec.name!r} matches no file")
        suffixes = {Path(f).suffix for f in files}
        if len(suffixes) != 1 or next(iter(suffixes)) not in FILE_BUILDERS:
            raise DataError(f"data.name={spec.name!r}: files must share one of the suffixes "
                            f"{', '.join(FILE_BUILDERS)}; got {sorted(suffixes)}")
        if all(os.path.getsize(f) == 0 for f in files):
            raise DataError(f"data.name={spec.name!r} is empty: {len(files)} file(s) of 0 bytes")
        try:
            return datasets.load_dataset(FILE_BUILDERS[suffixes.pop()], data_files={"train": files},
                                         split="train")
        except Exception as e:  # malformed JSON, CSV or parquet
            raise DataError(f"data.name={spec.name!r} could not be read: {type(e).__name__}: "
                            f"{str(e).splitlines()[0][:200]}") from None
    if os.path.isdir(name):
        try:
            loaded = datasets.load_from_disk(name)
        except FileNotFoundError:
            raise DataError(f"data.name={spec.name!r} is a directory but not one written by "
                            f"Dataset.save_to_disk") from None
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise DataError(f"data.name={spec.name!r} has splits {list(loaded)}, not {split!r}")
            loaded = loaded[split]
        return loaded
    if looks_local(name):
        raise DataError(f"data.name={spec.name!r}: no such file or directory")
    try:
        with hub_errors_only():  # its retry warnings would bury our one-line error
            return datasets.load_dataset(name, spec.config, split=split, revision=spec.revision,
                                         data_files=spec.data_files_by_split())
    except Exception as e:  # the hub raises many types: unknown id, offline, bad config or split
        raise DataError(f"data.name={spec.name!r} (config={spec.config!r}, split={split!r}) could not be "
                        f"loaded: {type(e).__name__}: {str(e).splitlines()[0][:200]}") from None


def _check_text_field(ds: datasets.Dataset, spec: DataSpec) -> None:
    columns = ds.column_names
    if columns is not None and spec.text_field not in columns:
        raise DataError(f"data.text_field={spec.text_field!r} is not a column of {spec.name!r}; "
                        f"columns: {', '.join(columns)}")


def saved_dataset_dir(name: str) -> bool:
    """Whether `name` is a directory written by `Dataset.save_to_disk` (or a DatasetDict's)."""
    path = Path(os.path.expanduser(name))
    return path.is_dir() and any((path / f).exists() for f in ("state.json", "dataset_dict.json"))


def in_memory_split(spec: DataSpec, split: str) -> datasets.Dataset:
    """The split of `builtin` or of a save_to_disk directory, memory-mapped (streaming reads it
    by row ranges, data/units.py)."""
    ds = _load_split(spec, split)
    _check_text_field(ds, spec)
    return ds


def held_out(text: str, val_fraction: float) -> bool:
    """True for a validation document: blake2b of its UTF-8 text, as a number in [0, 1),
    below val_fraction. Stable across machines, Python versions and runs."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0 ** 64 < val_fraction


def load_train_val(spec: DataSpec):
    """Map-style (train, validation or None) datasets for the spec."""
    train = _load_split(spec, spec.split)
    _check_text_field(train, spec)
    if len(train) == 0:
        raise DataError(f"data.name={spec.name!r} split {spec.split!r} is empty")
    if spec.val_split is not None:
        val = _load_split(spec, spec.val_split)
        _check_text_field(val, spec)
        return train, val
    if spec.val_fraction > 0:
        field, f, nproc = spec.text_field, spec.val_fraction, spec.num_proc if spec.num_proc > 1 else None
        val = train.filter(lambda b: [held_out(t or "", f) for t in b[field]], batched=True, num_proc=nproc)
        train = train.filter(lambda b: [not held_out(t or "", f) for t in b[field]], batched=True, num_proc=nproc)
        return train, val
    return train, None
