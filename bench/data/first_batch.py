"""Time to the first batch and memory of a streaming rank, dp 1 against dp 8, in one run.

    python bench/data/first_batch.py [--global-batch 256] [--dps 1,8] [--corpus DIR] [--old COMMIT]

A FineWeb-like corpus is written (local parquet, row groups of 1,000 documents of about 3.5 KB;
about half the documents hold a typographic apostrophe, 1 in 20 an emoji: CPython stores those as
2 and 4 bytes a character) with at least B row groups, so each of the B streams (data.streams
unset) reads a unit of its own. Each configuration runs in a process of its own (RSS is then its
own): dp rank 0 of dp = 1 and 8 at B = 256, seq_len 1024 (T = 1,025), the builtin tokenizer,
shuffle_buffer 16 and the default read-ahead (data/prepare_source.py: default_read_ahead_steps).
Each process lists the source and loads the tokenizer (not timed), then:
- first batch: seconds (wall and the process's CPU) from creating the rank's StreamingBatches to
  its first micro-batch, which waits for the streams of its slots to read their first units and
  fill their first blocks (the others open meanwhile); wall seconds from the process's start
  (imports, listing, tokenizer included); and wall seconds to the whole first step (B/dp
  windows, every stream opened);
- RSS: the process's RSS after the first batch, then its peak (sampled every 5 ms) once the read-ahead
  queue is full and the streams have refilled their blocks once (2 x 16 steps drawn), both
  above the RSS before the batches were created;
- the prediction: data/streaming.py's rank_memory_bytes (docs/data.md's formula), with U
  measured on one unit of the corpus as its stream holds it (unit_text_bytes), beside the peak.
--old COMMIT runs the same rank with data/streaming.py as of that commit too (its module loaded
from git), the peer before the change. Results go to stdout as one table.
"""
import time

STARTED = time.perf_counter()  # the process's start, before its imports: launch to first batch

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from bench import REPO

DOCS_PER_GROUP, DOC_CHARS = 1000, 3500
SEQ_LEN, BLOCK, MICRO = 1024, 16, 8


def fineweb_like_documents(n: int, seed: int) -> List[str]:
    """n documents of about DOC_CHARS characters from the embedded corpus's paragraphs, joined at
    random (no two alike, so the row groups compress as web text does, about 2x); every other one
    ends in a typographic apostrophe (U+2019: 2 bytes a character in CPython), every 20th in an
    emoji (U+1F642: 4 bytes a character)."""
    from data.builtin import builtin_corpus
    paragraphs = [t.strip() for t in builtin_corpus()["text"] if len(t.strip()) > 40]
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(paragraphs), size=(n, 40))
    docs = []
    for i in range(n):
        text, k = "", 0
        while len(text) < DOC_CHARS:
            text += paragraphs[picks[i, k % 40]] + " "
            k += 1
        docs.append(text[:DOC_CHARS] + (" it’s" if i % 2 == 0 else "") + (" 🙂" if i % 20 == 0 else ""))
    return docs


