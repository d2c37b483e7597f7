"""Data pipeline throughput against its peers, measured in the same run.

1. Tokenization: `prepare_streams` (what `launch/prepare_data.py` runs: datasets.map, EOS, packing,
   the uint16 file) on a fresh cache, against plain `tokenizer(batch_of_texts)` on the same
   documents: the embedded corpus (673 long documents), and its lines as documents (tens of
   thousands of short ones, where a cost per document shows). Target: pipeline time / raw time < 1.5.
2. Loading: micro-batches per second the map-style loader delivers, against the micro-batches
   per second the tiny model consumes (forward + backward of recipes/tiny.yaml's dense model).
   Target: ratio >= 20.
Alternating repetitions, median. `python bench/data/data_throughput.py [--repeats 3]`.
"""
import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Dict, Iterator, Optional

import datasets
import torch

from bench import REPO
from data.builtin import builtin_corpus, load_tokenizer
from data.run import prepare_run_data
from data.spec import DataSpec
from launch.config.recipe import load_recipe
from model.gpt.model import GPT
from model.parallel.cross_entropy import vocab_parallel_cross_entropy


def time_raw_tokenizer(tokenizer, texts, batch=1000) -> float:
    start = time.perf_counter()
    for i in range(0, len(texts), batch):
        tokenizer(texts[i:i + batch])
    return time.perf_counter() - start


def time_pipeline(tokenizer, spec: DataSpec) -> float:
    import data.windows as windows_module
    with tempfile.TemporaryDirectory() as tmp:
        original = windows_module.default_cache_dir
        windows_module.default_cache_dir = lambda: Path(tmp)  # a fresh data cache, same tokenizer
        try:
            start = time.perf_counter()
            streams = windows_module.prepare_streams(spec, tokenizer)
            assert streams.built_here
            return time.perf_counter() - start
        finally:
            windows_module.default_cache_dir = original


def compare_tokenization(tokenizer, texts, spec: DataSpec, repeats: int) -> None:
    n_tokens = sum(len(ids) + 1 for ids in tokenizer(texts)["input_ids"])
    raw, pipe = [], []
    for _ in range(repeats):  # alternate, so drift of the machine hits both
        raw.append(time_raw_tokenizer(tokenizer, texts))
        pipe.append(time_pipeline(tokenizer, spec))
    raw_s, pipe_s = statistics.median(raw), statistics.median(pipe)
    print(f"tokenize {len(texts):,} documents, {n_tokens:,} tokens (median of {repeats}):")
    print(f"  raw tokenizer(batch)      {raw_s:7.3f} s  {n_tokens / raw_s:12,.0f} tok/s")
    print(f"  data pipeline (prepare)   {pipe_s:7.3f} s  {n_tokens / pipe_s:12,.0f} tok/s")
    print(f"  overhead ratio pipeline/raw = {pipe_s / raw_s:.2f}x (target < 1.5x)")


def tiny_run_data(mix: Optional[list] = None):
    """(run data, tokenizer, model) of recipes/tiny.yaml, its data section's `mix` set to `mix`."""
    recipe = load_recipe(REPO / "recipes" / "tiny.yaml", [])
    if mix is not None:
        recipe.data.mix = mix
    tokenizer = load_tokenizer("builtin")
    train_cfg = recipe.train
    data = prepare_run_data(recipe.data, tokenizer, recipe.seq_len, train_cfg.seed, train_cfg.global_batch_size,
                            train_cfg.micro_batch_size, evaluate=False)
    return data, tokenizer, GPT(recipe.gpt_config(len(tokenizer)))


def loader_vs_model(loaders: Dict[str, Iterator], model: GPT, repeats: int, n: int = 200) -> Dict[str, float]:
    """Median micro-batches per second each of `loaders` delivers, and (key "model") what `model`
    consumes, forward + backward, of the first loader's batches; alternating repetitions."""
    rates: Dict[str, list] = {name: [] for name in list(loaders) + ["model"]}
    consumed = next(iter(loaders.values()))
    for _ in range(repeats):
        for name, batches in loaders.items():
            start = time.perf_counter()
            for _ in range(n):
                next(batches)
            rates[name].append(n / (time.perf_counter() - start))
        start = time.perf_counter()
        for _ in range(20):
            x, y = next(consumed)
            vocab_parallel_cross_entropy(model(x), y, None).mean().backward()
        rates["model"].append(20 / (time.perf_counter() - start))
    return {name: statistics.median(values) for name, values in rates.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    datasets.disable_caching()  # else datasets.map reuses its own cache from the previous repeat
    tokenizer = load_tokenizer("builtin")
    texts = list(builtin_corpus()["text"])
    lines = [line for text in texts for line in text.splitlines() if line.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        lines_file = Path(tmp) / "lines.jsonl"
        lines_file.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
        for documents, spec in ((texts, DataSpec(name="builtin")), (lines, DataSpec(name=str(lines_file)))):
            compare_tokenization(tokenizer, documents, spec, args.repeats)
    data, _, model = tiny_run_data()
    rates = loader_vs_model({"loader": data.train_batches(0, 1)}, model, args.repeats)
    loader, consumer = rates["loader"], rates["model"]
    print(f"micro-batches of recipes/tiny.yaml (median of {args.repeats}):")
    print(f"  loader delivers           {loader:10,.0f} batches/s")
    print(f"  tiny model consumes       {consumer:10,.1f} batches/s (forward + backward)")
    print(f"  ratio loader/model = {loader / consumer:.0f}x (target >= 20x)")


if __name__ == "__main__":
    main()
