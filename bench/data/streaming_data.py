"""Streaming by units over HTTP, each figure against a peer measured in the same run.

    python bench/data/streaming_data.py [--gb 1.0] [--repeats 3] [--sections 1,2,3,4,5]

A corpus of about --gb GB of parquet (16 files, row groups of 1,000 documents: the embedded
corpus's documents, each copy tagged so no two are equal) is written to a temporary directory and
served by tests/helpers/range_server.py (HTTP with Range requests, as a bucket or the hub would serve it).

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
   every stream at the same step) against one step ahead and inline reading (0). Runs 2 for its rate.
4. Replicas sharing a stream: every dp rank's iterator (dp = 8, 16; global batch 64) built in this
   process over the server, a few steps of each drawn inline; unit bytes sent to all ranks over
   the bytes of the distinct units among them, for data.streams=4 (a fixed count below dp, as the
   recipes' 16 was at dp > 16: a stream shared by dp/4 replicas, each reading it whole) against
   data.streams unset (one stream per sample: every dp divides it, expected 1.0x); peer:
   read_share's prediction. On a small corpus of its own (256 row groups of 8 documents), not --gb's.
5. Start-up at 100,000 units, no I/O: seconds and memory (tracemalloc) of what every process
   does before step 1: the unit list of 100 line files from their sizes, the held-out units
   (val_fraction 0.005), and epoch 0 dealt to 1,024 streams (those rank 0 of dp 8 reads, and
   all); peer: the same work in plain Python (a list of Unit objects, the held-out rule ranking a
   Python list, a permutation per stream).

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
import tracemalloc
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from bench import REPO
from data.builtin import builtin_corpus, builtin_tokenizer_dir, load_tokenizer
from data.run import prepare_run_data
from data.spec import DataSpec
from data.streaming import rank_slots, read_share, stream_units, streams_of_slots, unit_order
from data.files import SourceFiles
from data.units import FileUnits, Unit, UnitSource, line_units, unit_hash
from launch.engine.distributed import launcher_command

# The streaming tests' HTTP server, one copy for both: tests/ is not part of the installed package.
sys.path.insert(0, str(REPO / "tests"))
from helpers.range_server import RangeServer  # noqa: E402

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
SECTIONS = (1, 2, 3, 4, 5)
SHARED_DOCS_PER_GROUP, SHARED_GROUPS = 8, 256  # section 4's corpus: units of ~6 windows, ~6 MB in all
SHARED_DPS, OLD_STREAMS, SHARED_STEPS, SHARED_SHUFFLE_BUFFER, SHARED_MICRO_BATCH = (8, 16), 4, 4, 4, 4
STARTUP_FILES, STARTUP_UNITS_PER_FILE, STARTUP_UNIT_BYTES = 100, 1_000, 8 * 2 ** 20  # data.unit_bytes's default
STARTUP_STREAMS, STARTUP_BATCH, STARTUP_DP, STARTUP_VAL_FRACTION = 1024, 1024, 8, 0.005


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 2, like every other bad input of the repo
        print(f"{self.prog}: {message}", file=sys.stderr)
        sys.exit(2)


def parse_args() -> argparse.Namespace:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0, help="size of the parquet corpus in GB (default 1.0)")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions of each rate (default 3)")
    parser.add_argument("--sections", default=",".join(map(str, SECTIONS)),
                        help="the sections to run, comma-separated (default all: 1,2,3,4,5; 3 runs 2 too)")
    args = parser.parse_args()
    given = args.sections.split(",")
    if not all(k.strip() in {str(n) for n in SECTIONS} for k in given):
        parser.error(f"--sections {args.sections} must be some of 1,2,3,4,5, comma-separated")
    args.sections = {int(k) for k in given}
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


def write_corpus(root: Path, gb: float, texts: List[str], docs_per_group: int = DOCS_PER_GROUP,
                 min_groups: int = 0) -> Dict[str, float]:
    """FILES parquet files, a row group at a time dealt round-robin (memory stays one row group),
    until they hold `gb` GB on disk and `min_groups` row groups (snappy, pyarrow's defaults, as
    most published corpora)."""
    start = time.perf_counter()
    schema = pa.schema([("text", pa.string())])
    paths = [root / f"part{f:02d}.parquet" for f in range(FILES)]
    writers = [pq.ParquetWriter(p, schema) for p in paths]
    docs, groups, text_bytes = tagged_documents(texts), 0, 0
    try:
        while groups % FILES or groups < min_groups or sum(p.stat().st_size for p in paths) < gb * 1e9:
            batch = [next(docs) for _ in range(docs_per_group)]
            text_bytes += sum(len(t.encode()) for t in batch)
            writers[groups % FILES].write_table(pa.table({"text": batch}, schema=schema), row_group_size=docs_per_group)
            groups += 1
    finally:
        for w in writers:
            w.close()
    return {"bytes": sum(p.stat().st_size for p in paths), "text_bytes": text_bytes, "groups": groups,
            "docs": groups * docs_per_group, "seconds": time.perf_counter() - start}


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
    """tests/helpers/range_server.py in its own process, so serving never takes the GIL from the loader measured here."""
    proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "helpers" / "range_server.py"), str(root)],
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


# -- 4. replicas sharing a stream --

def shared_stream_data(url: str, tokenizer, streams: Optional[int]):
    """Section 4's run data: no validation, a small shuffle block, nothing read ahead of the steps drawn."""
    spec = DataSpec(name=f"{url}/*.parquet", streaming=True, streams=streams, shuffle_buffer=SHARED_SHUFFLE_BUFFER,
                    val_fraction=0.0, read_ahead_steps=0)
    return prepare_run_data(spec, tokenizer, SEQ_LEN, seed=1, global_batch_size=GLOBAL_BATCH,
                            micro_batch_size=SHARED_MICRO_BATCH, evaluate=False)


