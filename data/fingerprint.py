"""What decides which samples each step draws, saved in every checkpoint.

A resume continues the data from its saved position: the sample count (cached data) or each
stream's unit and row (streaming). That position means the same samples only under the same
dealing. Measured before this check: `shuffle_buffer` 8 -> 16 on a resume trained 16 windows twice
and 16 never; one file added to the glob retrained 109 of 461 documents already trained; an
upstream commit to an unpinned hub dataset does the same. So the checkpoint keeps this
fingerprint, and a resume whose data differs is refused in one line naming what changed
(launch/trainer/startup.py), unless `--restart-data` asks for the data order to start again.

The fingerprint holds what the dealing depends on: the run's seed, sequence length and tokenizer;
per source its split, revision, config, text field, validation split or fraction, shuffling; the
streams, shuffle block and unit size, and each file's name (relative to the source's common
directory, so a mirror under another URL keeps it), size and content identity, the best its
filesystem offers (data/files.py content_version: the hub's LFS sha256 or blob id, an ETag, a
local file's mtime), and the hub commit a hub source was read at, for streamed sources; the
number of windows and a digest of a spread of them for cached ones; the mixture's labels and
weights. Content rewritten in place at the same size, or another directory with the same names
and sizes, reads other documents at the same unit positions; a hub branch that moved, other files."""
import dataclasses
import hashlib
import json
from typing import Any, Dict, List, Optional

import numpy as np

from data.spec import DataSpec
from data.windows import tokenizer_fingerprint

_SAMPLED_WINDOWS = 64  # cached windows digested: evenly spread, cheap at any corpus size


def data_fingerprint(data) -> Dict[str, Any]:
    """A flat mapping "data.<field>" -> JSON value for a RunData (one source or a mixture)."""
    found: Dict[str, Any] = {"train.seed": data.seed, "data.seq_len": data.seq_len,
                             "data.tokenizer": tokenizer_fingerprint(data.tokenizer)[:16]}
    if hasattr(data, "parts"):  # a mixture (data/mixture_run.py)
        found["data.mix"] = [[s.label, str(s.weight)] for s in data.sources]
        for i, part in enumerate(data.parts):
            found.update(_source(part, f"data.mix[{i}]"))
    else:
        found.update(_source(data, "data"))
    return found


def _source(part, prefix: str) -> Dict[str, Any]:
    spec = part.spec
    fields = {f"{prefix}.{name}": getattr(spec, name)
              for name in ("split", "config", "revision", "data_files", "text_field", "val_split", "val_fraction",
                           "shuffle")}
    if part.streamed:
        files = part.train_stream.reader.files if hasattr(part.train_stream.reader, "files") else None
        fields.update({f"{prefix}.{name}": getattr(spec, name) for name in ("streams", "shuffle_buffer", "unit_bytes")})
        if files is not None:
            fields[f"{prefix}.files"] = [[name, size, version] for name, size, version
                                         in zip(files.names, files.sizes, files.versions)]
            fields[f"{prefix}.commit"] = files.commit
        else:  # a dataset in memory read by row ranges (builtin, a save_to_disk directory)
            fields[f"{prefix}.units"] = part.train_stream.reader.fingerprint()
    else:
        windows = part.train_windows
        picked = np.linspace(0, len(windows) - 1, num=min(_SAMPLED_WINDOWS, len(windows))).astype(np.int64)
        digest = hashlib.blake2b(np.ascontiguousarray(windows[picked]).astype(np.int64).tobytes(), digest_size=8)
        fields[f"{prefix}.windows"] = [int(len(windows)), digest.hexdigest()]
    return fields


def at_saved_commit(spec: DataSpec, saved: Optional[Dict[str, Any]]) -> DataSpec:
    """The spec of a resumed run, an unpinned hub source (no data.revision) read at the commit its
    checkpoint was saved with (`data.commit`), so that a branch that moved since does not refuse
    the resume: the data is the saved commit's. Any other spec (pinned, off the hub, a mixture, no
    saved fingerprint) as it is."""
    commit = (saved or {}).get("data.commit")
    if getattr(spec, "mix", None) or spec.revision is not None or not isinstance(commit, str):
        return spec
    return dataclasses.replace(spec, revision=commit)


def fingerprint_changes(saved: Dict[str, Any], now: Dict[str, Any]) -> List[str]:
    """What differs, one short phrase per field, in the fingerprint's order."""
    changes = []
    for key in list(saved) + [k for k in now if k not in saved]:
        before, after = saved.get(key), now.get(key)
        if json.dumps(before) == json.dumps(after):  # JSON's view: a saved tuple is a list
            continue
        if key.endswith(".revision") and before is None and after == saved.get(key[:-len("revision")] + "commit"):
            continue  # an unpinned source resumed at its saved commit (at_saved_commit): the same data
        if key.endswith(".files") and before is not None and after is not None:
            changed = _file_changes(before, after)
            if changed:
                changes.append(f"{key}: {changed}")
        elif key.endswith(".commit"):
            changes.append(f"{key}: the hub revision moved from commit {_shown(before)} to {_shown(after)} (pin "
                           f"data.revision={before} to read the commit it was saved with, or hf://...@{before}/... "
                           f"in an hf:// URL)")
        elif key.endswith((".windows", ".tokenizer", ".units")):
            changes.append(f"{key} (its content) changed")
        else:
            changes.append(f"{key} was {_shown(before)}, now {_shown(after)}")
    return changes


def _file_changes(before: List[List[Any]], after: List[List[Any]]) -> str:
    """"" when the same files, else what differs: each entry is [name, size, content identity]."""
    old, new = ({entry[0]: tuple(entry[1:]) for entry in files} for files in (before, after))
    same_size = [n for n in new if n in old and new[n][0] == old[n][0]]
    parts = []
    for what, names in (("added", [n for n in new if n not in old]), ("removed", [n for n in old if n not in new]),
                        ("resized", [n for n in new if n in old and new[n][0] != old[n][0]]),
                        ("changed in place at the same size", [n for n in same_size if new[n][1] != old[n][1]])):
        if names:
            parts.append(f"{len(names)} {what} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})")
    if parts and "changed in place" in parts[-1]:
        parts[-1] += ": another ETag, blob id or mtime"
    if not parts and [e[0] for e in before] != [e[0] for e in after]:
        return "the same files in another order"
    return "; ".join(parts)


def _shown(value: Optional[Any]) -> str:
    return "unset" if value is None else repr(value)
