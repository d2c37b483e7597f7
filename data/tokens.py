"""Documents -> one flat token stream (EOS after every document), stored compactly on disk.

A document's ids are what `tokenizer(text)` gives with the tokenizer's own defaults
(Llama 3's prepends BOS, GPT-2's and the builtin add nothing), so training sees what
transformers sees for the same text; then EOS, the document separator, unless the tokenizer
appended it already.

Tokenization is the fast tokenizer in batched `datasets.map`, parallel over `num_proc`
processes; the stream is written once into a .npy file (uint16 when the vocabulary fits,
else int32) that every process memory-maps. Windows of seq_len + 1 tokens are views into it
(data/windows.py), so one stream serves every sequence length.
"""
from pathlib import Path
from typing import Iterable, Iterator, List

import datasets
import numpy as np
import pyarrow.compute as pc
from numpy.lib.format import open_memmap
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from data.hub import datasets_progress
from data.spec import DataError


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.int32)


def require_eos(tokenizer: PreTrainedTokenizerBase, name: str) -> int:
    """The EOS id that separates documents in the stream, or a DataError before any tokenizing
    (without it every document would end in None)."""
    if tokenizer.eos_token_id is None:
        raise DataError(f"data.tokenizer={name!r} has no EOS token, which separates documents in the token "
                        f"stream; use a tokenizer with one (e.g. 'builtin' or gpt2) or set eos_token in its "
                        f"tokenizer_config.json")
    return tokenizer.eos_token_id


def longest_token_bytes(tokenizer: PreTrainedTokenizerBase) -> int:
    """An upper bound on the UTF-8 bytes of text one token covers (its vocabulary entry's bytes:
    a byte-level entry such as 'Ġthe' counts its marker as two bytes, so this errs high)."""
    return max(len(token.encode("utf-8")) for token in tokenizer.get_vocab())


def document_tokens(texts: List[str], tokenizer: PreTrainedTokenizerBase) -> List[List[int]]:
    """Token ids of each document (the tokenizer's defaults, BOS where it adds one) ending in
    EOS, in the order of `texts`; [] for a document with no tokens of its own (a wikitext-style
    blank line: only what the tokenizer adds around any text), never a lone BOS or EOS."""
    eos = tokenizer.eos_token_id
    added = tokenizer("", return_attention_mask=False)["input_ids"]  # the specials around nothing
    separator = [] if added and added[-1] == eos else [eos]
    ids = tokenizer(texts, return_attention_mask=False)["input_ids"]
    return [doc + separator if len(doc) > len(added) else [] for doc in ids]


def tokenize_batch(texts: List[str], tokenizer: PreTrainedTokenizerBase) -> List[List[int]]:
    """`document_tokens` of each document, the empty ones dropped."""
    return [doc for doc in document_tokens(texts, tokenizer) if doc]


def write_token_stream(dataset: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, text_field: str,
                       num_proc: int, out: Path) -> int:
    """Tokenize `dataset` and write its stream to `out` (.npy); returns the token count."""
    def tokenize(batch):
        ids = tokenize_batch(batch[text_field], tokenizer)
        return {"ids": ids, "n": [len(doc) for doc in ids]}

    with datasets_progress(len(dataset)):
        tokenized = dataset.map(tokenize, batched=True, num_proc=num_proc if num_proc > 1 else None,
                                remove_columns=dataset.column_names, desc="tokenize")
    # Summed as one Arrow column: datasets' numpy-formatted column is read a row at a time (2.4 s
    # for 20,000 documents, hours for a corpus of millions).
    total = int(pc.sum(tokenized.with_format("arrow")["n"]).as_py()) if len(tokenized) else 0
    stream = open_memmap(out, mode="w+", dtype=token_dtype(len(tokenizer)), shape=(total,))
    offset = 0
    with tqdm(total=total, unit="tok", desc="write", disable=total < 10_000_000) as bar:
        for batch in tokenized.with_format("arrow").iter(batch_size=100_000):  # no Python ints
            flat = batch.column("ids").combine_chunks().flatten().to_numpy()
            stream[offset:offset + len(flat)] = flat
            offset += len(flat)
            bar.update(len(flat))
    stream.flush()
    return total


def stream_tokens(docs: Iterable[dict], tokenizer: PreTrainedTokenizerBase, text_field: str,
                  batch_docs: int = 256) -> Iterator[np.ndarray]:
    """The same stream as `write_token_stream` (its dtype too), produced on the fly in chunks."""
    texts: List[str] = []
    dtype = token_dtype(len(tokenizer))
    for doc in docs:
        texts.append(doc[text_field])
        if len(texts) == batch_docs:
            yield np.fromiter((t for ids in tokenize_batch(texts, tokenizer) for t in ids), dtype=dtype)
            texts = []
    if texts:
        yield np.fromiter((t for ids in tokenize_batch(texts, tokenizer) for t in ids), dtype=dtype)
