"""How long a checkpoint save blocks training: train.async_save (launch/checkpoints/async_save.py)
against the synchronous save, at GPT-2 124M scale on CPU (docs/performance.md, "Asynchronous saves").

--procs N processes (gloo, forked here) build the training engine of recipes/gpt2-124m.yaml at pp=N
(tp = dp = 1; bf16 with ZeRO-1, as the recipe; sequences of --seq-len tokens and N micro-batches of
1 per step: a step's length does not change what a save writes), train a step, then --rounds times:
a synchronous save (blocked: its whole time), a step, an asynchronous save (blocked: until it returns,
plus what the next step's optimizer step waits for the snapshot's copies), a step while the copies
and the write run, then the wait for that write, which a save after the next step would block for
(added in `ratio_saving_every_step`; a longer save interval hides it). Each time is the slowest rank's;
reported are the medians over the rounds, their ratio, the background write and the snapshot's host
bytes against the planner's term (launch/analysis/memory_formulas.py: checkpoint_snapshot_bytes).
Target: asynchronous blocked <= 0.2 x synchronous.

    python bench/checkpoints/async_save.py [--procs 1 4] [--rounds 2] [--seq-len 64] [--json]
"""
import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from bench import REPO
from launch.engine.distributed import free_port

RECIPE = REPO / "recipes" / "gpt2-124m.yaml"


def _rank(rank: int, world: int, port: int, seq_len: int, rounds: int, out: Path, root: Path) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    import torch.distributed as dist

    from launch.analysis.memory_formulas import checkpoint_snapshot_bytes
    from launch.checkpoints import store
    from launch.checkpoints.async_save import AsyncSaver
    from launch.config.layout import check_and_derive_layout
    from launch.config.recipe import load_recipe
    from launch.engine.distributed import init_distributed
    from launch.engine.engine import build_engine
    from launch.feed.run_inputs import resolved_recipe_dict
    from model.parallel.state import init_parallel_state

    init_distributed(3600, dist_backend="gloo", verbose=False)
    recipe = load_recipe(RECIPE, [f"model.seq_len={seq_len}", "train.micro_batch_size=1",
                                  f"train.global_batch_size={world}"])
    layout = check_and_derive_layout(recipe, world, 1, world, True)
    state = init_parallel_state(1, world)
    config = recipe.gpt_config(recipe.model.vocab_size)
    engine, _ = build_engine(recipe, layout, state, config)
    tokens = torch.randint(0, recipe.model.vocab_size, (world, 1, seq_len + 1),
                           generator=torch.Generator().manual_seed(0))

    def step():
        engine.train_batch(iter([(t[:, :-1], t[:, 1:]) for t in tokens]))

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def timed(fn) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        return slowest(time.perf_counter() - start)

    def remove(tag_root: Path) -> None:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(tag_root, ignore_errors=True)
        dist.barrier()

    saved = (resolved_recipe_dict(recipe, recipe.model.vocab_size), vars(layout), 0)
    saver, rows = AsyncSaver(), []
    step()
    for r in range(rounds):
        sync_s = timed(lambda: store.save(engine, root / f"sync{r}", 1, 1, *saved, is_writer=rank == 0))
        remove(root / f"sync{r}")
        step()
        snapshot_s = timed(lambda: store.save(engine, root / f"async{r}", 1, 1, *saved, is_writer=rank == 0,
                                              saver=saver))
        start = time.perf_counter()
        step()  # trains while the snapshot is written
        step_s = slowest(time.perf_counter() - start)
        gated_s = slowest(saver.gated_s)
        wait_s = timed(saver.wait)
        assert (root / f"async{r}" / "latest").read_text() == "step00000001"
        rows.append({"sync_s": sync_s, "snapshot_s": snapshot_s, "gated_s": gated_s, "wait_s": wait_s,
                     "step_s": step_s, "write_s": slowest(saver.write_s)})
        remove(root / f"async{r}")
    local = sum(p.numel() for p in engine.module.parameters())
    measured = torch.tensor([saver.snapshot.bytes], dtype=torch.float64)
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)
    planned = torch.tensor([checkpoint_snapshot_bytes(local, 1, recipe.train.zero_stage, 2)], dtype=torch.float64)
    dist.all_reduce(planned, op=dist.ReduceOp.MAX)
    if rank == 0:
        med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
        blocked = med["snapshot_s"] + med["gated_s"]
        every_step = blocked + med["wait_s"]
        out.write_text(json.dumps(dict(med, procs=world, layout=f"tp1 pp{world} dp1", seq_len=seq_len,
                                       async_blocked_s=blocked, ratio=blocked / med["sync_s"],
                                       ratio_saving_every_step=every_step / med["sync_s"],
                                       snapshot_bytes=measured.item(), planned_bytes=planned.item(), rounds=rows)))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--dir", type=Path, default=None,
                        help="where the checkpoints go (default: a temporary directory)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = []
    for procs in args.procs:
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            out = Path(tmp) / "result.json"
            mp.spawn(_rank, args=(procs, free_port(), args.seq_len, args.rounds, out, Path(tmp) / "ck"), nprocs=procs)
            results.append(json.loads(out.read_text()))
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print(f"{'procs':>5} {'layout':>12} {'sync s':>7} {'async blocked s':>15} {'ratio':>6} {'every step':>10} "
          f"{'write s':>7} {'snapshot GB':>11} {'planned GB':>10}")
    for r in results:
        print(f"{r['procs']:>5} {r['layout']:>12} {r['sync_s']:>7.2f} {r['async_blocked_s']:>15.2f} {r['ratio']:>6.2f} "
              f"{r['ratio_saving_every_step']:>10.2f} {r['write_s']:>7.2f} {r['snapshot_bytes'] / 1e9:>11.2f} "
              f"{r['planned_bytes'] / 1e9:>10.2f}")


if __name__ == "__main__":
    main()
