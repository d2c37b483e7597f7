"""The loader of a three-source mixture (data.mix) against the model that consumes it, measured
in the same run (bench/data_throughput.py's loading comparison, for one source).

Sources, all offline: the embedded corpus, this repository's docs/*.md, and the embedded corpus's
first 200 documents as a .jsonl file (written to a temporary directory); weights 0.6, 0.3, 0.1;
cached (map-style), the small sources repeating many times. Measured: micro-batches per second
the mixture's loader delivers (interleave, per-source epoch orders, gathering windows), against
the micro-batches per second recipes/tiny.yaml's dense model consumes (forward + backward); and,
for scale, the loader of the embedded corpus alone.
Target: ratio >= 20. Alternating repetitions, median. `python bench/mixture_data.py [--repeats 3]`.
"""
import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from data.builtin import builtin_corpus, load_tokenizer
from data.pipeline import prepare_run_data
from launch.runtime.recipe import load_recipe
from model.gpt import GPT
from model.loss import vocab_parallel_cross_entropy

REPO = Path(__file__).resolve().parent.parent


def three_sources(tmp: Path) -> list:
    builtin_corpus().select(range(200)).to_json(tmp / "first200.jsonl")
    return [{"name": "builtin", "label": "python", "weight": 0.6},
            {"name": str(REPO / "docs" / "*.md"), "label": "docs", "weight": 0.3},
            {"name": str(tmp / "first200.jsonl"), "label": "first200", "weight": 0.1}]


def loader_vs_model(repeats: int, mix: list) -> tuple:
    recipe = load_recipe(REPO / "recipes" / "tiny.yaml", [])
    recipe.data.mix = mix
    tokenizer = load_tokenizer("builtin")
    t = recipe.train
    data = prepare_run_data(recipe.data, tokenizer, recipe.seq_len, t.seed, t.global_batch_size,
                            t.micro_batch_size, evaluate=False)
    print(data.repeat_report(10_000))
    single = prepare_run_data(load_recipe(REPO / "recipes" / "tiny.yaml", []).data, tokenizer, recipe.seq_len,
                              t.seed, t.global_batch_size, t.micro_batch_size, evaluate=False)
    model = GPT(recipe.gpt_config(len(tokenizer)))
    batches, one_source = data.train_batches(0, 1), single.train_batches(0, 1)
    n = 400
    loader, plain, consumer = [], [], []
    for _ in range(repeats):
        for rates, it in ((loader, batches), (plain, one_source)):
            start = time.perf_counter()
            for _ in range(n):
                next(it)
            rates.append(n / (time.perf_counter() - start))
        start = time.perf_counter()
        for _ in range(20):
            x, y = next(batches)
            vocab_parallel_cross_entropy(model(x), y, None).mean().backward()
        consumer.append(20 / (time.perf_counter() - start))
    return statistics.median(loader), statistics.median(plain), statistics.median(consumer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as tmp:
        loader, plain, consumer = loader_vs_model(args.repeats, three_sources(Path(tmp)))
    print(f"micro-batches of recipes/tiny.yaml from a three-source mixture (median of {args.repeats}):")
    print(f"  loader delivers           {loader:10,.0f} batches/s")
    print(f"  (one source, builtin      {plain:10,.0f} batches/s)")
    print(f"  tiny model consumes       {consumer:10,.1f} batches/s (forward + backward)")
    print(f"  ratio loader/model = {loader / consumer:.0f}x (target >= 20x)")


if __name__ == "__main__":
    main()
