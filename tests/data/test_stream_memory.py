"""A streaming rank's memory as its process's RSS, against docs/data.md's formula
(data/streaming.py: rank_memory_bytes). RSS sees what tracemalloc does not (Arrow's buffers, the
tokenizer's), and the rank runs as a training rank does: units of 1,000 web-like documents
(3.5 MB of text, every other document with a typographic apostrophe, every 20th an emoji: 2 and 4
bytes a character as Python strings), read-ahead on at its default depth, its streams' blocks
filled and refilled once. The measurement is bench/data/first_batch.py's, at a smaller batch."""
import os

import pytest

from bench.data.first_batch import BLOCK, measure, write_corpus
from data.builtin import builtin_tokenizer_dir


@pytest.mark.slow  # ~9 CPU-s: a corpus of 110 MB of text and a process that tokenizes 1M tokens
def test_a_reading_ranks_rss_is_the_documented_formula(tmp_path):
    """32 streams, each holding its unit's 5.7 MiB of Python strings: the peak RSS above the
    process's RSS before its streams opened is the formula's within 20%. A formula that counted
    the text at its UTF-8 size (3.5 MB a unit) falls 30% short; one that left out the strings, 90%."""
    tokenizer = builtin_tokenizer_dir()  # the child's cache: this one's tokenizer, a unit list of its own
    (tmp_path / "cache").mkdir()
    os.symlink(tokenizer, tmp_path / "cache" / tokenizer.name)
    corpus = write_corpus(tmp_path / "corpus", 32)
    r = measure(corpus, 32, 1, steps=BLOCK + 1, seq_len=1024, env={"GPT3D_CACHE": str(tmp_path / "cache")})
    assert r["streams"] == 32 and 3.5e6 <= r["unit_bytes"] <= 3.6e6, r  # Arrow's UTF-8, not 5.7 MiB of str
    assert 0.8 <= r["peak_rss"] / r["predicted"] <= 1.2, ({k: round(v / 2 ** 20) if k.endswith("rss") or k == "predicted" else v for k, v in r.items()})
