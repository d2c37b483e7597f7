"""The embedded default data: works on a fresh machine with no network.

Corpus: the documentation topics every CPython ships in `pydoc_data.topics` (about 465k
characters of English prose and code), one document per topic, as an HF `datasets.Dataset`.
Tokenizer: a byte-level BPE trained on that corpus with `tokenizers` (seconds), saved as a
`transformers` fast tokenizer under the cache directory and reused.
"""
from pathlib import Path

import datasets
from pydoc_data.topics import topics
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from data.cache import build_once, default_cache_dir

BUILTIN = "builtin"
EOS = "<|endoftext|>"
BUILTIN_VOCAB_SIZE = 4096


def builtin_corpus() -> datasets.Dataset:
    """One row {'text': ...} per pydoc topic, in sorted topic order (deterministic)."""
    return datasets.Dataset.from_dict({"text": [topics[k] for k in sorted(topics)]})


def _train_tokenizer(out_dir: Path) -> None:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BUILTIN_VOCAB_SIZE, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(builtin_corpus()["text"], trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, bos_token=EOS,
                            unk_token=EOS).save_pretrained(str(out_dir))


def builtin_tokenizer_dir() -> Path:
    return build_once(default_cache_dir() / f"builtin-bpe-{BUILTIN_VOCAB_SIZE}", _train_tokenizer)


def load_tokenizer(name: str) -> PreTrainedTokenizerFast:
    """`builtin`, or any name or path `AutoTokenizer` accepts (hub ids need the cache or network)."""
    path = str(builtin_tokenizer_dir()) if name == BUILTIN else name
    return AutoTokenizer.from_pretrained(path)
