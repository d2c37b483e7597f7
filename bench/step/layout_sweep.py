"""Predicted against measured step times over a sweep of layouts: how well
the planner's cost model ranks and times the layouts of this machine.

    python bench/step/layout_sweep.py [--steps 8] [--repeats 1] [--groups tiny.yaml:8,...] [--held-out] [--json FILE]

For each recipe and process count of the sweep (tiny, llama-tiny and moe-tiny on 4 and 8
processes), the machine is calibrated first (`launch/plan.py --search --calibrate`: the
candidates' GEMM shapes, memory and links, with that many processes at once; cached). Then each
layout trains `--steps` steps through DeepSpeed's launcher with `--metrics-out`, and the bench
reads the run's own `predicted_step_time_s` and its measured step times (the median after 2
steps of warm-up). `--layout auto` runs once per group too. Reported per group and overall:
- Spearman's rank correlation of predicted against measured (target >= 0.8);
- the median relative error |measured - predicted| / measured (target <= 20%);
- the auto pick's measured time against the fastest measured (target within 10%).
With `--repeats R` each group runs its layouts (auto included) R times in alternating rounds
(every layout once, then every layout again), and each layout's measured time is the median of
its R runs: two runs of one layout minutes apart differ by up to 17% on this machine, so one run
cannot tell an auto pick within 10% of the fastest from one that is not. Where the auto pick is
one of the group's fixed layouts, the bench also reports that layout's fixed runs against the
fastest: the pick measured beside the others in the same rounds. `--groups` runs a subset.
`--held-out` runs HELD_OUT instead: groups the cost model was never revised against.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from bench import REPO
from launch.engine.distributed import launcher_command


WARM_UP = 2
SWEEP: Dict[Tuple[str, int], List[List[str]]] = {
    ("tiny.yaml", 4): [["--tp", "1", "--pp", "1"], ["--tp", "2", "--pp", "1"], ["--tp", "1", "--pp", "2"],
                       ["--tp", "2", "--pp", "2"], ["--tp", "1", "--pp", "4"],
                       ["--tp", "1", "--pp", "1", "--set", "train.micro_batch_size=4"]],
    ("llama-tiny.yaml", 4): [["--tp", "1", "--pp", "1"], ["--tp", "2", "--pp", "2"], ["--tp", "1", "--pp", "2", "--cp", "2"]],
    ("moe-tiny.yaml", 4): [["--tp", "1", "--pp", "1", "--ep", "1"], ["--tp", "1", "--pp", "1", "--ep", "2"],
                           ["--tp", "1", "--pp", "2", "--ep", "2"]],
    ("tiny.yaml", 8): [["--tp", "1", "--pp", "1"], ["--tp", "2", "--pp", "2"], ["--tp", "2", "--pp", "4"]],
}
# Groups the cost model was never revised against (named in docs/performance.md before their first
# run): other recipes at other process counts, with micro-batch variants among the fixed layouts.
MB1, MB4 = ["--set", "train.micro_batch_size=1"], ["--set", "train.micro_batch_size=4"]
HELD_OUT: Dict[Tuple[str, int], List[List[str]]] = {
    ("llama-tiny.yaml", 8): [["--tp", "1", "--pp", "1"], ["--tp", "1", "--pp", "1", *MB1], ["--tp", "2", "--pp", "2"],
                             ["--tp", "1", "--pp", "2", "--cp", "2"]],
    ("moe-tiny.yaml", 8): [["--tp", "1", "--pp", "1", "--ep", "2"], ["--tp", "1", "--pp", "1", "--ep", "4"],
                           ["--tp", "2", "--pp", "1", "--ep", "2", *MB4]],
    ("tiny.yaml", 2): [["--tp", "1", "--pp", "1"], ["--tp", "2", "--pp", "1"], ["--tp", "1", "--pp", "2", *MB4]],
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8, help="steps per run (default 8; the first 2 are warm-up)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each layout, in alternating rounds (default 1)")
    p.add_argument("--groups", default="", help="comma-separated RECIPE:PROCS of the sweep to run (default: all)")
    p.add_argument("--json", type=Path, help="write every run's numbers here")
    p.add_argument("--held-out", action="store_true",
                   help="run the held-out groups (never used to revise the cost model) instead of the sweep")
    args = p.parse_args()
    if args.steps <= WARM_UP:
        p.error(f"--steps {args.steps} must be above the {WARM_UP} warm-up steps")
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats} must be at least 1")
    known = {f"{recipe}:{procs}" for recipe, procs in (HELD_OUT if args.held_out else SWEEP)}
    unknown = [g for g in args.groups.split(",") if g and g not in known]
    if unknown:
        p.error(f"--groups {','.join(unknown)}: not in the sweep; choose from {','.join(sorted(known))}")
    return args


def calibrate(recipe: str, procs: int, env: Dict[str, str]) -> None:
    """Every candidate's shapes measured with `procs` processes at once (cached for the runs)."""
    subprocess.run([sys.executable, str(REPO / "launch" / "plan.py"), "--recipe", str(REPO / "recipes" / recipe),
                    "--gpus", str(procs), "--search", "--calibrate", "--precision", "fp32"],
                   cwd=REPO, env=env, check=True, capture_output=True, text=True)


