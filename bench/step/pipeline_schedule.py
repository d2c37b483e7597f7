"""The measured bubble of 1F1B, ZB-H1 and interleaved 1F1B side by side, each against its prediction.

For each pipeline depth p and micro-batch count m, trains the recipe (the demo with 8 blocks unless
--recipe / --set say otherwise) for a few steps through DeepSpeed's launcher with p CPU processes,
once per schedule, alternating, with `--timeline`: the run prints the bubble it measured (idle share
of the stages between the first forward and the last backward of a step, mean of the recorded
steps) and the one predicted by playing the same schedule with the measured mean pass times
(launch/analysis/schedule_sim.py; interleaved: launch/analysis/interleaved_schedule.py with each rank's
mean chunk pass times). m is set through the global batch (m = B / (b * dp), dp 1). Interleaved runs
(`--virtual-stages`, v chunks per rank) need m a multiple of p and the blocks divisible by p v.
Beside them, (F+B-W)/(F+B+W) from ZB-H1's mean pass times: the share of 1F1B's bubble the paper's
analysis leaves when a stage's W pass fills its wait (a third when F = B = W).

    python bench/step/pipeline_schedule.py [--pp 2 4] [--microbatches 4 8] [--virtual-stages 2] [--steps 4]
        [--repeats 1] [--json]

On this CPU machine one process per core gives p=2 its own cores; p=4 shares 2 cores between 4
processes, so a stage that waits frees its core for another: the bubble is still each stage's
wait, but pass times stretch.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median
from typing import Dict, List

from bench import REPO
from launch.engine.distributed import launcher_command

DEMO = REPO / "recipes" / "demo.yaml"
DEFAULT_SET = ["model.n_layer=8"]  # enough blocks to balance 4 stages around the head
LINE = re.compile(r"^timeline: (\S+) bubble measured ([\d.]+)% \(mean of steps \d+-\d+\) vs predicted ([\d.]+)% "
                  r"from the measured pass times; \(p-1\)/\(m\+p-1\) = ([\d.]+)%.*mean pass ms F/B/W per stage: "
                  r"([\d./, ]+);", re.MULTILINE)


def measure(recipe: Path, overrides: List[str], pp: int, microbatches: int, schedule: str, steps: int,
            micro_batch: int) -> Dict[str, float]:
    """One run: {measured, predicted, formula} bubble fractions, from the timeline line it prints."""
    with tempfile.TemporaryDirectory() as tmp:
        v = int(schedule.split("-v")[1]) if schedule.startswith("interleaved-v") else 1
        sets = overrides + [f"train.schedule={'1f1b' if v > 1 else schedule}", f"train.virtual_stages={v}",
                            f"train.global_batch_size={microbatches * micro_batch}",
                            f"train.micro_batch_size={micro_batch}", "train.eval_every=0"]
        cmd = launcher_command(pp, REPO / "launch" / "train.py") + [
            "--recipe", str(recipe), "--pp", str(pp), "--steps", str(steps), "--timeline",
            str(Path(tmp) / "timeline.png"), "--timeline-steps", str(steps - 1)]
        cmd += [arg for override in sets for arg in ("--set", override)]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=dict(os.environ), timeout=1800)
    found = LINE.search(proc.stdout)
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"{schedule} at pp={pp}, m={microbatches} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    assert found.group(1) == schedule, found.group(0)
    passes = [[float(ms) for ms in stage.split("/")] for stage in found.group(5).split(", ")]
    return {"measured": float(found.group(2)) / 100, "predicted": float(found.group(3)) / 100,
            "formula_1f1b": float(found.group(4)) / 100, "pass_ms": passes}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", type=Path, default=DEMO)
    parser.add_argument("--set", action="append", default=None, metavar="KEY=VALUE",
                        help=f"recipe overrides (default: {' '.join(DEFAULT_SET)})")
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--virtual-stages", type=int, default=2,
                        help="chunks per rank of the interleaved runs (1: none); only where m is a multiple of p")
    parser.add_argument("--steps", type=int, default=4, help="steps per run; all but the first are recorded")
    parser.add_argument("--repeats", type=int, default=1, help="runs per schedule, alternating; medians reported")
    parser.add_argument("--json", action="store_true", help="also print every measurement as one JSON line")
    args = parser.parse_args(argv)
    overrides = DEFAULT_SET if args.set is None else args.set
    rows = []
    v = args.virtual_stages
    print(f"{'pp':>3} {'m':>3}  {'1f1b measured':>13} {'predicted':>9}  {'zb-h1 measured':>14} {'predicted':>9}  "
          f"{'zb/1f1b':>7}  {'(F+B-W)/(F+B+W)':>15}  {'(p-1)/(m+p-1)':>13}  "
          + (f"{f'v={v} measured':>12} {'predicted':>9}  {f'v{v}/1f1b':>7}  {'(p-1)/(vm+p-1)':>14}  " if v > 1 else "")
          + "zb-h1 pass ms F/B/W per stage", flush=True)
    for pp in args.pp:
        for m in args.microbatches:
            runs: Dict[str, List[Dict[str, float]]] = {"1f1b": [], "zb-h1": []}
            interleaved = f"interleaved-v{v}"
            if v > 1 and m % pp == 0:
                runs[interleaved] = []
            for _ in range(args.repeats):
                for schedule in runs:
                    runs[schedule].append(measure(args.recipe, overrides, pp, m, schedule, args.steps,
                                                  args.micro_batch))
            row = {"pp": pp, "microbatches": m, "runs": runs}
            for schedule, results in runs.items():
                for key in ("measured", "predicted"):
                    row[f"{schedule}_{key}"] = median(r[key] for r in results)
            row["formula_1f1b"] = runs["1f1b"][0]["formula_1f1b"]
            row["ratio"] = row["zb-h1_measured"] / row["1f1b_measured"]
            if interleaved in runs:  # the interleaved bubble: (p-1)/(v m + p - 1) with equal stages
                row["interleaved_ratio"] = row[f"{interleaved}_measured"] / row["1f1b_measured"]
                row["formula_interleaved"] = (pp - 1) / (v * m + pp - 1)
            # ZB-H1 shortens each stage's share of the bubble from F + B + W to F + B - W (Qi et al.
            # 2023, sec. 3.1): the ratio it can reach, from the mean pass times of its own runs.
            passes = [[median(r["pass_ms"][k][i] for r in runs["zb-h1"]) for i in range(3)] for k in range(pp)]
            row["zb_pass_ms"] = passes
            row["paper_ratio"] = (sum(f + b - w for f, b, w in passes) / sum(f + b + w for f, b, w in passes))
            rows.append(row)
            print(f"{pp:>3} {m:>3}  {row['1f1b_measured']:>13.1%} {row['1f1b_predicted']:>9.1%}  "
                  f"{row['zb-h1_measured']:>14.1%} {row['zb-h1_predicted']:>9.1%}  {row['ratio']:>7.2f}  "
                  f"{row['paper_ratio']:>15.2f}  {row['formula_1f1b']:>13.1%}  "
                  + (f"{row[f'{interleaved}_measured']:>12.1%} {row[f'{interleaved}_predicted']:>9.1%}  "
                     f"{row['interleaved_ratio']:>7.2f}  {row['formula_interleaved']:>14.1%}  "
                     if interleaved in runs else f"{'-':>12} {'-':>9}  {'-':>7}  {'-':>14}  " if v > 1 else "")
                  + ", ".join("/".join(f"{t:.0f}" for t in stage) for stage in passes), flush=True)
    if args.json:
        print(json.dumps({"recipe": str(args.recipe), "set": overrides, "steps": args.steps, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
