"""Activation bytes one transformer block saves for backward, per TP rank, against Korthikanti
et al. 2022 ("K22"): tp = 1, 2, 4 (gloo processes), with and without sequence parallelism,
with no, selective and full recompute. Measured exactly: the distinct storages autograd saves
(`saved_tensors_hooks`), parameters excluded; K22's count with fp32 bytes must equal it to the
byte (method and results: docs/performance.md, "Activation memory").

    python bench/memory/activation_memory.py [--seq-len 128 --batch 2 --hidden 64 --heads 8 --dropout 0.1]
                                             [--tp 1,2,4]"""
import argparse
import os
import sys
from typing import Callable, Dict, Iterable, Tuple

import torch

MODES = ("none", "selective", "full")


def saved_activation_bytes(forward: Callable[[], torch.Tensor], parameters: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd saves while `forward()` runs, parameters excluded."""
    excluded = {p.untyped_storage().data_ptr() for p in parameters}
    storages: Dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in excluded:
            storages[storage.data_ptr()] = storage.nbytes()
        return t  # keeping the tensor alive: no storage can be freed and reused mid-count

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    for t in getattr(out.grad_fn, "deepspeed_saved_tensors", None) or ():  # full recompute's input
        pack(t)
    return sum(storages.values())


def block_saved_bytes(seq_len: int, batch: int, hidden: int, heads: int, dropout: float,
                      sequence_parallel: bool, recompute: str, state) -> int:
    """One Block of model/transformer/block.py on this TP rank, its input a (B, T, h) activation that needs a
    gradient ((B, T/t, h) with sequence parallelism), wrapped as the pipeline wraps it."""
    from deepspeed.runtime.activation_checkpointing import checkpointing

    from model.config import GPTConfig
    from model.transformer.block import Block
    from model.gpt.pipe import seed_dropout_rngs, tp_dropout_rng

    config = GPTConfig(n_layer=1, n_head=heads, n_embd=hidden, seq_len=seq_len, vocab_size=64,
                       dropout=dropout, sequence_parallel=sequence_parallel,
                       recompute_attention=recompute == "selective")
    seed_dropout_rngs(config.seed, state)
    block = Block(config, 0, state.tp_group, tp_dropout_rng)
    local_seq = seq_len // state.tp_size if sequence_parallel else seq_len
    x = torch.randn(batch, local_seq, hidden, requires_grad=True)
    if recompute == "full":  # what PipelineModule(activation_checkpoint_interval=1) runs
        forward = lambda: checkpointing.checkpoint(block, x)  # noqa: E731
    else:
        forward = lambda: block(x)  # noqa: E731
    return saved_activation_bytes(forward, block.parameters())


def _rank_main(rank: int, world: int, port: int, args, results) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from launch.engine.distributed import init_distributed, shut_down_distributed
    from model.parallel.state import init_parallel_state
    init_distributed(600, dist_backend="gloo", verbose=False)
    state = init_parallel_state(world, 1)
    for sp in (False, True):
        for mode in MODES:
            n = block_saved_bytes(args.seq_len, args.batch, args.hidden, args.heads, args.dropout, sp, mode, state)
            if rank == 0:
                results.put((world, sp, mode, n))
    shut_down_distributed()


def measure(args, tp: int) -> Dict[Tuple[int, bool, str], int]:
    import torch.multiprocessing as mp

    from launch.engine.distributed import free_port
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_rank_main, args=(tp, free_port(), args, results), nprocs=tp, start_method="spawn")
    out = {}
    while not results.empty():
        world, sp, mode, n = results.get()
        out[(world, sp, mode)] = n
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--tp", default="1,2,4", help="comma-separated TP sizes")
    args = parser.parse_args(argv)
    tps = [int(t) for t in args.tp.split(",")]
    bad = [t for t in tps if t < 1 or args.heads % t or args.seq_len % t]
    if bad:
        print(f"error: --tp {bad[0]} must divide --heads {args.heads} and --seq-len {args.seq_len}", file=sys.stderr)
        return 2

    from launch.analysis import memory_formulas
    s, b, h, a = args.seq_len, args.batch, args.hidden, args.heads
    sbh = s * b * h
    measured: Dict[Tuple[int, bool, str], int] = {}
    for tp in tps:
        measured.update(measure(args, tp))

    fused = args.dropout == 0  # SDPA takes its fused kernel: no s x s scores, no masks

    def formula(tp: int, sp: bool, mode: str, **dtype) -> float:
        return memory_formulas.activation_bytes_per_layer(s, b, h, a, tp, recompute=mode == "full",
                                            sequence_parallel=sp, selective=mode == "selective",
                                            fused_attention=fused, **dtype)

    fp32 = dict(element_bytes=4, mask_bytes=0 if fused else 4, layernorm_stat_bytes=4)
    print(f"Activation bytes saved for backward per block per TP rank: s={s} b={b} h={h} a={a} "
          f"dropout={args.dropout}, fp32")
    counted = "fused count, fp32" if fused else "K22 count, fp32"
    print(f"{'tp':>3} {'SP':>3} {'recompute':>9} | {'measured':>10} {'/sbh':>7} | {counted:>15} "
          f"{'/sbh':>7} | {'K22 fp16 /sbh':>13}")
    notes = set()
    for (tp, sp, mode), n in sorted(measured.items(), key=lambda kv: (kv[0][0], kv[0][1], MODES.index(kv[0][2]))):
        ours = formula(tp, sp, mode, **fp32)
        mark = ""
        if n != ours:
            # One head per rank: SDPA's math path (taken with dropout) saves V as a view of the
            # fused c_attn output instead of a copy, keeping all of (B, T, 3h/t) alive.
            one_head = a // tp == 1 and mode == "none" and args.dropout > 0 and n - ours == 2 * 4 * sbh / tp
            mark = " *" if one_head else " ?"
            notes.add(mark)
        print(f"{tp:>3} {'on' if sp else 'off':>3} {mode:>9} | {n:>10d} {n / sbh:>7.3f} | {ours:>15.0f} "
              f"{ours / sbh:>7.3f} | {formula(tp, sp, mode) / sbh:>13.3f}{mark}")
    if not notes:
        print("measured = " + ("the fused-attention count (a logsumexp per row and head, no scores or masks)"
                               if fused else "K22's count with fp32 dropout masks") + " with fp32 elements and "
              "LayerNorm statistics, to the byte")
    if " *" in notes:
        print(" * one head per TP rank: SDPA keeps V as a view of the whole (B, T, 3h/t) c_attn output, "
              "+2*4*s*b*h/t bytes; every other term is as counted")
    if " ?" in notes:
        print(" ? measured differs from the fp32 count")

    print("\nRatios (measured vs K22 formula):")
    for tp in tps:
        for mode in MODES:
            m = measured[(tp, True, mode)] / measured[(tp, False, mode)]
            f = formula(tp, True, mode) / formula(tp, False, mode)
            print(f"  tp={tp} recompute={mode:<9}  SP / no SP          measured {m:.3f}   formula {f:.3f}")
        for sp in (False, True):
            for mode in ("selective", "full"):
                m = measured[(tp, sp, mode)] / measured[(tp, sp, "none")]
                f = formula(tp, sp, mode) / formula(tp, sp, "none")
                print(f"  tp={tp} SP {'on ' if sp else 'off'}  {mode:<9} / none     measured {m:.3f}   formula {f:.3f}")
    for sp in (False, True):
        for t in tps[1:]:
            m = measured[(t, sp, "none")] / measured[(tps[0], sp, "none")]
            f = formula(t, sp, "none") / formula(tps[0], sp, "none")
            print(f"  SP {'on ' if sp else 'off'} tp={t} / tp={tps[0]} (recompute none)   measured {m:.3f}   formula {f:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
