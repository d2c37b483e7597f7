"""A 1,024-rank job dealt in one process, without torch.distributed.

Every rank's coordinates come from DeepSpeed's own topology, the reading rank of each replica
from launch/feed/replica_reader.py, its slots of the batch and its streams from
data/streaming.py, and each stream's units from the epoch's permutation: the code a real rank
runs, for 1,024 of them. Checked at dp = 1, 8, 64, 1,024 (as many as the recipe's batch allows)
with the GPU recipes' streams:
- every unit of an epoch is read by exactly one rank of the job (a fixed 16 streams fails this);
- at tp, pp, cp and dp layouts, the ranks the training loop's own wiring (replica_reader_groups)
  lets read deal each unit once, the others in a group with their replica's reader;
- a rank reading a real corpus holds what its own streams need, not every stream's
  (tests/data/test_stream_memory.py checks docs/data.md's formula against a process's RSS).
"""
import tracemalloc
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from data.builtin import load_tokenizer
from data.prepare_source import stream_sources, with_streams
from data.spec import DataSpec
from data.streaming import (StreamingBatches, default_streams, rank_slots, stream_units, stream_windows,
                            streams_of_slots)
from data.tokens import document_tokens
from helpers.stream_corpus import write_corpus
from launch.config.recipe import load_recipe
from launch.feed.replica_reader import replica_reader_groups, replica_readers
from model.parallel.state import ParallelState, build_topology

WORLD = 1024
STREAM_STATE_BYTES = 4096  # docs/data.md: a stream's own state (generators, its carry, positions), about 3 KiB
N_UNITS = 20_000  # FineWeb-Edu's sample-10BT is ~15k row groups
GPU_RECIPES = [p for p in sorted((Path(__file__).parents[2] / "recipes").glob("*.yaml"))
               if load_recipe(p, []).data.streaming]


