"""The loader of a three-source mixture (data.mix) against the model that consumes it, measured
in the same run (bench/data/data_throughput.py's loading comparison, for one source).

Sources, all offline: the embedded corpus, this repository's docs/*.md, and the embedded corpus's
first 200 documents as a .jsonl file (written to a temporary directory); weights 0.6, 0.3, 0.1;
cached (map-style), the small sources repeating many times. Measured: micro-batches per second
the mixture's loader delivers (interleave, per-source epoch orders, gathering windows), against
the micro-batches per second recipes/tiny.yaml's dense model consumes (forward + backward); and,
for scale, the loader of the embedded corpus alone.
Target: ratio >= 20. Alternating repetitions, median. `python bench/data/mixture_data.py [--repeats 3]`.
"""
import argparse
import os
import tempfile
from pathlib import Path

import torch

from bench import REPO
from bench.data.data_throughput import loader_vs_model, tiny_run_data
from data.builtin import builtin_corpus


def three_sources(tmp: Path) -> list:
    builtin_corpus().select(range(200)).to_json(tmp / "first200.jsonl")
    return [{"name": "builtin", "label": "python", "weight": 0.6},
            {"name": str(REPO / "docs" / "*.md"), "label": "docs", "weight": 0.3},
            {"name": str(tmp / "first200.jsonl"), "label": "first200", "weight": 0.1}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as tmp:
        mixture, _, model = tiny_run_data(three_sources(Path(tmp)))
        print(mixture.repeat_report(10_000))
        single, _, _ = tiny_run_data()
        rates = loader_vs_model({"mixture": mixture.train_batches(0, 1), "single": single.train_batches(0, 1)},
                                model, args.repeats, n=400)
    loader, plain, consumer = rates["mixture"], rates["single"], rates["model"]
    print(f"micro-batches of recipes/tiny.yaml from a three-source mixture (median of {args.repeats}):")
    print(f"  loader delivers           {loader:10,.0f} batches/s")
    print(f"  (one source, builtin      {plain:10,.0f} batches/s)")
    print(f"  tiny model consumes       {consumer:10,.1f} batches/s (forward + backward)")
    print(f"  ratio loader/model = {loader / consumer:.0f}x (target >= 20x)")


if __name__ == "__main__":
    main()
