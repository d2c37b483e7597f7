"""Activation bytes one block saves for backward per rank at context parallelism cp = 1, 2, 4
(Ulysses): real CP blocks on cp gloo processes, each holding s/cp tokens of every
sequence, measured exactly as bench/memory/activation_memory.py measures (the distinct storages autograd
saves, parameters excluded), against the planner's count (memory_formulas.model_activation_bytes_per_layer
with cp; fp32, dropout 0, so SDPA's fused kernel: no s x s scores).

    python bench/memory/context_memory.py [--seq-len 1024 --batch 2 --cp 1,2,4]"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.memory.activation_memory import saved_activation_bytes
from launch.analysis import memory_formulas
from launch.engine.distributed import free_port
from model.config import GPTConfig

HIDDEN, HEADS = 64, 8


def configs(seq_len: int):
    """(name, config, selective recompute) of the blocks measured."""
    gpt2 = GPTConfig(n_layer=2, n_head=HEADS, n_embd=HIDDEN, seq_len=seq_len, vocab_size=64, dropout=0.0)
    llama = GPTConfig(arch="llama", n_layer=2, n_head=HEADS, n_kv_head=2, n_embd=HIDDEN, ffn_hidden_size=176,
                      seq_len=seq_len, vocab_size=64, dropout=0.0)
    return [("gpt2", gpt2, False), ("gpt2 selective", gpt2, True), ("llama gqa kv 2", llama, False)]


def measure_this_rank(seq_len: int, batch: int) -> dict:
    """{block name: bytes saved} on this rank of a gloo group of cp = world size processes (joined
    already: the bench's spawned ranks, or a test's forked ones)."""
    from model.transformer.block import Block
    cp = dist.get_world_size()
    group = dist.new_group(list(range(cp))) if cp > 1 else None
    measured = {}
    for name, config, selective in configs(seq_len):
        config = GPTConfig(**{**config.__dict__, "recompute_attention": selective})
        block = Block(config, 0, None, cp_group=group).train()
        x = torch.randn(batch, seq_len // cp, HIDDEN, requires_grad=True)  # this rank's shard
        measured[name] = saved_activation_bytes(lambda: block(x), block.parameters())
    return measured


def _rank(rank: int, cp: int, port: int, seq_len: int, batch: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=cp)
    torch.set_num_threads(1)
    results[rank] = measure_this_rank(seq_len, batch)
    dist.destroy_process_group()


def measure(cp: int, seq_len: int, batch: int) -> dict:
    """{block name: [bytes saved on each CP rank]}."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(cp, free_port(), seq_len, batch, results), nprocs=cp)
        per_rank = [results[r] for r in range(cp)]
    return {name: [r[name] for r in per_rank] for name in per_rank[0]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--cp", default="1,2,4", help="comma-separated CP degrees (each a divisor of 8 heads)")
    args = p.parse_args(argv)
    cps = [int(c) for c in args.cp.split(",")]
    bad = [c for c in cps if c < 1 or HEADS % c or args.seq_len % c]
    if bad or args.batch < 1:
        print(f"error: --cp {bad[0] if bad else cps} must divide {HEADS} heads and --seq-len {args.seq_len}, "
              f"and --batch {args.batch} must be >= 1", file=sys.stderr)
        return 2
    print(f"Activation bytes saved per block per rank: s={args.seq_len} b={args.batch} h={HIDDEN} a={HEADS}, "
          f"fp32, dropout 0")
    print(f"{'block':>16} {'cp':>3} | {'measured (max rank)':>19} {'x cp=1':>7} | {'planner':>10} {'measured/planner':>16}")
    base = {}
    for cp in cps:
        for name, bytes_per_rank in measure(cp, args.seq_len, args.batch).items():
            config, selective = next((c, s) for n, c, s in configs(args.seq_len) if n == name)
            planned = memory_formulas.model_activation_bytes_per_layer(
                config, args.seq_len, args.batch, selective=selective, element_bytes=4, mask_bytes=0,
                layernorm_stat_bytes=4, fused_attention=True, cp=cp)
            n = max(bytes_per_rank)
            base.setdefault(name, n)
            print(f"{name:>16} {cp:>3} | {n:>19,} {n / base[name]:>7.3f} | {planned:>10,.0f} {n / planned:>16.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
