"""A run's inputs before any process group starts: the checked tokenizer, the model's vocabulary
and the run's data (the cache built once, by one process)."""
import dataclasses
import os
from typing import Any, Dict, Tuple

from launch.config.layout import Layout
from launch.config.recipe import Recipe
from launch.errors import ConfigError


def resolved_recipe_dict(recipe: Recipe, vocab_size: int) -> Dict[str, Any]:
    """The recipe as trained: the vocabulary resolved from the tokenizer, and every architecture
    switch the recipe left null set from its arch preset (a checkpoint names its model fully)."""
    resolved = recipe.to_dict()
    resolved["model"] = dataclasses.asdict(recipe.model.resolved())
    resolved["model"]["vocab_size"] = vocab_size
    return resolved


def check_vocab(recipe: Recipe, tokenizer_vocab: int) -> int:
    """The model's real vocabulary: the recipe's, or the tokenizer's when the recipe says null."""
    vocab = recipe.model.vocab_size or tokenizer_vocab
    if vocab < tokenizer_vocab:
        raise ConfigError(f"model.vocab_size={vocab} is smaller than the tokenizer's vocabulary "
                          f"{tokenizer_vocab} ({recipe.data.tokenizer!r}); set model.vocab_size >= "
                          f"{tokenizer_vocab} or null")
    return vocab


def load_checked_tokenizer(recipe: Recipe) -> Tuple[Any, int]:
    """The run's tokenizer and the model's vocabulary size, or a ConfigError naming the fix."""
    from data.builtin import load_tokenizer
    from data.spec import DataError
    from data.tokens import require_eos
    try:
        tokenizer = load_tokenizer(recipe.data.tokenizer)
    except DataError:  # already one line (e.g. the data cache's lock timed out)
        raise
    except (OSError, ValueError) as e:
        raise ConfigError(f"data.tokenizer={recipe.data.tokenizer!r} could not be loaded "
                          f"({type(e).__name__}); use 'builtin' or a local tokenizer directory") from None
    require_eos(tokenizer, recipe.data.tokenizer)
    return tokenizer, check_vocab(recipe, len(tokenizer))


def load_run_data(recipe: Recipe, layout: Layout) -> Tuple[Any, int]:
    """(the run's data, vocabulary size): data/run.py's RunData for this recipe and batch."""
    from data.job_listing import set_wait_limit
    from data.run import prepare_run_data
    check_streams_serve_dp(recipe.data, layout.dp, layout.global_batch_size)
    set_wait_limit(recipe.train.dist_timeout_s)  # ranks wait this long for rank 0's listing of the files
    tokenizer, vocab_size = load_checked_tokenizer(recipe)
    data = prepare_run_data(recipe.data, tokenizer, recipe.seq_len, recipe.train.seed,
                            layout.global_batch_size, layout.micro_batch_size,
                            evaluate=recipe.train.eval_every > 0, eval_batches=recipe.train.eval_batches)
    warn_of_shared_streams(data, layout.dp)
    return data, vocab_size


def check_streams_serve_dp(spec, dp: int, global_batch_size: int) -> None:
    """A streamed source's data.streams that dp does not divide is refused before any reading:
    replicas would share a stream, and each would read and tokenize it whole to keep its windows
    (16 streams at 1,024 replicas: 64x). Unset, the streams are the
    global batch size, which every dp divides."""
    from data.mixture_spec import parse_mixture
    specs = [source.spec for source in parse_mixture(spec)] if spec.mix else [spec]
    for source in specs:
        if source.streaming and source.streams is not None and source.streams % dp:
            raise ConfigError(
                f"data.streams={source.streams} ({source.name}) at dp={dp}: each rank reads only its own streams, "
                f"so dp must divide them; leave data.streams unset (one stream per sample of the global batch, "
                f"{global_batch_size}) or set a multiple of {dp} that divides {global_batch_size} (it changes the "
                f"data order: a resume needs --restart-data)")


def warn_of_shared_streams(data, dp: int) -> None:
    """One line (rank 0) when the streams derived for a small corpus (fewer training units than the
    global batch) make replicas share streams, so that ranks read more than they train."""
    from data.streaming import read_share
    parts = getattr(data, "parts", [data])
    for part in parts:
        share = read_share(part.spec.streams, dp) if part.streamed else 1.0
        if share > 1 and os.environ.get("RANK", "0") == "0":
            print(f"warning: data.streams (unset) is {part.spec.streams} for {part.spec.name}, which has fewer "
                  f"training units than the global batch; at dp={dp} a rank reads and tokenizes up to {share:.1f}x "
                  f"the windows it trains, its streams shared with other replicas (smaller units, a lower "
                  f"data.unit_bytes, give more streams)", flush=True)
