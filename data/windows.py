"""The cached token streams of a run (train and validation), built once and memory-mapped.

The cache key holds everything that changes the streams: the source (local files by path,
size and mtime; hub data by id, config and revision), split and validation settings, text
field, the tokenizer's full serialisation and the code version. The sequence length is not in
it: windows of seq_len + 1 tokens are views of the stream, so one cache serves every length.
"""
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
from transformers import PreTrainedTokenizerBase

from data.cache import build_once, default_cache_dir
from data.sources import load_train_val, source_identity
from data.spec import DataError, DataSpec
from data.tokens import token_dtype, write_token_stream

CACHE_VERSION = 4  # 4: documents tokenized with the tokenizer's defaults (BOS where it adds one); bump when tokenization, the held-out rule or the file layout changes its output


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else f"{tokenizer.name_or_path}:{len(tokenizer)}"
    return hashlib.sha256(text.encode()).hexdigest()


def cache_key(spec: DataSpec, tokenizer: PreTrainedTokenizerBase) -> str:
    parts = [CACHE_VERSION, source_identity(spec), spec.split, spec.val_split, spec.val_fraction,
             spec.text_field, tokenizer_fingerprint(tokenizer)]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:20]


@dataclass
class CachedStreams:
    directory: Path
    train: np.ndarray
    """Flat token stream (memory-mapped)."""
    val: Optional[np.ndarray]
    built_here: bool
    """True in the one process that tokenized; False where the cache was reused."""


def windows(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """(N, seq_len + 1) non-overlapping windows: a view, no copy; the tail is dropped."""
    n = len(stream) // (seq_len + 1)
    return stream[: n * (seq_len + 1)].reshape(n, seq_len + 1)


def prepare_streams(spec: DataSpec, tokenizer: PreTrainedTokenizerBase) -> CachedStreams:
    """Build the streams unless cached (one process builds, the others wait on its lock)."""
    def build(tmp: Path) -> None:
        start = time.perf_counter()
        train, val = load_train_val(spec)
        tmp.mkdir(parents=True)
        meta = {"source": spec.name, "builder_pid": os.getpid(),
                "train_tokens": write_token_stream(train, tokenizer, spec.text_field, spec.num_proc,
                                                   tmp / "train.npy")}
        if val is not None:
            meta["val_tokens"] = write_token_stream(val, tokenizer, spec.text_field, spec.num_proc,
                                                    tmp / "val.npy")
        meta["build_seconds"] = round(time.perf_counter() - start, 3)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))

    directory = build_once(default_cache_dir() / "data" / cache_key(spec, tokenizer), build)
    meta = json.loads((directory / "meta.json").read_text())
    if meta["train_tokens"] == 0:
        raise DataError(f"data.name={spec.name!r}: every document tokenized to nothing "
                        f"(text_field={spec.text_field!r})")
    val_path = directory / "val.npy"
    return CachedStreams(directory, np.load(directory / "train.npy", mmap_mode="r"),
                         np.load(val_path, mmap_mode="r") if val_path.exists() else None,
                         built_here=meta["builder_pid"] == os.getpid())


VALIDATION_RULE = 2
"""In the key of streaming validation's cache: bump when the rule that picks the windows changes
(2: sampled across the held-out units, data/prepare_source.py's validation_windows_across_units; 1: the first ones
in file order), so that no run reuses windows picked by another rule."""


def cached_validation_windows(spec: DataSpec, tokenizer: PreTrainedTokenizerBase, seq_len: int, n_windows: int,
                              build: Callable[[], np.ndarray], source_fingerprint: str) -> np.ndarray:
    """Streaming validation: the `n_windows` windows that `build()` gives, built by one
    process once and then memory-mapped by every process and every later run of the same units
    (`source_fingerprint`, data/units.py), tokenizer and length."""
    def write(tmp: Path) -> None:
        np.save(tmp, build().astype(token_dtype(len(tokenizer))))

    key = (f"{cache_key(spec, tokenizer)}-{source_fingerprint.replace(':', '-')}-val{VALIDATION_RULE}-"
           f"{seq_len + 1}x{n_windows}")
    return np.load(build_once(default_cache_dir() / "data" / f"{key}.npy", write), mmap_mode="r")
