"""Muon's Newton-Schulz under TP: each matrix finished on one TP peer (launch/optim/muon_tp_owners.py)
against the all-gather on which every peer orthogonalises every matrix, on the
same shards in the same processes, alternating.

    python bench/optim/muon_tp_step.py [--tp 4] [--hidden 768] [--blocks 2] [--repeats 5]

Each of `tp` gloo processes (one thread each) holds its TP shards of `blocks` GPT-2 blocks' Muon
matrices (c_attn [Q; K; V] by stride 3, the attention projection, c_fc, c_proj), cut as the model's
layers cut them. It prints the median seconds of one step's updates both ways, their ratio, and
the largest difference between the two updates (the same numbers: one whole matrix, one NS)."""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from launch.engine.distributed import free_port
from launch.optim.muon_matrices import MatrixLayout, assemble, local_part
from launch.optim.muon_tp_owners import finished_updates
from launch.optim.newton_schulz import orthogonalise, update_scale


def _update(part: torch.Tensor) -> torch.Tensor:
    return orthogonalise(part) * update_scale(*part.shape[-2:])


def _shards(hidden: int, blocks: int, tp: int, rank: int):
    """This rank's shards and layouts: GPT-2's column-parallel c_attn and c_fc (rows split),
    row-parallel attention projection and c_proj (columns split)."""
    from model.parallel.layers import split_rows
    generator = torch.Generator().manual_seed(0)
    shards, layouts = [], []
    for _ in range(blocks):
        for rows, cols, dim, parts in [(3 * hidden, hidden, 0, (hidden,) * 3), (hidden, hidden, 1, (hidden,)),
                                       (4 * hidden, hidden, 0, (4 * hidden,)), (hidden, 4 * hidden, 1, (4 * hidden,))]:
            full = torch.randn(rows, cols, generator=generator)
            shard = split_rows(full.movedim(dim, 0), rank, tp, sections=parts).movedim(0, dim).contiguous()
            shards.append(shard)
            layouts.append(MatrixLayout(partition_dim=dim, parts=parts, tp_size=tp, experts=False))
    return shards, layouts


def _rank(rank: int, tp: int, port: int, hidden: int, blocks: int, repeats: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=tp)
    shards, layouts = _shards(hidden, blocks, tp, rank)

    def every_peer():  # the all-gather it replaced: each peer assembles and orthogonalises every matrix
        updates = []
        for shard, layout in zip(shards, layouts):
            gathered = [torch.empty_like(shard) for _ in range(tp)]
            dist.all_gather(gathered, shard)
            updates.append(local_part([_update(part) for part in assemble(gathered, layout)], layout, rank))
        return updates

    def finishers():
        return finished_updates(shards, layouts, _update, None, rank)
    times = {"every peer": [], "finishers": []}
    for _ in range(repeats):
        for name, fn in (("every peer", every_peer), ("finishers", finishers)):
            dist.barrier()
            start = time.perf_counter()
            fn()
            dist.barrier()
            times[name].append(time.perf_counter() - start)
    difference = max((a - b).abs().max().item() for a, b in zip(every_peer(), finishers()))
    if rank == 0:
        results.put({name: statistics.median(t) for name, t in times.items()} | {"difference": difference})
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    ranks = [context.Process(target=_rank, args=(r, args.tp, port, args.hidden, args.blocks, args.repeats, results))
             for r in range(args.tp)]
    for process in ranks:
        process.start()
    result = results.get(timeout=1800)
    for process in ranks:
        process.join()
    print(f"tp {args.tp}, {args.blocks} GPT-2 blocks of hidden {args.hidden} ({4 * args.blocks} Muon parameters), "
          f"one thread per process, median of {args.repeats}:")
    print(f"  every peer orthogonalises every matrix: {result['every peer']:.3f} s")
    print(f"  one finisher per matrix:                 {result['finishers']:.3f} s")
    print(f"  finishers / every peer: {result['finishers'] / result['every peer']:.2f}; "
          f"largest difference between the updates: {result['difference']:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
