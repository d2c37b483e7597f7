"""The embedded default data: works on a fresh machine with no network.

Corpus: text every CPython ships: the documentation topics of `pydoc_data.topics` (about 465k
characters of prose and examples), one document per topic, then the docstrings of each
standard-library module (read with `ast`, nothing imported; about 1.7M characters), one
document per module. About 500k tokens, built once into an HF `datasets.Dataset` saved under
the cache directory. The Python version is part of its name: other versions ship other text.
Tokenizer: a byte-level BPE trained on that corpus with `tokenizers` (seconds), saved as a
`transformers` fast tokenizer under the cache directory and reused.
"""
import ast
import gc
import json
import os
import sys
import sysconfig
from collections import deque
from pathlib import Path
from typing import Iterator, List

import datasets
from pydoc_data.topics import topics
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from data.cache import build_once, default_cache_dir
from data.hub import hub_errors_only
from data.json_files import one_line, read_json_object
from data.spec import DataError

BUILTIN = "builtin"
EOS = "<|endoftext|>"
BUILTIN_VOCAB_SIZE = 4096


def _definitions(tree: ast.Module) -> Iterator[ast.AST]:
    """The module, class and function nodes of `tree` in `ast.walk`'s order (breadth first),
    descending only into statement lists: expressions hold no definitions (a lambda is an
    expression). With the collector paused below, the docstrings take 2.2 CPU-s instead of 5.5
    (each fresh cache, each test with a data cache of its own, builds them)."""
    todo = deque([tree])
    while todo:
        node = todo.popleft()
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node
        for field in node._fields:
            value = getattr(node, field, None)
            if isinstance(value, list):
                todo.extend(v for v in value if isinstance(v, (ast.stmt, ast.excepthandler, ast.match_case)))


def _module_docstrings() -> List[str]:
    """One document per standard-library module: its module, class and function docstrings."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib"}
    documents = []
    # The cyclic collector paused: the parsed modules' millions of nodes hold no cycle (their
    # reference counts free them), and its passes over them cost about 1 CPU-s.
    collecting = gc.isenabled()
    gc.disable()
    try:
        for path in sorted(root.rglob("*.py")):
            if skip & set(path.relative_to(root).parts):
                continue
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            text = "\n\n".join(d for d in map(ast.get_docstring, _definitions(tree)) if d)
            if text:
                documents.append(text)
    finally:
        if collecting:
            gc.enable()
    return documents


def _build_corpus(out_dir: Path) -> None:
    texts = [topics[k] for k in sorted(topics)] + _module_docstrings()
    # Saving ~700 rows takes milliseconds: its progress bar would only stand before a run's first
    # line (or before a one-line error, on a fresh machine).
    shown = not datasets.utils.are_progress_bars_disabled()
    datasets.utils.disable_progress_bars()
    try:
        datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(out_dir))
    finally:
        if shown:
            datasets.utils.enable_progress_bars()


def python_version() -> str:
    """The corpus (and so the tokenizer) depend on the Python that ships the text."""
    return ".".join(map(str, sys.version_info[:3]))


def builtin_corpus() -> datasets.Dataset:
    """The embedded corpus, one row {'text': ...} per document, in a fixed order."""
    path = build_once(default_cache_dir() / f"builtin-corpus-py{python_version()}", _build_corpus)
    return datasets.load_from_disk(str(path))


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
    return build_once(default_cache_dir() / f"builtin-bpe-{BUILTIN_VOCAB_SIZE}-py{python_version()}",
                      _train_tokenizer)


def load_tokenizer(name: str, where: str = "data.tokenizer") -> PreTrainedTokenizerFast:
    """`builtin`, or any name or path `AutoTokenizer` accepts (hub ids need the cache or network);
    files that ask for custom code, and a local directory's malformed files, are a DataError naming
    `where` (the field or flag that gave `name`)."""
    if name == BUILTIN:
        return AutoTokenizer.from_pretrained(str(builtin_tokenizer_dir()), trust_remote_code=False)
    local = os.path.isdir(name)  # False for a name no path can be (too long, a NUL)
    if local:
        for filename in TOKENIZER_JSON:
            _check_json_object(Path(name) / filename, f"{where}={name!r}")
    with hub_errors_only():
        try:
            # False, not the default None: with None, transformers' resolve_trust_remote_code asks
            # "Do you wish to run the custom code? [y/N]" on the terminal for 15 s (TIME_OUT_REMOTE_CODE)
            # before refusing a tokenizer_config.json whose auto_map names Python files of the model's.
            return AutoTokenizer.from_pretrained(name, trust_remote_code=False)
        except Exception as e:
            if isinstance(e, ValueError) and "trust_remote_code" in str(e):
                raise DataError(f"{where}={name!r}: its files ask for custom code ({_auto_map(name)}), which this "
                                f"project does not run (trust_remote_code=False); use a tokenizer of one of "
                                f"transformers' own classes, or 'builtin'") from None
            if not _malformed_file(e, local):
                raise
            raise DataError(f"{where}={name!r}: {_what_failed(e)}; save the tokenizer again with save_pretrained, "
                            f"or use 'builtin'") from None


# The files of a tokenizer directory that transformers reads as JSON objects and indexes without
# checking (tokenizer_config.json holding a list: AttributeError "'list' object has no attribute
# 'get'"; bytes not UTF-8: UnicodeDecodeError): read first, so that a bad one is named.
TOKENIZER_JSON = ("tokenizer_config.json", "tokenizer.json", "special_tokens_map.json", "added_tokens.json",
                  "config.json")


def _check_json_object(path: Path, where: str) -> None:
    """A DataError naming `path`'s file unless it is absent or a UTF-8 JSON object."""
    if not path.exists():
        return
    value, why = read_json_object(path)
    if value is None:
        raise DataError(f"{where}: {path.name} {why}; save the tokenizer again with save_pretrained, "
                        f"or use 'builtin'")


def _malformed_file(error: Exception, local: bool) -> bool:
    """Whether `error` is transformers or tokenizers failing on a malformed file. Of a hub id, an
    OSError or ValueError is the caller's to word (not cached, offline, no such repository)."""
    if type(error) is Exception:  # tokenizers' own errors (raised in Rust) are bare Exceptions
        return True
    if isinstance(error, (AttributeError, TypeError, KeyError, IndexError, RecursionError)):
        return True
    return local and isinstance(error, (OSError, ValueError))


def _what_failed(error: Exception) -> str:
    if type(error) is Exception:  # of loading, only tokenizers' TokenizerFast.from_file raises these
        return f"tokenizer.json is not a tokenizers serialization ({one_line(error)})"
    return f"transformers cannot load a tokenizer from it ({type(error).__name__}: {one_line(error)})"


def _auto_map(name: str) -> str:
    """The AutoTokenizer entry of a local directory's tokenizer_config.json, as its refusal names it."""
    try:
        auto_map = json.loads((Path(name) / "tokenizer_config.json").read_text())["auto_map"]
        entry = auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else auto_map
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "an auto_map entry"
    return f"tokenizer_config.json's auto_map AutoTokenizer={entry!r}"[:300]
