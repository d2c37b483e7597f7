"""The packed training windows of a run, built once per (corpus, tokenizer, seq_len) and cached."""
import hashlib
from pathlib import Path

import numpy as np
from transformers import PreTrainedTokenizerBase

from data.builtin import BUILTIN, builtin_corpus
from data.cache import build_once, default_cache_dir
from data.packing import tokenize_and_pack

PACKING_VERSION = 1  # bump when packing changes its output


def load_windows(name: str, tokenizer: PreTrainedTokenizerBase, seq_len: int, text_field: str) -> np.ndarray:
    """(N, seq_len + 1) windows, memory-mapped from the cache."""
    assert name == BUILTIN, "only the embedded corpus so far; launch/train.py validates data.name"
    key = hashlib.sha256(repr((name, tokenizer.name_or_path, len(tokenizer), seq_len, text_field,
                               PACKING_VERSION)).encode()).hexdigest()[:16]

    def build(tmp: Path) -> None:
        np.save(tmp, tokenize_and_pack(builtin_corpus(), tokenizer, seq_len, text_field))

    path = build_once(default_cache_dir() / "windows" / f"{name}-{seq_len}-{key}.npy", build)
    return np.load(path, mmap_mode="r")