def job_fetch(data, dp: int, server: RangeServer, layout: Dict[str, Tuple[int, int]]) -> Tuple[int, int, int]:
    """SHARED_STEPS steps of every one of the dp ranks, drawn in turn: (unit bytes the server sent
    them all, bytes of the distinct units among them, distinct units); footers left out (this
    process's ranks share one reader, and its footers)."""
    server.reset()
    for rank in range(dp):
        batches = data.train_batches(rank, dp)
        for _ in range(SHARED_STEPS * (GLOBAL_BATCH // dp // SHARED_MICRO_BATCH)):
            next(batches)
        batches.close()
    with server.lock:
        units = [(name, a, b) for name, a, b in server.requests if a < layout[name][1]]
    distinct = set(units)
    return sum(b - a for _, a, b in units), sum(b - a for _, a, b in distinct), len(distinct)


def measure_shared_streams(work: Path, texts: List[str], tokenizer) -> None:
    root = work / "corpus-shared"
    root.mkdir()
    corpus = write_corpus(root, 0.0, texts, SHARED_DOCS_PER_GROUP, SHARED_GROUPS)
    server, layout = RangeServer(root), footer_bytes(root)
    try:
        runs = {streams: shared_stream_data(server.url, tokenizer, streams) for streams in (OLD_STREAMS, None)}
        fetched_by = {(streams, dp): job_fetch(data, dp, server, layout)
                      for streams, data in runs.items() for dp in SHARED_DPS}
    finally:
        server.close()
    print(f"replicas sharing a stream, over HTTP (server and every dp rank's iterator in this process): global batch "
          f"{GLOBAL_BATCH}, {SHARED_STEPS} steps of every rank drawn inline (read_ahead_steps=0), shuffle blocks of "
          f"{SHARED_SHUFFLE_BUFFER}; a corpus of {corpus['groups']} row groups of {SHARED_DOCS_PER_GROUP} documents "
          f"({corpus['bytes'] / 1e6:.1f} MB); unit bytes the server sent to all ranks / bytes of the distinct units "
          f"among them (footers left out):")
    for dp in SHARED_DPS:
        ratio = {}
        for streams, data in runs.items():
            sent, distinct, units = fetched_by[streams, dp]
            ratio[streams] = sent / distinct
            resolved = data.spec.streams
            label = (f"data.streams={resolved} (before: each stream read by {dp // resolved} replicas)"
                     if streams is not None else f"data.streams unset (= {resolved}, the default)")
            print(f"  dp={dp:2d}, {label}: sent {sent / 1e6:5.2f} MB, {units} distinct units of {distinct / 1e6:5.2f} MB "
                  f"= {ratio[streams]:.2f}x (read_share({resolved}, {dp}) = {read_share(resolved, dp):.2f})")
        print(f"  dp={dp:2d}: before / now = {ratio[OLD_STREAMS] / ratio[None]:.2f}")


# -- 5. start-up at 100,000 units --

class SizedLineUnits(UnitSource):
    """The peer's source: a list of Unit objects, identities as FileUnits.identity ("name#part")."""

    def __init__(self, names: List[str], units):
        self.label, self.names, self.units = "bench", names, units

    def identity(self, unit: Unit) -> str:
        return f"{self.names[unit.file]}#{unit.part}"


def old_unit_list(sizes: List[int], unit_bytes: int) -> List[Unit]:
    """The peer's unit list: a Unit object each, where UnitTable keeps numpy columns."""
    return [Unit(f, k, a, min(a + unit_bytes, size)) for f, size in enumerate(sizes)
            for k, a in enumerate(range(0, size, unit_bytes))]


def old_held_out(source: UnitSource, val_fraction: float) -> Tuple[List[Unit], List[Unit]]:
    """The peer's UnitSource.held_out: a Python sort of the indices by hash, a set of the held."""
    units = source.units
    n_held = math.ceil(val_fraction * len(units))
    ranked = sorted(range(len(units)), key=lambda i: unit_hash(source.identity(units[i])))
    held = set(ranked[:n_held])
    return [u for i, u in enumerate(units) if i not in held], [u for i, u in enumerate(units) if i in held]


def new_deal(n_units: int, streams: range) -> list:
    unit_order.cache_clear()  # a process deals an epoch once: its first stream computes the order
    return [stream_units(n_units, t, STARTUP_STREAMS, 1, 0, True) for t in streams]


def old_deal(n_units: int, streams: range) -> list:
    """The peer's stream_units: the epoch's permutation computed (and made a list) for every stream."""
    return [np.random.default_rng([1, 0]).permutation(n_units).tolist()[t::STARTUP_STREAMS] for t in streams]


def kept_bytes(dealt: list) -> int:
    """Bytes the dealt streams keep: each list and its ints (the peer); each view, and the array
    under them once (ours)."""
    total, bases = 0, {}
    for d in dealt:
        total += sys.getsizeof(d)
        if isinstance(d, np.ndarray):
            base = d if d.base is None else d.base
            bases[id(base)] = base.nbytes
        else:
            total += sum(sys.getsizeof(i) for i in d)
    return total + sum(bases.values())


def traced(f, *args) -> Tuple[float, float]:
    """(peak, held after) MiB of f(*args) by tracemalloc, its result kept until measured."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        result = f(*args)
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del result
    return (peak - before) / 2 ** 20, (current - before) / 2 ** 20


def measure_startup(repeats: int) -> None:
    sizes = [STARTUP_UNITS_PER_FILE * STARTUP_UNIT_BYTES - STARTUP_UNIT_BYTES // 2] * STARTUP_FILES  # last unit half
    names = [f"data/part-{f:05d}.jsonl" for f in range(STARTUP_FILES)]
    table, listed = line_units(sizes, STARTUP_UNIT_BYTES), old_unit_list(sizes, STARTUP_UNIT_BYTES)
    assert [tuple(r) for r in table.rows.tolist()] == [(u.file, u.part, u.start, u.stop, u.text_bytes) for u in listed]
    files = SourceFiles(fs=None, paths=names, names=names, sizes=sizes, versions=[""] * len(names), format="text",
                        label="bench")  # line files known by their sizes: listing their units reads nothing
    new_source, old_source = FileUnits(files, "text", STARTUP_UNIT_BYTES), SizedLineUnits(names, listed)
    assert np.array_equal(new_source.units.rows, table.rows)
    n_train = len(new_source.held_out(STARTUP_VAL_FRACTION)[0])
    assert n_train == len(old_held_out(old_source, STARTUP_VAL_FRACTION)[0])
    rank = streams_of_slots(*rank_slots(0, STARTUP_DP, STARTUP_BATCH), STARTUP_BATCH, STARTUP_STREAMS)
    every = range(STARTUP_STREAMS)
    phases = {  # name -> ((ours, its args), (the peer, its args)); printed as now and before
        "unit list from sizes": ((line_units, sizes, STARTUP_UNIT_BYTES), (old_unit_list, sizes, STARTUP_UNIT_BYTES)),
        f"held_out(val_fraction={STARTUP_VAL_FRACTION})": ((new_source.held_out, STARTUP_VAL_FRACTION),
                                                          (old_held_out, old_source, STARTUP_VAL_FRACTION)),
        f"epoch 0 to rank 0 of dp {STARTUP_DP}'s {len(rank)} streams": ((new_deal, n_train, rank),
                                                                        (old_deal, n_train, rank)),
        f"epoch 0 to all {STARTUP_STREAMS} streams": ((new_deal, n_train, every), (old_deal, n_train, every)),
    }
    seconds: Dict[Tuple[str, int], List[float]] = {(name, k): [] for name in phases for k in (0, 1)}
    for _ in range(repeats):  # the variants alternate
        for name, variants in phases.items():
            for k, (f, *args) in enumerate(variants):
                seconds[name, k].append(timed(f, *args))
    memory = {}
    for name, variants in phases.items():
        for k, (f, *args) in enumerate(variants):
            if name.startswith("epoch"):  # tracing 100k ints a stream x 1024 would take minutes
                memory[name, k] = (traced(f, args[0], args[1][:1])[0], kept_bytes(f(*args)) / 2 ** 20)
            else:
                memory[name, k] = traced(f, *args)
    print(f"start-up at {len(table):,} units, no I/O ({STARTUP_FILES} line files x {STARTUP_UNITS_PER_FILE:,} units of "
          f"{STARTUP_UNIT_BYTES // 2 ** 20} MiB, identities \"name#part\"; {n_train:,} training units; "
          f"{STARTUP_STREAMS} streams, global batch {STARTUP_BATCH}): now (UnitTable, numpy, the epoch's order "
          f"cached) against before (a list of Unit objects, a Python sort, a permutation per stream); seconds: median "
          f"of {repeats}; memory: tracemalloc peak during it / held after it (dealing: the peak of one stream's "
          f"dealing, and what the streams keep, measured by size):")
    total = {k: [0.0, 0.0] for k in (0, 1)}
    for name in phases:
        figures = []
        for k in (0, 1):
            sec, (peak, held) = statistics.median(seconds[name, k]), memory[name, k]
            figures.append(f"{'now' if k == 0 else 'before'} {sec:7.3f} s, peak {peak:6.1f} MiB, held {held:6.1f} MiB")
            if not name.startswith("epoch 0 to all"):
                total[k][0] += sec
                total[k][1] += held
        ratio_s = statistics.median(seconds[name, 0]) / statistics.median(seconds[name, 1])
        ratio_m = memory[name, 0][1] / memory[name, 1][1]
        print(f"  {name}: {'; '.join(figures)}; now/before: {ratio_s:.3g}x time, {ratio_m:.3g}x held")
    print(f"  before step 1 (rank 0 of dp {STARTUP_DP}: the list, held_out, its streams): now {total[0][0]:.3f} s, "
          f"held {total[0][1]:.1f} MiB; before {total[1][0]:.3f} s, held {total[1][1]:.1f} MiB; now/before: "
          f"{total[0][0] / total[1][0]:.3f}x time, {total[0][1] / total[1][1]:.3f}x held")


def main() -> None:
    args = parse_args()
    if args.sections == {5}:  # no I/O, no tokenizer
        measure_startup(args.repeats)
        return
    tokenizer = load_tokenizer("builtin")  # builds the tokenizer into the default cache if it is not there
    texts = list(builtin_corpus()["text"])
    with tempfile.TemporaryDirectory() as tmp:
        work, root = Path(tmp), Path(tmp) / "corpus"
        root.mkdir()
        if args.sections & {1, 2, 3}:
            corpus = write_corpus(root, args.gb, texts)
            print(f"corpus: {corpus['bytes'] / 1e9:.2f} GB of parquet ({corpus['text_bytes'] / 1e9:.2f} GB of text), "
                  f"{FILES} files, {corpus['groups']} row groups of {DOCS_PER_GROUP} documents, {corpus['docs']:,} "
                  f"documents, written in {corpus['seconds']:.1f} s")
        if 1 in args.sections:
            measure_launches(root, work, corpus["bytes"])
        # this process's own caches (the units list) go to the temporary directory too, not the user's
        os.environ["GPT3D_CACHE"] = str(fresh_cache(work / "cache-bench"))
        if args.sections & {2, 3}:
            server, url = start_server_process(root)
            try:
                peer_texts = pq.ParquetFile(root / "part00.parquet").read_row_groups(range(PEER_GROUPS))["text"]
                loader = measure_rates(url, tokenizer, peer_texts.to_pylist(), args.repeats)
                if 3 in args.sections:
                    measure_waits(url, tokenizer, loader, args.repeats)
            finally:
                server.kill()
                server.wait()
        if 4 in args.sections:
            measure_shared_streams(work, texts, tokenizer)
    if 5 in args.sections:
        measure_startup(args.repeats)


if __name__ == "__main__":
    main()
