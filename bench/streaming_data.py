"""Streaming by units over HTTP (issue 22's "Proof"), each figure against a peer measured in the same run.

    python bench/streaming_data.py [--gb 1.0] [--repeats 3]

A corpus of about --gb GB of parquet (16 files, row groups of 1,000 documents: the embedded
corpus's documents, each copy tagged so no two are equal) is written to a temporary directory and
served by bench/range_server.py (HTTP with Range requests, as a bucket or the hub would serve it).

1. Start-up: seconds from launching launch/train.py (recipes/tiny.yaml, data.streaming=true over
   the URL) to its step 1 with an empty data cache, on 1 process and on 2 (DeepSpeed's launcher);
   peer: the same 1-process launch once its cache is warm. Bytes the server sent before step 1,
   against the corpus's size (target: a tiny fraction: footers, validation units, first units).
2. Tokens/s per rank at dp = 1, 2, 4: what rank 0's iterator delivers (it reads streams/dp of
   the streams) in windows of 1024 tokens; peers: the raw tokenizer on the same documents, and
   what GPT-2 124M consumes on one H100 (llm.c).
3. Share of step time spent waiting on data, for a stand-in model slower than the loader
   (target: under 2% with read-ahead): the default read-ahead (as deep as the steps between two
   refills of the streams' shuffle blocks: a stream tokenizes a whole block of windows at once,
   every stream at the same step) against one step ahead and inline reading (0).

Repetitions alternate the variants, so drift of a shared machine hits each alike; medians.
"""
import argparse
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from bench.range_server import RangeServer
from data.builtin import builtin_corpus, builtin_tokenizer_dir, load_tokenizer
from data.run import prepare_run_data
from data.spec import DataSpec
from launch.runtime.distributed import launcher_command

REPO = Path(__file__).resolve().parent.parent

H100_GPT2_124M_TOKENS_PER_S = 460_000  # llm.c, GPT-2 124M, one H100, bf16
FILES, DOCS_PER_GROUP = 16, 1_000
SEQ_LEN = 1023                         # windows of 1024 tokens, GPT-2's
STREAMS, GLOBAL_BATCH, MICRO_BATCH, SHUFFLE_BUFFER = 8, 64, 8, 256
BLOCK_STEPS = SHUFFLE_BUFFER // (GLOBAL_BATCH // STREAMS)
"""Steps between two refills of the streams' shuffle blocks: every stream gives B/S windows to a
step and refills its block of SHUFFLE_BUFFER windows at once, all streams at the same step, so a
rate is measured over whole blocks (a shorter span would see only windows already in memory)."""
MEASURED_BLOCKS = 2
PEER_GROUPS = 2  # row groups the raw tokenizer's peer tokenizes: about 1.8M tokens, 2 s
LAUNCH_TIMEOUT_S = 300


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 2, like every other bad input of the repo
        print(f"{self.prog}: {message}", file=sys.stderr)
        sys.exit(2)


def parse_args() -> argparse.Namespace:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0, help="size of the parquet corpus in GB (default 1.0)")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions of each rate (default 3)")
    args = parser.parse_args()
    if not args.gb > 0 or not math.isfinite(args.gb):
        parser.error(f"--gb {args.gb} must be a positive number")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats} must be >= 1")
    return args


# -- the corpus --

def tagged_documents(texts: List[str]) -> Iterator[str]:
    """The corpus's documents over and over, each copy tagged, so no document repeats."""
    copy = 0
    while True:
        for text in texts:
            yield f"[copy {copy}] {text}"
        copy += 1


def write_corpus(root: Path, gb: float, texts: List[str]) -> Dict[str, float]:
    """FILES parquet files, a row group at a time dealt round-robin (memory stays one row group),
    until they hold `gb` GB on disk (snappy, pyarrow's defaults, as most published corpora)."""
    start = time.perf_counter()
    schema = pa.schema([("text", pa.string())])
    paths = [root / f"part{f:02d}.parquet" for f in range(FILES)]
    writers = [pq.ParquetWriter(p, schema) for p in paths]
    docs, groups, text_bytes = tagged_documents(texts), 0, 0
    try:
        while groups % FILES or sum(p.stat().st_size for p in paths) < gb * 1e9:
            batch = [next(docs) for _ in range(DOCS_PER_GROUP)]
            text_bytes += sum(len(t.encode()) for t in batch)
            writers[groups % FILES].write_table(pa.table({"text": batch}, schema=schema), row_group_size=DOCS_PER_GROUP)
            groups += 1
    finally:
        for w in writers:
            w.close()
    return {"bytes": sum(p.stat().st_size for p in paths), "text_bytes": text_bytes, "groups": groups,
            "docs": groups * DOCS_PER_GROUP, "seconds": time.perf_counter() - start}


