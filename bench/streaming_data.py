"""Streaming data: resume cost against samples consumed, and tokens/s per rank against dp, on the
embedded corpus written into 16 local parquet shards and read through `datasets` streaming like a
hub dataset (the method and results: docs/performance.md, "Data pipeline").

    python bench/streaming_data.py [--copies 4] [--repeats 3]"""
import argparse
import statistics
import tempfile
import time
from pathlib import Path

import datasets
import torch

from data.builtin import builtin_corpus, load_tokenizer
from data.run import prepare_run_data
from data.spec import DataSpec
from data.streaming import merge_states
from launch.config.recipe import load_recipe
from model.gpt import GPT
from model.loss import vocab_parallel_cross_entropy

REPO = Path(__file__).resolve().parent.parent
H100_GPT2_124M_TOKENS_PER_S = 460_000  # llm.c, GPT-2 124M, one H100, bf16
SEQ_LEN, GLOBAL_BATCH, MICRO_BATCH, STREAMS = 63, 64, 8, 4


def write_shards(root: Path, copies: int, n_shards: int = 16) -> str:
    texts = builtin_corpus()["text"]
    docs = [f"[copy {c}] {t}" for c in range(copies) for t in texts]
    per = -(-len(docs) // n_shards)
    for i in range(n_shards):
        shard = datasets.Dataset.from_dict({"text": docs[i * per:(i + 1) * per]})
        shard.to_parquet(str(root / f"shard{i:02d}.parquet"))
    return str(root / "shard*.parquet")


def consume(data, dp_rank: int, dp: int, steps: int, start_step: int = 0, data_state=None):
    """Time to build rank `dp_rank`'s iterator and read `steps` steps; the iterator's state."""
    per_rank_micro = GLOBAL_BATCH // dp // MICRO_BATCH
    start = time.perf_counter()
    it = data.train_batches(dp_rank, dp, start_sample=start_step * GLOBAL_BATCH, data_state=data_state)
    first = None
    for i in range(steps * per_rank_micro):
        next(it)
        if i == 0:
            first = time.perf_counter() - start
    return first, time.perf_counter() - start, it.state()


def steady_rate(data, dp: int, steps: int) -> float:
    """Tokens/s rank 0 delivers after its first step (which fills the first blocks)."""
    it = data.train_batches(0, dp)
    per_rank_micro = GLOBAL_BATCH // dp // MICRO_BATCH
    for _ in range(per_rank_micro):
        next(it)
    start = time.perf_counter()
    for _ in range(steps * per_rank_micro):
        next(it)
    return steps * GLOBAL_BATCH // dp * (SEQ_LEN + 1) / (time.perf_counter() - start)


def raw_tokenizer_rate(tokenizer, texts) -> float:
    start = time.perf_counter()
    n = sum(len(ids) + 1 for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])
    return n / (time.perf_counter() - start)


def model_tokens_per_s(repeats: int) -> float:
    recipe = load_recipe(REPO / "recipes" / "demo.yaml", [])
    model = GPT(recipe.gpt_config(len(load_tokenizer("builtin"))))
    x = torch.randint(0, 4096, (recipe.train.micro_batch_size, recipe.seq_len))
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(5):
            vocab_parallel_cross_entropy(model(x), x, None).mean().backward()
        rates.append(5 * x.numel() / (time.perf_counter() - start))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--copies", type=int, default=4, help="copies of the corpus (about 0.5M tokens each)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tokenizer = load_tokenizer("builtin")
    with tempfile.TemporaryDirectory() as tmp:
        spec = DataSpec(name=write_shards(Path(tmp), args.copies), streaming=True, streams=STREAMS,
                        shuffle_buffer=256, val_fraction=0.01)
        data = prepare_run_data(spec, tokenizer, SEQ_LEN, seed=1, global_batch_size=GLOBAL_BATCH,
                                micro_batch_size=MICRO_BATCH, evaluate=False)
        print(f"resume of a {STREAMS}-stream run, windows of {SEQ_LEN + 1} tokens, global batch {GLOBAL_BATCH} "
              f"(median of {args.repeats}):")
        states, reread = {}, {}
        for n in (1_000, 100_000):
            _, reread[n], state = consume(data, 0, 1, n // GLOBAL_BATCH)
            states[n] = merge_states([state], STREAMS)
        cost = {n: [] for n in states}
        for _ in range(args.repeats):  # alternate, so drift of a shared machine hits both
            for n, state in states.items():
                cost[n].append(consume(data, 0, 1, 1, start_step=n // GLOBAL_BATCH, data_state=state)[0])
        cost = {n: statistics.median(c) for n, c in cost.items()}
        for n in states:
            print(f"  after {n:>7,} samples: resume {cost[n]:7.3f} s to the first batch; reading them "
                  f"from the start took {reread[n]:7.2f} s (ratio {reread[n] / cost[n]:,.0f}x)")
        print(f"  cost(100k) / cost(1k) = {cost[100_000] / cost[1_000]:.2f} (target about 1)")

        demo = model_tokens_per_s(args.repeats)
        raw = statistics.median(raw_tokenizer_rate(tokenizer, list(builtin_corpus()["text"])) for _ in range(args.repeats))
        rate_spec = DataSpec(**{**spec.__dict__, "shuffle_buffer": 64})
        rate_data = prepare_run_data(rate_spec, tokenizer, SEQ_LEN, seed=1, global_batch_size=GLOBAL_BATCH,
                                     micro_batch_size=MICRO_BATCH, evaluate=False)
        steps = 200  # each stream then tokenizes ~14 batches of 64 documents: a rate, not a buffer drained
        print(f"tokens/s delivered by rank 0 (it reads {STREAMS}/dp streams; {steps} steps after one, blocks of 64 "
              f"windows, median of {args.repeats}) against a model's consumption per rank:")
        rates = {dp: [] for dp in (1, 2, 4)}
        for _ in range(args.repeats):  # alternate the dp values, so drift hits each alike
            for dp in rates:
                rates[dp].append(steady_rate(rate_data, dp, steps))
        base = statistics.median(rates[1])
        for dp, measured in rates.items():
            rate = statistics.median(measured)
            print(f"  dp={dp}: {rate:10,.0f} tok/s per rank (x{rate / base:.2f} of dp=1, {rate / raw:.2f} of the raw "
                  f"tokenizer); job {rate * dp:10,.0f} tok/s; per rank / GPT-2 124M on an H100 = "
                  f"{rate / H100_GPT2_124M_TOKENS_PER_S:.2f}; / CPU demo model = {rate / demo:.1f}")
        print(f"  raw tokenizer(batch of every document), this machine: {raw:,.0f} tok/s")
        print(f"  CPU demo model (recipes/demo.yaml, forward + backward, this machine): {demo:,.0f} tok/s")


if __name__ == "__main__":
    main()