def write_corpus(root: Path, n_groups: int, groups_per_file: int = 16) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq
    root.mkdir(parents=True, exist_ok=True)
    if len(list(root.glob("part-*.parquet"))) * groups_per_file >= n_groups:
        return root
    for f in range(-(-n_groups // groups_per_file)):
        docs = fineweb_like_documents(DOCS_PER_GROUP * groups_per_file, seed=f)
        pq.write_table(pa.table({"text": docs}), root / f"part-{f:03d}.parquet", row_group_size=DOCS_PER_GROUP)
    return root


def rss_bytes() -> int:
    import psutil
    return psutil.Process().memory_info().rss


class PeakRSS:
    """The process's highest RSS from now to `stop`, sampled every 5 ms by a thread (ru_maxrss
    would also count whatever came before: the listing, the tokenizer's load)."""

    def __init__(self):
        import threading
        self.peak, self.done = rss_bytes(), threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while not self.done.wait(0.005):
            self.peak = max(self.peak, rss_bytes())

    def stop(self) -> int:
        self.done.set()
        self.thread.join()
        return max(self.peak, rss_bytes())


def load_streaming(old: str):
    """data.streaming as it is, or as of commit `old` (its file from git, loaded under another name)."""
    if not old:
        import data.streaming
        return data.streaming
    path = Path(tempfile.mkdtemp()) / "old_streaming.py"
    path.write_text(subprocess.run(["git", "show", f"{old}:data/streaming.py"], cwd=REPO, check=True,
                                   capture_output=True, text=True).stdout)
    spec = importlib.util.spec_from_file_location("old_streaming", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def child(corpus: Path, B: int, dp: int, old: str, seq_len: int, steps: int) -> dict:
    """One rank's measurements, in this process (run by `measure` in a process of its own)."""
    from data.builtin import load_tokenizer
    from data.prepare_source import default_read_ahead_steps, stream_sources, with_streams
    from data.spec import DataSpec
    streaming = load_streaming(old)
    from data.streaming import rank_memory_bytes, unit_text_bytes
    from data.tokens import token_dtype
    tokenizer = load_tokenizer("builtin")
    spec = DataSpec(name=str(corpus / "part-*.parquet"), streaming=True, shuffle_buffer=BLOCK, val_fraction=0.0)
    train, _ = stream_sources(spec)
    spec = with_streams(spec, train, B)
    Q = default_read_ahead_steps([spec], B)
    T = seq_len + 1
    R = len(streaming.streams_of_slots(*streaming.rank_slots(0, dp, B), B, spec.streams))
    one_unit = train.reader.text_array(train.units[0]) if hasattr(train.reader, "text_array") else \
        train.reader.texts(train.units[0])
    U = unit_text_bytes(one_unit)
    chunk = int(train.units[0].stop - train.units[0].start)
    del one_unit

    def opened(stream, state):
        return streaming.stream_windows(train, tokenizer, seq_len, 0, True, BLOCK, stream, spec.streams, state)

    sampler = PeakRSS()
    base, cpu0, wall0 = rss_bytes(), time.process_time(), time.perf_counter()
    batches = streaming.StreamingBatches(opened, spec.streams, B, MICRO, 0, dp, 0, {}, read_ahead_steps=Q)
    next(batches)
    first_wall, first_cpu, first_rss = time.perf_counter() - wall0, time.process_time() - cpu0, rss_bytes() - base
    launch = time.perf_counter() - STARTED
    per_step = B // dp // MICRO
    for _ in range(per_step - 1):  # the first step's other micro-batches
        next(batches)
    first_step = time.perf_counter() - wall0
    for _ in range((steps - 1) * per_step):  # the queue fills, the blocks refill once
        next(batches)
    batches.close()
    peak = sampler.stop() - base
    predicted = rank_memory_bytes(streams=R, block=BLOCK, window=T, token_bytes=token_dtype(len(tokenizer)).itemsize,
                                  unit_bytes=U, read_ahead_windows=Q * B // dp, chunk_bytes=chunk)
    return {"dp": dp, "streams": R, "old": old or "", "first_s": first_wall, "first_cpu_s": first_cpu,
            "launch_s": launch, "step_s": first_step,
            "first_rss": first_rss, "peak_rss": peak, "predicted": predicted, "unit_bytes": U, "Q": Q}


def measure(corpus: Path, B: int, dp: int, old: str = "", steps: int = 2 * BLOCK, seq_len: int = SEQ_LEN,
            env: Optional[Dict[str, str]] = None) -> dict:
    """`child`'s measurements of dp rank 0, in a process of its own (`env` added to its environment)."""
    out = subprocess.run([sys.executable, __file__, "--child", str(corpus), "--global-batch", str(B),
                          "--dps", str(dp), "--old", old, "--steps", str(steps), "--seq-len", str(seq_len)],
                         cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    if out.returncode != 0:
        sys.exit(f"dp {dp}{' (old)' if old else ''} failed: {out.stderr.strip().splitlines()[-1]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--dps", default="1,8", help="dp sizes, comma-separated (rank 0 of each)")
    parser.add_argument("--corpus", default="", help="a directory to write the corpus in, or reuse (default: temporary)")
    parser.add_argument("--old", default="", help="a commit whose data/streaming.py runs the same ranks too")
    parser.add_argument("--steps", type=int, default=2 * BLOCK, help="steps drawn (default: 2 blocks)")
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN)
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    try:
        args.dps = [int(d) for d in args.dps.split(",")]
    except ValueError:
        parser.error(f"--dps {args.dps} must be integers, comma-separated")
    bad = [d for d in args.dps if d < 1 or args.global_batch % d]
    if bad or args.global_batch < 1 or args.steps < 1 or args.seq_len < 1:
        parser.error(f"--dps {bad} must divide --global-batch {args.global_batch} (and --steps be >= 1)")
    return args


def main() -> None:
    args = parse_args()
    if args.child:
        print(json.dumps(child(Path(args.child), args.global_batch, args.dps[0], args.old, args.seq_len, args.steps)))
        return
    corpus = write_corpus(Path(args.corpus or tempfile.mkdtemp(prefix="first-batch-")), args.global_batch)
    rows = [measure(corpus, args.global_batch, dp, old, args.steps, args.seq_len)
            for old in ([args.old, ""] if args.old else [""]) for dp in args.dps]
    mib = 2 ** 20
    print(f"B {args.global_batch}, T {args.seq_len + 1}, block {BLOCK}, FineWeb-like units of {DOCS_PER_GROUP} docs; "
          f"U (one unit's texts as a stream holds them) {rows[-1]['unit_bytes'] / mib:.1f} MiB")
    print(f"{'code':>8} {'dp':>3} {'streams':>7} {'launch s':>8} {'first s':>8} {'first CPU-s':>11} {'step 1 s':>8} "
          f"{'RSS first MiB':>13} "
          f"{'RSS peak MiB':>12} {'formula MiB':>11} {'peak/formula':>12}")
    for r in rows:
        print(f"{r['old'][:8] or 'now':>8} {r['dp']:>3} {r['streams']:>7} {r['launch_s']:>8.2f} {r['first_s']:>8.2f} {r['first_cpu_s']:>11.2f} "
              f"{r['step_s']:>8.2f} "
              f"{r['first_rss'] / mib:>13.0f} {r['peak_rss'] / mib:>12.0f} " +
              (f"{'-':>11} {'-':>12}" if r["old"] else  # the formula is of the code as it is
               f"{r['predicted'] / mib:>11.0f} {r['peak_rss'] / r['predicted']:>12.2f}"))
    now = {r["dp"]: r for r in rows if not r["old"]}
    if 1 in now and 8 in now:
        print(f"dp 1 / dp 8: launch to first batch {now[1]['launch_s'] / now[8]['launch_s']:.2f}x; "
              f"first batch {now[1]['first_s'] / now[8]['first_s']:.2f}x wall, "
              f"{now[1]['first_cpu_s'] / now[8]['first_cpu_s']:.2f}x CPU; whole first step "
              f"{now[1]['step_s'] / now[8]['step_s']:.2f}x (8x the windows); peak RSS "
              f"{now[1]['peak_rss'] / now[8]['peak_rss']:.2f}x")


if __name__ == "__main__":
    main()