def footer_bytes(root: Path) -> Dict[str, Tuple[int, int]]:
    """file name -> (its size, where its footer starts: the last 8 + footer-length bytes)."""
    layout = {}
    for path in sorted(root.glob("*.parquet")):
        size = path.stat().st_size
        with open(path, "rb") as f:
            f.seek(size - 8)
            length = int.from_bytes(f.read(4), "little")
        layout[path.name] = (size, size - 8 - length)
    return layout


# -- 1. launch to step 1 --

def fresh_cache(root: Path) -> Path:
    """An empty data cache but for the builtin tokenizer (training it is not what is measured)."""
    tokenizer_dir = builtin_tokenizer_dir()
    root.mkdir(parents=True)
    shutil.copytree(tokenizer_dir, root / tokenizer_dir.name)
    return root


def train_command(procs: int, url: str, metrics: Path) -> List[str]:
    script = REPO / "launch" / "train.py"
    start = [sys.executable, str(script)] if procs == 1 else launcher_command(procs, script)
    return start + ["--recipe", str(REPO / "recipes" / "tiny.yaml"), "--steps", "3",
                    "--set", f"data.name={url}/*.parquet", "--set", "data.streaming=true",
                    "--set", "data.streams=4", "--set", "data.val_fraction=0.005", "--metrics-out", str(metrics)]


