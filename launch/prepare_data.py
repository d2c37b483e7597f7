"""Build the data cache of a recipe ahead of training: `python launch/prepare_data.py --recipe R.yaml`.

Tokenizes with progress bars, writes the cached token streams and prints what a run will
see. A second call (or a training run) reuses the cache at once. An entry point, so it reads
the recipe through launch/config/recipe.py like launch/train.py does.
"""
import sys
import time

from data.spec import DataError
from launch.config.cli import OneLineErrorParser, local_path
from launch.config.recipe import load_recipe
from launch.errors import ConfigError, report_bad_input


def main(argv=None) -> int:
    parser = OneLineErrorParser(description=__doc__)
    parser.add_argument("--recipe", type=local_path, required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    try:
        args = parser.parse_args(argv)
        recipe = load_recipe(args.recipe, args.overrides)
        if recipe.data.streaming and not recipe.data.mix:
            raise ConfigError("data.streaming=true tokenizes on the fly: there is nothing to prepare")
        from data.builtin import load_tokenizer
        from data.windows import prepare_streams
        start = time.perf_counter()
        tokenizer = load_tokenizer(recipe.data.tokenizer)
        if recipe.data.mix:  # every source of the mixture, one progress bar over them
            from data.mixture_spec import parse_mixture
            from data.mixture_run import build_source_caches
            sources = parse_mixture(recipe.data)
            built = list(zip((s.label for s in sources), build_source_caches(sources, tokenizer, progress=True)))
        else:
            built = [(None, prepare_streams(recipe.data, tokenizer))]
    except (ConfigError, DataError, OSError) as e:
        return report_bad_input(e)
    for label, streams in built:
        print(describe(streams, recipe.seq_len, label))
    print(f"done in {time.perf_counter() - start:.1f}s")
    return 0


def describe(streams, seq_len: int, label=None) -> str:
    """One line: built or reused, where, and the train and validation tokens and windows a run sees."""
    from data.windows import windows
    how = "built" if streams.built_here else "reused"
    return (("" if label is None else f"{label}: ") + f"{how} {streams.directory}: "
            f"train {len(streams.train):,} tokens = {len(windows(streams.train, seq_len)):,} windows of "
            f"{seq_len + 1}" + (f"; validation {len(streams.val):,} tokens" if streams.val is not None else ""))


if __name__ == "__main__":
    sys.exit(main())
