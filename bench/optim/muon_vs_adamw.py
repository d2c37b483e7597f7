"""AdamW against Muon on the demo recipe: the same model, data, seed, learning rate,
schedule and tokens, one run of each optimizer, one after the other in this command. Prints the
validation loss at the given steps and the median step time of Muon over AdamW's (steps that
evaluate left out, and the first few). A measurement, not an assertion: one seed each.

    python bench/optim/muon_vs_adamw.py [--procs 1 --tp 1 --pp 1 --steps 200 --at 100 200]
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import REPO
from launch.engine.distributed import launcher_command

DEMO = REPO / "recipes" / "demo.yaml"
WARM_UP_STEPS = 5  # the first steps also start the data and allocate: not step time


def train(optimizer: str, args, out: Path) -> list:
    metrics = out / f"{optimizer}.jsonl"
    cmd = launcher_command(args.procs, REPO / "launch" / "train.py") + [
        "--recipe", str(args.recipe), "--tp", str(args.tp), "--pp", str(args.pp), "--steps", str(args.steps),
        "--set", f"train.optimizer={optimizer}", "--set", f"train.eval_every={args.eval_every}",
        "--metrics-out", str(metrics)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{optimizer} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def median_step_time(metrics: list) -> float:
    return statistics.median(m["step_time_s"] for m in metrics[WARM_UP_STEPS:] if "val_loss" not in m)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", type=Path, default=DEMO)
    p.add_argument("--procs", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--at", type=int, nargs="+", default=[100, 200], help="steps whose val_loss is reported")
    p.add_argument("--eval-every", type=int, default=100)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: train(name, args, Path(tmp)) for name in ("adamw", "muon")}
    for name, metrics in runs.items():
        by_step = {m["step"]: m for m in metrics}
        losses = ", ".join(f"step {s} val_loss {by_step[s]['val_loss']:.4f}" for s in args.at if "val_loss" in by_step.get(s, {}))
        print(f"{name:5s}: {losses}; train loss at step {metrics[-1]['step']} {metrics[-1]['loss']:.4f}; "
              f"median step {median_step_time(metrics):.3f} s")
    print(f"step time muon / adamw: {median_step_time(runs['muon']) / median_step_time(runs['adamw']):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