def run(recipe: str, procs: int, layout: Sequence[str], steps: int, env: Dict[str, str], work: Path
        ) -> Optional[Dict[str, object]]:
    """One training run's predicted and measured step time, or None if it failed (printed)."""
    metrics = work / f"{recipe}-{procs}-{'_'.join(layout).replace('-', '')}.jsonl"
    command = launcher_command(procs, REPO / "launch" / "train.py") + [
        "--recipe", str(REPO / "recipes" / recipe), "--steps", str(steps), "--set", "train.eval_every=0",
        "--metrics-out", str(metrics), *layout]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        print(f"  {' '.join(layout)}: failed ({done.stderr.strip().splitlines()[-1:]})", flush=True)
        return None
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    measured = statistics.median(r["step_time_s"] for r in records[WARM_UP:])
    first = records[0]
    chosen = first.get("layout_auto")
    return {"recipe": recipe, "procs": procs, "layout": " ".join(layout), "predicted": first["predicted_step_time_s"],
            "measured": measured, "auto": chosen}


def _layout_key(recipe: str, layout: Sequence[str]) -> Tuple[int, int, int, int, int]:
    """(tp, pp, cp, ep, micro-batch) of a fixed layout's flags, the recipe's where not given."""
    from launch.config.recipe import load_recipe
    flags = dict(zip(layout[::2], layout[1::2]))
    sets = [value for flag, value in zip(layout[::2], layout[1::2]) if flag == "--set"]
    train = load_recipe(REPO / "recipes" / recipe, sets).train
    return (int(flags.get("--tp", 1)), int(flags.get("--pp", 1)), int(flags.get("--cp", 1)),
            int(flags.get("--ep", train.ep)), train.micro_batch_size)


AUTO_AXES = ("tp", "pp", "cp", "ep", "micro_batch")  # the fields of `layout_auto` that _layout_key holds


def _choice(auto: Dict[str, object]) -> str:
    return " ".join(f"{axis.replace('_', '-')} {auto[axis]}" for axis in AUTO_AXES)


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    def ranks(values):
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        for rank, i in enumerate(order):
            out[i] = float(rank)
        return out
    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def _errors(rows: Sequence[Dict[str, object]]) -> List[float]:
    """|measured - predicted| / measured of each row."""
    return [abs(r["measured"] - r["predicted"]) / r["measured"] for r in rows]


def main() -> None:
    args = parse_args()
    rows: List[Dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        env = dict(os.environ, GPT3D_CALIBRATION=str(work / "calibration"))
        for (recipe, procs), layouts in (HELD_OUT if args.held_out else SWEEP).items():
            if args.groups and f"{recipe}:{procs}" not in args.groups.split(","):
                continue
            start = time.perf_counter()
            calibrate(recipe, procs, env)
            print(f"{recipe} on {procs} processes (calibrated in {time.perf_counter() - start:.1f} s):", flush=True)
            runs: Dict[str, List[Dict[str, object]]] = {}
            for round_index in range(args.repeats):
                for layout in layouts + [["--layout", "auto"]]:
                    row = run(recipe, procs, layout, args.steps, env, work)
                    if row is not None:
                        runs.setdefault(row["layout"], []).append(row)
            group = []
            for name, repeated in runs.items():
                row = dict(repeated[0], measured=statistics.median(r["measured"] for r in repeated),
                           runs=[r["measured"] for r in repeated])
                group.append(row)
                spread = f" (runs {', '.join(f'{t:.4f}' for t in row['runs'])})" if len(repeated) > 1 else ""
                print(f"  {row['layout']:<48} predicted {row['predicted']:.4f} s, measured {row['measured']:.4f} s "
                      f"({row['measured'] / row['predicted']:.2f}x){spread}", flush=True)
            fixed = [r for r in group if not r["auto"]]
            auto = next((r for r in group if r["auto"]), None)
            if fixed:
                print(f"  median relative error {statistics.median(_errors(fixed)):.0%}", flush=True)
            if len(fixed) >= 2:
                print(f"  Spearman {spearman([r['predicted'] for r in fixed], [r['measured'] for r in fixed]):.2f}"
                      + (f"; auto pick ({_choice(auto['auto'])}) {auto['measured'] / min(r['measured'] for r in fixed):.2f}x "
                         f"the fastest measured" if auto else ""), flush=True)
            if auto:  # the pick is one of the fixed layouts: its own runs in the same rounds, against the fastest
                key = tuple(auto["auto"][axis] for axis in AUTO_AXES)
                same = next((r for r in fixed if _layout_key(recipe, r["layout"].split()) == key), None)
                if same is not None:
                    print(f"  the auto pick is the fixed layout {same['layout']}: {same['measured'] / min(r['measured'] for r in fixed):.2f}x "
                          f"the fastest measured, as a fixed run", flush=True)
                    auto["same_as"] = same["layout"]
            rows += group
    fixed = [r for r in rows if not r["auto"]]
    errors = _errors(fixed)
    print(f"all {len(fixed)} layouts: Spearman {spearman([r['predicted'] for r in fixed], [r['measured'] for r in fixed]):.2f}, "
          f"median relative error {statistics.median(errors):.0%} (targets: >= 0.8, <= 20%)")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
