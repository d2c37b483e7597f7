"""Host memory of a re-sharded resume (launch/checkpoints/reshard.py) on CPU, against the sizes that bound it.

Saves a mid-size model (default 8 layers, hidden 768, builtin 4096-token vocabulary: 61M
parameters) at tp=1 pp=2 through `deepspeed launch/train.py`, then, in one process (tp=pp=dp=1,
so every saved stage is read and every parameter re-sharded), builds the engine as a run does
and times `load_resharded` while a thread samples /proc/self/status every 2 ms. It prints the
increase over the RSS before the load, less the engine's own Adam moments (which any run's
first step allocates), of: anonymous memory (what a re-shard allocates; the kernel cannot drop
it) and all resident memory (also the pages of the memory-mapped checkpoint files that were
read, which the kernel can drop), each against two yardsticks: the largest parameter's fp32
weight and two Adam moments, and the whole model's.

    python bench/memory/reshard_memory.py [--layers 8 --hidden 768]
"""
import argparse
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench import REPO
from launch.engine.distributed import ensure_single_process_env, launcher_command


TINY = REPO / "recipes" / "tiny.yaml"


def rss_kib() -> dict:
    """{'RssAnon': KiB, 'RssFile': KiB, ...} of this process."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Rss"):
            key, value = line.split(":")
            out[key] = int(value.split()[0])
    return out


class PeakSampler(threading.Thread):
    """Samples RssAnon and RssAnon + RssFile until stopped; keeps the maxima."""

    def __init__(self):
        super().__init__(daemon=True)
        self.stop, self.peak_anon, self.peak_total = threading.Event(), 0, 0

    def run(self):
        while not self.stop.is_set():
            rss = rss_kib()
            self.peak_anon = max(self.peak_anon, rss["RssAnon"])
            self.peak_total = max(self.peak_total, rss["RssAnon"] + rss["RssFile"])
            time.sleep(0.002)


def save_checkpoint(args, root: Path) -> Path:
    cmd = launcher_command(2, REPO / "launch" / "train.py") + [
        "--recipe", str(TINY), "--pp", "2", "--steps", "1",
        "--set", f"model.n_layer={args.layers}", "--set", f"model.n_embd={args.hidden}",
        "--set", "model.n_head=8", "--set", "train.eval_every=0", "--save", str(root)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"saving failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return root / "step00000001"


def measure(ckpt: Path) -> dict:
    import json

    import torch

    from launch.checkpoints.reshard import load_resharded
    from launch.config.layout import check_and_derive_layout
    from launch.config.recipe import load_recipe
    from launch.engine.distributed import init_distributed
    from launch.engine.engine import build_engine
    from model.parallel.state import init_parallel_state

    meta = json.loads((ckpt / "complete.json").read_text())
    model = meta["recipe"]["model"]
    overrides = [f"model.{k}={v}" for k, v in model.items() if k in ("n_layer", "n_embd", "n_head")]
    recipe = load_recipe(TINY, overrides + [f"train.steps={meta['recipe']['train']['steps']}", "train.eval_every=0"])
    ensure_single_process_env()
    init_distributed(600, dist_backend="gloo", verbose=False)
    layout = check_and_derive_layout(recipe, 1, 1, 1, on_cpu=True)
    state = init_parallel_state(1, 1)
    config = recipe.gpt_config(model["vocab_size"])
    engine, _ = build_engine(recipe, layout, state, config)
    params = {n: p.numel() for n, p in engine.module.named_parameters()}
    before = rss_kib()
    sampler = PeakSampler()
    sampler.start()
    start = time.perf_counter()
    load_resharded(engine, ckpt, meta["layout"], state, config, config.vocab_size,
                   config.padded_vocab_size(1))
    seconds = time.perf_counter() - start
    sampler.stop.set()
    sampler.join()
    state_bytes = 12  # fp32 weight + exp_avg + exp_avg_sq
    return {"anon": (sampler.peak_anon - before["RssAnon"]) * 1024,
            "total": (sampler.peak_total - before["RssAnon"] - before["RssFile"]) * 1024,
            "largest": max(params.values()) * state_bytes, "model": sum(params.values()) * state_bytes,
            "params": sum(params.values()), "seconds": seconds, "dtype": str(torch.get_default_dtype())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=768)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = save_checkpoint(args, Path(tmp) / "ck")
        r = measure(ckpt)
    mib = 2 ** 20
    print(f"re-sharded resume of a pp=2 checkpoint at tp=pp=dp=1: {r['params'] / 1e6:.1f}M parameters, "
          f"load {r['seconds']:.1f} s")
    print(f"yardsticks (fp32 weight + 2 Adam moments): largest parameter {r['largest'] / mib:.1f} MiB, "
          f"whole model {r['model'] / mib:.1f} MiB")
    # The engine's own Adam moments (8 bytes per parameter) come into being during the load,
    # as they would in the first optimizer step of any run: not re-sharding's cost.
    moments = r["params"] * 8
    print(f"of which the engine's own Adam moments, allocated by any first step: {moments / mib:.1f} MiB")
    for key, what in (("anon", "anonymous"), ("total", "resident (anonymous + mapped file pages)")):
        extra = r[key] - moments
        print(f"peak {what} increase beyond them: {extra / mib:8.1f} MiB = {extra / r['largest']:5.2f} x "
              f"largest parameter = {extra / r['model']:.2f} x model")
    return 0


if __name__ == "__main__":
    sys.exit(main())