def launch_to_first_step(procs: int, url: str, cache: Path, server: RangeServer, work: Path
                         ) -> Tuple[float, List[Tuple[str, int, int]]]:
    """(seconds from Popen to the metrics file's first line, the server's requests by then);
    the run must then finish its 3 steps and exit 0. `work`: a new directory for its files."""
    work.mkdir(parents=True)
    metrics, log = work / "metrics.jsonl", work / "train.log"
    server.reset()
    with open(log, "w") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(train_command(procs, url, metrics), cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env=dict(os.environ, GPT3D_CACHE=str(cache)))
        try:
            while not (metrics.exists() and "\n" in metrics.read_text()):  # the file opens empty before step 1
                if proc.poll() is not None or time.perf_counter() - start > LAUNCH_TIMEOUT_S:
                    break
                time.sleep(0.05)
            seconds, requests = time.perf_counter() - start, list(server.requests)
            rc = proc.wait(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = f"nothing (still running after {LAUNCH_TIMEOUT_S} s)"
        finally:
            if proc.poll() is None:
                proc.kill()
    if rc != 0 or not metrics.exists() or not metrics.read_text():
        tail = log.read_text().strip().splitlines()[-5:]
        raise SystemExit(f"the {procs}-process run exited {rc} before its steps:\n  " + "\n  ".join(tail))
    return seconds, requests


def fetched(requests: List[Tuple[str, int, int]], layout: Dict[str, Tuple[int, int]]) -> Dict[str, int]:
    """Bytes sent by kind: footers (the last bytes of a file) and units (text column chunks)."""
    kinds = {"footers": 0, "footer_requests": 0, "units": 0, "unit_requests": 0}
    for name, start, end in requests:
        if start >= layout[name][1]:
            kinds["footers"] += end - start
            kinds["footer_requests"] += 1
        else:
            kinds["units"] += end - start
            kinds["unit_requests"] += 1
    return kinds


def report_launch(label: str, seconds: float, sent: Dict[str, int], corpus_bytes: int, peer: float) -> None:
    total = sent["footers"] + sent["units"]
    print(f"  {label}: {seconds:6.1f} s to step 1 ({seconds / peer:.2f}x the warm 1-process launch); "
          f"fetched {total / 1e6:6.1f} MB = {total / corpus_bytes:.2%} of the corpus "
          f"(footers: {sent['footer_requests']} reads, {sent['footers'] / 1e3:.0f} kB; "
          f"units: {sent['unit_requests']} reads, {sent['units'] / 1e6:.1f} MB)")


def measure_launches(root: Path, work: Path, corpus_bytes: int) -> None:
    server, layout = RangeServer(root), footer_bytes(root)
    try:
        cold = fresh_cache(work / "cache-1")
        one = launch_to_first_step(1, server.url, cold, server, work / "run-1")
        warm = launch_to_first_step(1, server.url, cold, server, work / "run-1-warm")  # the peer: that cache, filled
        two = launch_to_first_step(2, server.url, fresh_cache(work / "cache-2"), server, work / "run-2")
    finally:
        server.close()
    print("launch/train.py (recipes/tiny.yaml: seq_len 32, global batch 16, data.streams=4, default "
          "shuffle_buffer; data.val_fraction=0.005) to its step 1 over HTTP, from Popen to the metrics file's "
          "first line; the server ran in this process and counted every body byte it sent by then:")
    report_launch("1 process,  empty cache", one[0], fetched(one[1], layout), corpus_bytes, warm[0])
    report_launch("1 process,  warm cache ", warm[0], fetched(warm[1], layout), corpus_bytes, warm[0])
    report_launch("2 processes, empty cache", two[0], fetched(two[1], layout), corpus_bytes, warm[0])
    print("  (every run then finished its 3 steps and exited 0)")


# -- 2. tokens/s per rank --

def start_server_process(root: Path) -> Tuple[subprocess.Popen, str]:
    """bench/range_server.py in its own process, so serving never takes the GIL from the loader measured here."""
    proc = subprocess.Popen([sys.executable, str(REPO / "bench" / "range_server.py"), str(root)],
                            stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def stream_data(url: str, tokenizer, read_ahead_steps: Optional[int] = 0):
    """The run data of the served corpus, as a trainer would build it (no validation: not measured here)."""
    spec = DataSpec(name=f"{url}/*.parquet", streaming=True, streams=STREAMS, shuffle_buffer=SHUFFLE_BUFFER,
                    val_fraction=0.0, read_ahead_steps=read_ahead_steps)
    return prepare_run_data(spec, tokenizer, SEQ_LEN, seed=1, global_batch_size=GLOBAL_BATCH,
                            micro_batch_size=MICRO_BATCH, evaluate=False)


def micro_per_step(dp: int) -> int:
    return GLOBAL_BATCH // dp // MICRO_BATCH


def loader_rate(data, dp: int) -> float:
    """Tokens/s rank 0 delivers over MEASURED_BLOCKS whole shuffle blocks, after its first step
    (which fills the first blocks)."""
    batches = data.train_batches(0, dp)
    for _ in range(micro_per_step(dp)):
        next(batches)
    steps = MEASURED_BLOCKS * BLOCK_STEPS
    start = time.perf_counter()
    for _ in range(steps * micro_per_step(dp)):
        next(batches)
    return steps * GLOBAL_BATCH // dp * (SEQ_LEN + 1) / (time.perf_counter() - start)


def raw_tokenizer_rate(tokenizer, texts: List[str], batch: int = 64) -> float:
    """Tokens/s (EOS included) of the tokenizer alone, in batches of 64 documents as the streams tokenize."""
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(texts), batch):
        ids = tokenizer(texts[i:i + batch], add_special_tokens=False, return_attention_mask=False)["input_ids"]
        tokens += sum(len(d) + 1 for d in ids)
    return tokens / (time.perf_counter() - start)


def measure_rates(url: str, tokenizer, peer_texts: List[str], repeats: int) -> float:
    """Prints the rates; returns rank 0's tokens/s at dp=1 (the loader the stand-in model must outrun)."""
    data = stream_data(url, tokenizer)
    rates: Dict[int, List[float]] = {dp: [] for dp in (1, 2, 4)}
    raw: List[float] = []
    for _ in range(repeats):
        raw.append(raw_tokenizer_rate(tokenizer, peer_texts))
        for dp in rates:
            rates[dp].append(loader_rate(data, dp))
    raw_rate = statistics.median(raw)
    print(f"tokens/s per rank over HTTP (server in its own process): rank 0's iterator at dp = 1, 2, 4 reads "
          f"{STREAMS}/dp of {STREAMS} streams, global batch {GLOBAL_BATCH} windows of {SEQ_LEN + 1} tokens, shuffle "
          f"blocks of {SHUFFLE_BUFFER}, read_ahead_steps=0; {MEASURED_BLOCKS * BLOCK_STEPS} steps ({MEASURED_BLOCKS} "
          f"refills of every block) after the first; median of {repeats}. This machine: {os.cpu_count()} CPU cores, "
          f"each dp rank measured alone on all of them:")
    base = statistics.median(rates[1])
    for dp, measured in rates.items():
        rate = statistics.median(measured)
        print(f"  dp={dp}: {rate:10,.0f} tok/s per rank = {rate / raw_rate:.2f} of the raw tokenizer, "
              f"{rate / base:.2f} of dp=1, {rate / H100_GPT2_124M_TOKENS_PER_S:.2f} of GPT-2 124M on an H100 "
              f"({H100_GPT2_124M_TOKENS_PER_S:,} tok/s, llm.c)")
    print(f"  peer: the raw tokenizer (builtin BPE) on the {len(peer_texts):,} documents of {PEER_GROUPS} row groups, "
          f"in batches of 64 as the streams tokenize: {raw_rate:,.0f} tok/s")
    return base


# -- 3. time waited on data --

class StandIn(torch.nn.Module):
    """A small model whose forward and backward are torch ops (which release the GIL, as a GPU
    step leaves the host free): embeddings, an MLP, a squared-activation loss; `passes` of it per
    micro-batch set its cost."""

    def __init__(self, vocab: int, width: int = 16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))
        self.passes = 1

    def step(self, x: torch.Tensor) -> None:
        for _ in range(self.passes):
            self.mlp(self.embed(x)).pow(2).mean().backward()


