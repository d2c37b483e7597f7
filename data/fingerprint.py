"""What decides which samples each step draws, saved in every checkpoint.

A resume continues the data from its saved position: the sample count (cached data) or each
stream's unit and row (streaming). That position means the same samples only under the same
dealing. Measured before this check: `shuffle_buffer` 8 -> 16 on a resume trained 16 windows twice
and 16 never; one file added to the glob retrained 109 of 461 documents already trained; an
upstream commit to an unpinned hub dataset does the same. So the checkpoint keeps this
fingerprint, and a resume whose data differs is refused in one line naming what changed
(launch/trainer/startup.py), unless `--restart-data` asks for the data order to start again.

The fingerprint holds what the dealing depends on, and nothing that does not (a mirror of the
same files under another URL, a file's mtime): the run's seed, sequence length and tokenizer;
per source its split, revision, config, text field, validation split or fraction, shuffling; the
streams, shuffle block and unit size, and each file's name (relative to the source's common
directory) and size for streamed sources; the number of windows and a digest of a spread of them
for cached ones; the mixture's labels and weights."""
import hashlib
import json
from typing import Any, Dict, List, Optional

import numpy as np

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
            fields[f"{prefix}.files"] = [[name, size] for name, size in zip(files.names, files.sizes)]
        else:  # a dataset in memory read by row ranges (builtin, a save_to_disk directory)
            fields[f"{prefix}.units"] = part.train_stream.reader.fingerprint()
    else:
        windows = part.train_windows
        picked = np.linspace(0, len(windows) - 1, num=min(_SAMPLED_WINDOWS, len(windows))).astype(np.int64)
        digest = hashlib.blake2b(np.ascontiguousarray(windows[picked]).astype(np.int64).tobytes(), digest_size=8)
        fields[f"{prefix}.windows"] = [int(len(windows)), digest.hexdigest()]
    return fields


def fingerprint_changes(saved: Dict[str, Any], now: Dict[str, Any]) -> List[str]:
    """What differs, one short phrase per field, in the fingerprint's order."""
    changes = []
    for key in list(saved) + [k for k in now if k not in saved]:
        before, after = saved.get(key), now.get(key)
        if json.dumps(before) == json.dumps(after):  # JSON's view: a saved tuple is a list
            continue
        if key.endswith(".files") and before is not None and after is not None:
            changes.append(f"{key}: {_file_changes(before, after)}")
        elif key.endswith((".windows", ".tokenizer", ".units")):
            changes.append(f"{key} (its content) changed")
        else:
            changes.append(f"{key} was {_shown(before)}, now {_shown(after)}")
    return changes


def _file_changes(before: List[List[Any]], after: List[List[Any]]) -> str:
    old, new = dict(map(tuple, before)), dict(map(tuple, after))
    parts = []
    for what, names in (("added", [n for n in new if n not in old]), ("removed", [n for n in old if n not in new]),
                        ("resized", [n for n in new if n in old and new[n] != old[n]])):
        if names:
            parts.append(f"{len(names)} {what} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})")
    return "; ".join(parts) or "the same files in another order"


def _shown(value: Optional[Any]) -> str:
    return "unset" if value is None else repr(value)
