"""Corpora for the streaming tests: document i says `w{i}x` every few words, so any window that
holds a few tokens of it names it, and the unit that holds it follows from i alone."""
import json
import re
from pathlib import Path
from typing import Iterator, List

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data.builtin import builtin_corpus
from helpers.range_server import RangeServer

ID = re.compile(r"w(\d+)x")


def document_texts(n: int) -> List[str]:
    filler = builtin_corpus()[:40]["text"]  # a list: indexing datasets' lazy Column slices the table (1.7 s for 8,000)
    return [" ".join(f"w{i}x {word}" for word in filler[i % 40].split()[: 5 + i % 17]) for i in range(n)]


def write_corpus(root: Path, n_docs: int, n_files: int, group_rows: int) -> Path:
    """n_files parquet files (part{f}.parquet, documents in order, `group_rows` per row group,
    an `id` column beside `text`) and all.jsonl with every document, one per line."""
    root.mkdir(parents=True, exist_ok=True)
    texts, per_file = document_texts(n_docs), n_docs // n_files
    for f in range(n_files):
        rows = range(f * per_file, (f + 1) * per_file)
        pq.write_table(pa.table({"text": [texts[i] for i in rows], "id": list(rows)}),
                       root / f"part{f}.parquet", row_group_size=group_rows)
    (root / "all.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return root


def window_ids(tokenizer, windows) -> set:
    """The documents whose marker appears in any of `windows` (token id arrays or tensors). As plain
    lists: given a tensor's elements, transformers converts each on its own (5 of a streaming
    module's 10 CPU-s went there)."""
    texts = tokenizer.batch_decode([np.asarray(w).tolist() for w in windows])
    return {int(m) for text in texts for m in ID.findall(text)}


def served(root: Path) -> Iterator[RangeServer]:
    """A module fixture's body: the range server over `root`, closed after the module."""
    server = RangeServer(root)
    yield server
    server.close()