def reads_per_unit(global_batch: int, n_streams: int, tp: int, pp: int, dp: int, cp: int) -> np.ndarray:
    """How many ranks of a job of tp x pp x dp x cp ranks read each unit in epoch 0."""
    topology = build_topology(tp, pp, dp, cp)
    readers = {reader for reader, _ in replica_readers(topology, tp, pp, dp, cp)}
    reads = np.zeros(N_UNITS, dtype=np.int64)
    # DeepSpeed's own coordinates, inverted once: its get_coord searches them all for each rank.
    coords = {rank: coord for coord, rank in topology.mapping.items()}
    for rank in range(topology.world_size()):
        coord = coords[rank]
        if rank not in readers or coord.pipe != 0:
            continue  # it receives its replica's micro-batches, or (a middle stage) draws none
        lo, hi = rank_slots(coord.data // cp, dp, global_batch)
        for stream in streams_of_slots(lo, hi, global_batch, n_streams):
            reads[stream_units(N_UNITS, stream, n_streams, 1234, 0, True)] += 1
    return reads


@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=lambda p: p.stem)
def test_every_unit_is_read_by_exactly_one_rank_of_1024(recipe):
    config = load_recipe(recipe, [])
    B = config.train.global_batch_size
    S = config.data.streams or default_streams(B, N_UNITS)
    for dp in (d for d in (1, 8, 64, 1024) if B % d == 0):
        cp = 2 if WORLD // dp >= 4 else 1  # a context-parallel pair where the layout has room
        tp, pp = max(1, WORLD // dp // cp // 4), min(4, WORLD // dp // cp)
        assert tp * pp * dp * cp == WORLD, (tp, pp, dp, cp)
        reads = reads_per_unit(B, S, tp, pp, dp, cp)
        assert (reads == 1).all(), (recipe.stem, dp, Counter(reads.tolist()))


def test_the_old_sixteen_streams_read_units_many_times_at_64_replicas():
    """The same dealing with the recipes' old 16 streams at dp 64: each stream's units read by 4
    replicas (the check above would fail), and at dp 1,024 by 64."""
    assert Counter(reads_per_unit(1024, 16, 4, 2, 64, 2).tolist()) == {4: N_UNITS}
    assert Counter(reads_per_unit(1024, 16, 1, 1, 1024, 1).tolist()) == {64: N_UNITS}


@pytest.mark.parametrize("tp,pp,dp,cp", [(2, 1, 2, 1), (1, 2, 2, 1), (1, 1, 2, 2), (2, 3, 2, 2), (1, 4, 4, 1)])
def test_the_runtime_wiring_lets_one_rank_of_each_replica_read(tp, pp, dp, cp, monkeypatch):
    """The rule the training loop runs, replica_reader_groups, asked on every rank of the job with
    its groups recorded instead of created: of the ranks that draw micro-batches (the first and the
    last stage, DeepSpeed's pipeline), the ones it lets read deal every unit of an epoch exactly
    once, and every other drawing rank shares a broadcast group with its replica's reader. Were
    every drawing rank to read, units would be read tp x cp x (2 at pp > 1) times."""
    import torch.distributed as dist
    monkeypatch.setattr(dist, "new_group", lambda ranks: tuple(ranks))
    topology, B, n_units = build_topology(tp, pp, dp, cp), 16, 64
    reads, n_streams = np.zeros(n_units, dtype=np.int64), default_streams(B, n_units)
    for rank in range(topology.world_size()):
        coord = topology.get_coord(rank)
        if coord.pipe not in (0, pp - 1):
            continue  # a middle stage draws no micro-batch
        state = ParallelState(topology=topology, global_rank=rank, tp_size=tp, pp_size=pp, dp_size=dp,
                              tp_rank=coord.model, pp_rank=coord.pipe, dp_rank=coord.data // cp, tp_group=None,
                              cp_size=cp, cp_rank=coord.data % cp)
        groups, reading = replica_reader_groups(state, streamed=True)
        if not reading:
            reader = min(r for r in range(topology.world_size()) if topology.get_coord(r).pipe == 0
                         and topology.get_coord(r).data // cp == coord.data // cp)
            assert any(reader in group and rank in group for group in groups), (rank, groups)
            continue
        lo, hi = rank_slots(coord.data // cp, dp, B)
        for stream in streams_of_slots(lo, hi, B, n_streams):
            reads[stream_units(n_units, stream, n_streams, 1234, 0, True)] += 1
    assert (reads == 1).all(), Counter(reads.tolist())


def _held_by_one_unit(source, unit, tokenizer) -> int:
    """Bytes of a unit's decoded texts and its tokens as the tokenizer gives them, measured alone."""
    tracemalloc.start()
    texts = source.reader.texts(unit)
    ids = document_tokens(texts, tokenizer)
    held = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    del texts, ids
    return held


def test_a_rank_of_64_holds_within_the_documented_bound(tmp_path, stream_cache, monkeypatch):
    """One rank of dp 64 at B = 1,024 and the default streams reads 16 of the 1,024 streams over a
    real parquet corpus: tracemalloc's peak while it draws steps (its shuffle blocks filled and
    refilled; Python's and numpy's allocations, not Arrow's) stays within R x (shuffle_buffer x T
    x 8 B + U + a unit's tokens + 4 KiB), R its streams, U + tokens the most one unit's texts and
    tokens take as Python objects (measured alone), read inline, one stream after another (the
    pool that opens them together adds thread objects and 16 tokenizer batches at once, which
    this count of units of 2 documents would not hold; tests/data/test_stream_memory.py measures
    the whole against a process's RSS). A rank that opened every stream, as ranks sharing streams
    did, holds 64x that."""
    B, dp, rank, seq_len, block = 1024, 64, 5, 31, 4
    corpus = write_corpus(tmp_path / "corpus", 4096, 8, group_rows=2)  # 2,048 row groups of 2 documents
    tokenizer = load_tokenizer("builtin")
    spec = DataSpec(name=str(corpus / "part*.parquet"), streaming=True, shuffle_buffer=block)
    train, _ = stream_sources(spec)
    spec = with_streams(spec, train, B)
    T, R = seq_len + 1, len(streams_of_slots(*rank_slots(rank, dp, B), B, B))
    unit = max(_held_by_one_unit(train, train.units[i], tokenizer) for i in range(0, len(train.units), 8))
    bound = R * (block * T * 8 + unit + STREAM_STATE_BYTES)

    def opened(stream, state):
        return stream_windows(train, tokenizer, seq_len, 0, True, block, stream, spec.streams, state)

    monkeypatch.setattr("data.streaming.OPEN_THREADS", 1)
    tracemalloc.start()
    batches = StreamingBatches(opened, spec.streams, B, 4, rank, dp, 0, {}, read_ahead_steps=0)
    for _ in range(2 * block * (B // dp) // 4):  # two refills of every block, in micro-batches of 4
        next(batches)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert spec.streams == B and R == B // dp and sorted(batches.states) == list(range(rank * R, (rank + 1) * R))
    assert peak <= bound, (peak, bound, R, unit)
