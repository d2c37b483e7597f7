"""Tokens/s, TFLOP/s and MFU of the GPT-2 124M, 350M and 1.3B recipes on one GPU, in bf16
(and of any other recipe named by --recipes: bench/gpu/gpu_check.py adds llama3.2-1b).

    python bench/gpu/gpu_mfu.py                  # one NVIDIA GPU, no network, under 5 minutes
    python bench/gpu/gpu_mfu.py --json           # last line: one JSON object with every number
    python bench/gpu/gpu_mfu.py --tiny           # the same path at toy sizes (CPU: the test)

Each recipe trains through the real path (`launch/train.py` in its own process, tp=pp=dp=1,
ZeRO-1, bf16) on the embedded corpus and tokenizer with the GPT-2 vocabulary kept, so nothing is
downloaded and the FLOPs are real GPT-2 training's. After `--warmup` steps the table shows the
median step's own metrics (model TFLOP/s by launch/analysis/formulas.py, MFU against the dense
bf16 peak; GPT3D_PEAK_TFLOPS for unknown devices). Details: docs/gpu-check.md, "The GPU MFU benchmark alone"."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import REPO

RECIPES = ("gpt2-124m", "gpt2-350m", "gpt2-1.3b")
# Micro-batches per step for each recipe, with the recipe's micro-batch size (16, 8, 8): big
# enough steps (64k, 64k, 32k tokens) to time, small enough for 30 of them in well under a minute.
# llama3.2-1b (bench/gpu/gpu_check.py): 8 x 4 samples of 2048 tokens, 64k tokens as well.
ACCUM = {"gpt2-124m": 4, "gpt2-350m": 8, "gpt2-1.3b": 4, "llama3.2-1b": 4}
OFFLINE = ["data.name=builtin", "data.config=null", "data.revision=null", "data.tokenizer=builtin", "data.streaming=false",
           "data.val_fraction=0.0", "train.eval_every=0", "wandb.mode=disabled"]
# --tiny: every recipe shrunk to a toy (2 blocks of 64, 32 tokens) that runs in seconds on CPU,
# still bf16, still the GPT-2 vocabulary.
TINY = ["model.n_layer=2", "model.n_head=4", "model.n_embd=64", "model.seq_len=32", "train.micro_batch_size=2"]
# A Llama recipe keeps its key/value heads (8 for llama3.2-1b), so its toy has 8 query heads of 8,
# and its SwiGLU width: launch/plan.py --recipe then plans the very model the toy run builds.
TINY_LLAMA = ["model.n_head=8" if item.startswith("model.n_head=") else item for item in TINY]
BUDGET_S = 300


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated names under recipes/")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per recipe (default %(default)s)")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the median (default %(default)s)")
    p.add_argument("--accum", type=int, help="micro-batches per step for every recipe (default: 4, 8, 4)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="extra recipe override for every recipe, e.g. train.recompute=full")
    p.add_argument("--tiny", action="store_true", help="toy sizes: checks the script on CPU in seconds")
    p.add_argument("--timeout-s", type=int, default=600, help="per recipe (default %(default)s)")
    p.add_argument("--json", action="store_true", help="last line: one JSON object with the results")
    args = p.parse_args(argv)
    if args.steps <= args.warmup or args.warmup < 1:
        p.error(f"--steps {args.steps} must exceed --warmup {args.warmup} >= 1")
    return args


def recipe_overrides(name: str, args: argparse.Namespace, micro_batch: int, arch: str = "gpt2") -> list:
    """The --set list of one recipe's run: offline data, the step size, --tiny, the user's."""
    accum = args.accum or (2 if args.tiny else ACCUM.get(name, 4))
    sets = OFFLINE + ((TINY_LLAMA if arch == "llama" else TINY) if args.tiny else [])
    micro = 2 if args.tiny else micro_batch
    return sets + [f"train.global_batch_size={micro * accum}"] + args.overrides


def run_recipe(name: str, args: argparse.Namespace, workdir: Path) -> dict:
    """Train one recipe in a fresh process; its metrics records, summary and wall time."""
    from launch.analysis import formulas
    from launch.config.recipe import load_recipe
    path = REPO / "recipes" / f"{name}.yaml"
    as_written = load_recipe(path, [])
    sets = recipe_overrides(name, args, as_written.train.micro_batch_size, as_written.model.arch)
    recipe = load_recipe(path, sets)  # what train.py will see (fails here on a bad --set)
    metrics = workdir / f"{name}.jsonl"
    cmd = [sys.executable, str(REPO / "launch" / "train.py"), "--recipe", str(path),
           "--steps", str(args.steps), "--metrics-out", str(metrics)]
    for item in sets:
        cmd += ["--set", item]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout_s)
    wall = time.perf_counter() - start
    params = formulas.model_params(recipe.gpt_config(recipe.model.vocab_size))  # either architecture
    result = {"recipe": name, "wall_s": wall, "params": params,
              "n_layer": recipe.model.n_layer, "n_embd": recipe.model.n_embd,
              "n_head": recipe.model.n_head, "seq_len": recipe.seq_len, "vocab_size": recipe.model.vocab_size,
              "micro_batch_size": recipe.train.micro_batch_size,
              "global_batch_size": recipe.train.global_batch_size}
    if proc.returncode != 0:
        lines = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()
        error = next((line for line in reversed(lines) if "Error" in line or line.startswith("error")), lines[-1])
        return dict(result, error=f"exit {proc.returncode}: {error[:300]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return dict(result, **summarise(records, args.warmup), peak=peak_line(proc.stdout))


def summarise(records: list, warmup: int) -> dict:
    """The record of the median step after warm-up (the lower median for an even count), so
    tokens/s, TFLOP/s and MFU are one step's own, mutually consistent numbers."""
    timed = [r for r in records if r["step"] > warmup]
    median_time = statistics.median_low(r["step_time_s"] for r in timed)
    median = next(r for r in timed if r["step_time_s"] == median_time)
    return {"step": median["step"], "step_time_s": median["step_time_s"],
            "tokens_per_s": median["tokens_per_s"], "tflops_per_device": median["tflops_per_device"],
            "mfu": median["mfu"], "peak_memory_bytes": max(r["peak_memory_bytes"] for r in records),
            "loss_first": records[0]["loss"], "loss_last": records[-1]["loss"],
            "step_times_s": [r["step_time_s"] for r in records]}


