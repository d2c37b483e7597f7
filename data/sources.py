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
import json
import os
from pathlib import Path
from typing import Any, List, Optional, Tuple

import datasets

from data.builtin import BUILTIN, builtin_corpus, python_version
from data.files import refuse_hub_options
from data.hub import datasets_progress, datasets_silent, hub_errors_only
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
    name = os.path.expanduser(spec.name)
    if not spec.streaming and (local_files(name) is not None or os.path.isdir(name)):  # as _load_split, which a
        refuse_hub_options(spec.name, spec.config, spec.revision, spec.data_files)  # cached build never runs
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
        builder = FILE_BUILDERS[suffixes.pop()]
        try:
            with datasets_silent():
                ds = datasets.load_dataset(builder, data_files={"train": files}, split="train")
            if builder == "json" and spec.text_field in ds.column_names:  # pyarrow's JSON reader keeps bad UTF-8:
                ds.data.column(spec.text_field).validate(full=True)  # reading it would raise UnicodeDecodeError
            return ds
        except Exception as e:  # malformed JSON, CSV or parquet
            raise DataError(first_bad_line(spec, files) or f"data.name={spec.name!r} could not be read: "
                            f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}") from None
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
    """The text column is there and holds a string in every row: the tokenizer raises a TypeError
    on anything else (a number or a null; datasets reads a JSON column of mixed types as Json)."""
    columns = ds.column_names
    if columns is None:
        return
    if spec.text_field not in columns:
        raise DataError(f"data.text_field={spec.text_field!r} is not a column of {spec.name!r}; "
                        f"columns: {', '.join(columns)}")
    feature = ds.features[spec.text_field]
    if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")) \
            or ds.data.column(spec.text_field).null_count:
        files = None if spec.name == BUILTIN else local_files(os.path.expanduser(spec.name))
        raise DataError(first_bad_line(spec, files or []) or _first_bad_row(ds, spec))


def shown(value: Any) -> str:
    """A document's value as JSON spells it (null, true), cut short, on one line."""
    text = json.dumps(value, ensure_ascii=True, default=repr)
    return text if len(text) <= 60 else text[:57] + "..."


def _first_bad_row(ds: datasets.Dataset, spec: DataSpec) -> str:
    """The message for the first row whose text is not a string (read only on this error path)."""
    where = f"data.name={spec.name!r}"
    for row, text in enumerate(ds[spec.text_field], 1):
        if not isinstance(text, str):
            return (f"{where} row {row}: {spec.text_field} is {shown(text)}, not a string; give every document's "
                    f"text as a string (data.text_field={spec.text_field!r})")
    return f"{where}: data.text_field={spec.text_field!r} holds {ds.features[spec.text_field]}, not strings"


def first_bad_line(spec: DataSpec, files: List[str]) -> Optional[str]:
    """The message for the first line of the JSON Lines files among `files` that is not an object
    with a string at data.text_field, or None. Read only on an error path: a file checked up front
    would be parsed twice per run. A .json file whose first line is not an object on its own is
    one JSON document (an array of rows, or columns), which datasets reads too: skipped."""
    for path in files:
        if FILE_BUILDERS.get(Path(path).suffix) != "json":
            continue
        with open(path, "rb") as lines:
            for k, (number, line) in enumerate((n, line) for n, line in enumerate(lines, 1) if line.strip()):
                doc, why = _document(line, spec.text_field)
                if why and k == 0 and Path(path).suffix == ".json" and not isinstance(doc, dict):
                    break
                if why:
                    file = "" if path == os.path.expanduser(spec.name) else f", file {path!r},"
                    return f"data.name={spec.name!r}{file} line {number}: {why}"
    return None


def _document(line: bytes, field: str) -> Tuple[Any, Optional[str]]:
    """(one JSON Lines line's value, what is wrong with it as a document or None)."""
    try:
        doc = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        return None, f"is not UTF-8 (byte {e.start + 1}: {line[e.start:e.start + 1]!r}); save the file as UTF-8"
    except (ValueError, RecursionError) as e:  # JSONDecodeError; over 4,300 digits; nested too deep
        return None, f"is not JSON ({type(e).__name__}: {str(e)[:100]}); give one JSON object per line"
    if not isinstance(doc, dict):
        return doc, f"is {shown(doc)}, not a JSON object; give one object per line"
    if not isinstance(doc.get(field), str):
        return doc, (f"{field} is {shown(doc.get(field)) if field in doc else 'missing'}, not a string; give every "
                     f"document's text as a string (data.text_field={field!r})")
    return doc, None


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
        with datasets_progress(len(train)):
            val = train.filter(lambda b: [held_out(t or "", f) for t in b[field]], batched=True, num_proc=nproc)
            train = train.filter(lambda b: [not held_out(t or "", f) for t in b[field]], batched=True, num_proc=nproc)
        return train, val
    return train, None
