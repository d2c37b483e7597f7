"""Tokenize documents, join them with EOS and cut the stream into windows of seq_len + 1.

A window w gives inputs w[:-1] and labels w[1:]; windows do not overlap and the last partial
window is dropped. Documents run across window boundaries (GPT-2 / nanoGPT packing).
"""
import numpy as np
import datasets
from transformers import PreTrainedTokenizerBase


def tokenize_and_pack(dataset: datasets.Dataset, tokenizer: PreTrainedTokenizerBase,
                      seq_len: int, text_field: str = "text") -> np.ndarray:
    """(N, seq_len + 1) token windows, uint16 when the vocabulary fits, else int32."""
    eos = tokenizer.eos_token_id
    tokenized = dataset.map(lambda batch: {"ids": [ids + [eos] for ids in tokenizer(batch[text_field])["input_ids"]]},
                            batched=True, remove_columns=dataset.column_names)
    stream = np.fromiter((t for ids in tokenized["ids"] for t in ids), dtype=np.int64)
    dtype = np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max + 1 else np.int32
    window = seq_len + 1
    n_windows = len(stream) // window
    return stream[: n_windows * window].reshape(n_windows, window).astype(dtype)
