"""A data cache of a test's own that starts with this machine's builtin tokenizer and corpus: in an
empty cache every process would train the tokenizer again (2 to 5 CPU-s each), which is never what
such a test is about (its subject is the data, the checkpoints or the nodes' staging it keeps there)."""
import shutil
from pathlib import Path

BUILTIN_ENTRIES = ("builtin-bpe", "builtin-corpus")


def cache_with_builtin(cache: Path) -> Path:
    """`cache`, holding a copy of the shared cache's builtin tokenizer and corpus (built there first
    if this machine has none); read GPT3D_CACHE's shared cache before pointing it at `cache`."""
    from data.builtin import builtin_tokenizer_dir
    from data.cache import default_cache_dir
    builtin_tokenizer_dir()  # trains and saves it in the shared cache if it is not there yet
    for entry in default_cache_dir().iterdir():
        if entry.name.startswith(BUILTIN_ENTRIES):
            shutil.copytree(entry, Path(cache) / entry.name, dirs_exist_ok=True)
    return Path(cache)