def calibrated_model(vocab: int, seconds_per_micro: float) -> Tuple[StandIn, float]:
    """The stand-in with enough passes to take at least `seconds_per_micro` per micro-batch alone;
    (it, its measured seconds per micro-batch)."""
    model, x = StandIn(vocab), torch.randint(0, vocab, (MICRO_BATCH, SEQ_LEN))
    model.step(x)  # warm-up
    one = statistics.median(timed(model.step, x) for _ in range(10))
    model.passes = max(1, math.ceil(seconds_per_micro / one))
    start = time.perf_counter()
    for _ in range(10):
        model.step(x)
    return model, (time.perf_counter() - start) / 10


def timed(f, *args) -> float:
    start = time.perf_counter()
    f(*args)
    return time.perf_counter() - start


def waited_share(url: str, tokenizer, model: StandIn, read_ahead_steps: Optional[int], steps: int) -> float:
    """Seconds waited on data / seconds of steps 2..steps+1 (the first step fills every stream's
    first block, which nothing can hide), rank 0 of dp=1 training `model` on each micro-batch."""
    batches = stream_data(url, tokenizer, read_ahead_steps).train_batches(0, 1)
    for _ in range(micro_per_step(1)):
        model.step(next(batches)[0])
    waited_before = batches.waited_s  # the time spent in drawing: inline reading, or waiting on the thread
    start = time.perf_counter()
    for _ in range(steps * micro_per_step(1)):
        model.step(next(batches)[0])
    total = time.perf_counter() - start
    waited = batches.waited_s - waited_before
    batches.close()  # its thread stops, and takes no core from the next variant
    return waited / total


def measure_waits(url: str, tokenizer, loader_tokens_per_s: float, repeats: int) -> None:
    torch.set_num_threads(1)  # the model on one core, the loader's thread on the other (a GPU node's host
    #                           cores are the loader's while the GPU runs the step)
    loader_step_s = GLOBAL_BATCH * (SEQ_LEN + 1) / loader_tokens_per_s
    model, micro_s = calibrated_model(len(tokenizer), 1.5 * loader_step_s / micro_per_step(1))
    steps = MEASURED_BLOCKS * BLOCK_STEPS
    variants = (None, 1, 0)  # the default (BLOCK_STEPS deep), one step ahead, inline
    shares: Dict[Optional[int], List[float]] = {k: [] for k in variants}
    for _ in range(repeats):
        for k in variants:
            shares[k].append(waited_share(url, tokenizer, model, k, steps))
    share = {k: statistics.median(v) for k, v in shares.items()}
    print(f"share of step time waited on data, rank 0 at dp=1 ({STREAMS} streams, the spec above) training a "
          f"stand-in torch model (1 thread) of {micro_s * micro_per_step(1):.3f} s per step alone = "
          f"{micro_s * micro_per_step(1) / loader_step_s:.2f}x the loader's {loader_step_s:.3f} s per step; "
          f"{steps} steps after the first, median of {repeats}:")
    print(f"  read_ahead_steps=null (the default: {BLOCK_STEPS} steps, those between two block refills): "
          f"{share[None]:7.2%} (target under 2%)")
    print(f"  read_ahead_steps=1: {share[1]:7.2%}")
    print(f"  read_ahead_steps=0 (inline): {share[0]:7.2%}; default / inline = "
          f"{share[None] / share[0] if share[0] else float('nan'):.3f}")


def main() -> None:
    args = parse_args()
    tokenizer = load_tokenizer("builtin")  # builds the tokenizer into the default cache if it is not there
    texts = list(builtin_corpus()["text"])
    with tempfile.TemporaryDirectory() as tmp:
        work, root = Path(tmp), Path(tmp) / "corpus"
        root.mkdir()
        corpus = write_corpus(root, args.gb, texts)
        print(f"corpus: {corpus['bytes'] / 1e9:.2f} GB of parquet ({corpus['text_bytes'] / 1e9:.2f} GB of text), "
              f"{FILES} files, {corpus['groups']} row groups of {DOCS_PER_GROUP} documents, {corpus['docs']:,} "
              f"documents, written in {corpus['seconds']:.1f} s")
        measure_launches(root, work, corpus["bytes"])
        # this process's own caches (the units list) go to the temporary directory too, not the user's
        os.environ["GPT3D_CACHE"] = str(fresh_cache(work / "cache-bench"))
        server, url = start_server_process(root)
        try:
            peer_texts = pq.ParquetFile(root / "part00.parquet").read_row_groups(range(PEER_GROUPS))["text"]
            loader = measure_rates(url, tokenizer, peer_texts.to_pylist(), args.repeats)
            measure_waits(url, tokenizer, loader, args.repeats)
        finally:
            server.kill()
            server.wait()


if __name__ == "__main__":
    main()