def peak_line(stdout: str) -> str:
    """What train.py's summary says MFU divides by (device name and peak, or none on CPU)."""
    marker = "MFU peak per device: "
    return next((line.split(marker, 1)[1] for line in stdout.splitlines() if marker in line), "?")


def print_table(results: list) -> None:
    print(f"{'recipe':<12}{'params':>9}{'micro x acc':>13}{'tok/step':>10}{'step s':>9}{'tokens/s':>12}"
          f"{'TFLOP/s':>9}{'MFU':>8}{'peak mem':>10}{'loss':>15}{'wall s':>8}")
    for r in results:
        shape = f"{r['micro_batch_size']} x {r['global_batch_size'] // r['micro_batch_size']}"
        head = f"{r['recipe']:<12}{r['params'] / 1e6:>8.1f}M{shape:>13}{r['global_batch_size'] * r['seq_len']:>10,}"
        if "error" in r:
            print(f"{head}  failed: {r['error']}")
            continue
        mfu = "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}"
        loss = f"{r['loss_first']:.2f} -> {r['loss_last']:.2f}"
        print(f"{head}{r['step_time_s']:>9.4f}{r['tokens_per_s']:>12,.0f}{r['tflops_per_device']:>9.3g}"
              f"{mfu:>8}{r['peak_memory_bytes'] / 2 ** 30:>8.1f}Gi{loss:>15}{r['wall_s']:>8.0f}")


def main(argv=None) -> int:
    args = parse_args(argv)
    names = [n.strip() for n in args.recipes.split(",") if n.strip()]
    start = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory(prefix="gpu_mfu_") as tmp:
        for name in names:
            print(f"{name}: training {args.steps} steps ...", flush=True)
            results.append(run_recipe(name, args, Path(tmp)))
    total = time.perf_counter() - start
    peaks = {r.get("peak") for r in results if "peak" in r}
    print(f"\nbf16, tp=pp=dp=1, ZeRO-1; median of steps {args.warmup + 1}-{args.steps}; "
          f"MFU peak: {'; '.join(sorted(peaks)) or '?'}")
    print_table(results)
    print(f"total {total:.0f} s" + ("" if args.tiny else f" (budget {BUDGET_S} s on one H100/H200)"))
    if args.json:
        print(json.dumps({"steps": args.steps, "warmup": args.warmup, "tiny": args.tiny,
                          "total_wall_s": total, "results": results}))
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
