"""Bytes each collective moves per training step per rank, measured, next to the exact formulas.

Each layout trains a recipe (recipes/tiny.yaml unless --recipe) for 2 steps through DeepSpeed's
launcher on CPU, exactly as a user starts it, with `launch/train.py --comm-counts DIR`
(launch/instruments/comm_counter.py); the counts of every rank and step are compared with
launch/analysis/comm_formulas.py. Step 1 also carries DeepSpeed's one-time shape header; step 2 is the steady state. Bookkeeping (loss averaging, grad-norm and
metric reductions of a few scalars) is printed apart: it has no formula.

    python bench/step/comm_volume.py [--layouts 2,1,1 1,2,1 1,1,2 2,2,2 1,4,1] [--keep DIR]
    python bench/step/comm_volume.py --recipe recipes/llama-tiny.yaml --layouts 4,2,1 4,1,2
    python bench/step/comm_volume.py --recipe recipes/llama-tiny.yaml --set model.n_kv_head=1 --layouts 2,2,2
The Llama layouts at tp > n_kv_head add the key/value row gathers (tp-kv-gather, tp-kv-grads).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from bench import REPO
from launch.analysis.comm_formulas import comm_per_rank_per_step
from launch.analysis.engine_memory import reduces_gradients
from launch.engine.distributed import launcher_command
from launch.instruments.comm_counter import BOOKKEEPING

TINY = REPO / "recipes" / "tiny.yaml"
STEPS = 2
OVERRIDES = ["train.eval_every=0", f"train.steps={STEPS}"]  # no evaluation traffic inside the steps
DEFAULT_LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2), (1, 4, 1)]
Row = Dict[str, object]  # rank, stage, step, purpose, role, op, measured and formula (calls, elements, bytes)


def measure(tp: int, pp: int, dp: int, out_dir: Path, recipe: Path = TINY, overrides: Sequence[str] = (),
            timeout: int = 600) -> List[dict]:
    """Train STEPS steps of `recipe` (with --set `overrides`) at (tp, pp, dp) with the counter on;
    every rank's counts, rank order."""
    cmd = launcher_command(tp * pp * dp, REPO / "launch" / "train.py") + [
        "--recipe", str(recipe), "--tp", str(tp), "--pp", str(pp), "--comm-counts", str(out_dir)]
    cmd += [a for o in OVERRIDES + list(overrides) for a in ("--set", o)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    if proc.returncode != 0:
        raise RuntimeError(f"layout {(tp, pp, dp)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(tp * pp * dp)]


def run_model(tp: int, pp: int, dp: int, recipe_path: Path = TINY, overrides: Sequence[str] = ()):
    """The GPTConfig and Layout train.py derives for the recipe at this layout, and whether its engine
    reduces gradients."""
    from launch.analysis.partition import with_stage_boundaries
    from launch.config.layout import check_and_derive_layout
    from launch.config.recipe import load_recipe
    from launch.engine.ds_config import deepspeed_config
    from launch.feed.run_inputs import load_checked_tokenizer
    recipe = load_recipe(recipe_path, OVERRIDES + list(overrides))
    _, vocab_size = load_checked_tokenizer(recipe)
    layout = check_and_derive_layout(recipe, tp * pp * dp, tp, pp, on_cpu=True)
    layout = with_stage_boundaries(layout, recipe, vocab_size)
    stage = deepspeed_config(recipe, layout)["zero_optimization"]["stage"]  # the stage the run builds
    return recipe.gpt_config(vocab_size), layout, reduces_gradients(recipe.train.precision, stage,
                                                                    layout.dp * layout.cp)


def compare(counts: List[dict], config, layout, gradient_reduce: bool = True
            ) -> Tuple[List[Row], Dict[Tuple[int, int], int]]:
    """Rows for every (rank, step, purpose, role, op) measured or predicted, and the bookkeeping
    bytes per (rank, step) (inside train_batch and after it, until the next step).
    `gradient_reduce`: whether the run's engine reduces gradients (run_model says)."""
    rows: List[Row] = []
    bookkeeping: Dict[Tuple[int, int], int] = defaultdict(int)
    for rank_counts in counts:
        rank, stage = rank_counts["rank"], rank_counts["coord"]["pipe"]
        for step in range(1, STEPS + 1):
            measured = {}
            for phase in (f"step {step}", f"after step {step}"):
                for e in rank_counts["phases"].get(phase, []):
                    if e["purpose"].startswith(BOOKKEEPING):
                        bookkeeping[(rank, step)] += e["bytes"]
                    else:
                        assert phase == f"step {step}", f"model traffic outside a step: {e}"
                        measured[(e["purpose"], e["role"], e["op"])] = (e["calls"], e["elements"], e["bytes"])
            formula = comm_per_rank_per_step(config, layout, stage, first_step=step == 1,
                                             gradient_reduce=gradient_reduce)
            for key in sorted(set(measured) | set(formula)):
                rows.append({"rank": rank, "stage": stage, "step": step, "purpose": key[0], "role": key[1],
                             "op": key[2], "measured": measured.get(key, (0, 0, 0)),
                             "formula": formula.get(key, (0, 0, 0))})
    return rows, bookkeeping


def print_table(tp: int, pp: int, dp: int, rows: List[Row], bookkeeping: Dict[Tuple[int, int], int]) -> None:
    """Step 2 of TP rank 0, DP rank 0 of every stage (the other ranks of a stage move the same),
    step 1's extra lines, and whether all ranks and steps agree."""
    shown = {r * tp * dp for r in range(pp)}  # global rank of (stage r, data 0, model 0)
    agree = all(r["measured"] == r["formula"] for r in rows)
    print(f"\nlayout tp={tp} pp={pp} dp={dp}: {tp * pp * dp} ranks x {STEPS} steps, every call "
          f"{'matches the formula exactly' if agree else 'DOES NOT MATCH'}", flush=True)
    print(f"{'rank':>4} {'stage':>5} {'step':>4}  {'purpose':<15}{'role':<7}{'op':<23}{'calls':>6}"
          f"{'measured B':>12}{'formula B':>12}{'ratio':>7}")
    for r in rows:
        if r["rank"] in shown and (r["step"] == STEPS or r["measured"] != r["formula"] or r["purpose"] == "pp-shape"):
            measured, formula = r["measured"][2], r["formula"][2]
            ratio = f"{measured / formula:.3f}" if formula else "-"
            print(f"{r['rank']:>4} {r['stage']:>5} {r['step']:>4}  {r['purpose']:<15}{r['role']:<7}{r['op']:<23}"
                  f"{r['measured'][0]:>6}{measured:>12,}{formula:>12,}{ratio:>7}")
    per_step = sorted({v for (rank, step), v in bookkeeping.items() if step == STEPS})
    print(f"bookkeeping (loss, grad norm, metrics; no formula): {' or '.join(map(str, per_step))} bytes "
          f"per rank in step {STEPS}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", nargs="+", default=[",".join(map(str, l)) for l in DEFAULT_LAYOUTS],
                   metavar="TP,PP,DP")
    p.add_argument("--recipe", type=Path, default=TINY, help="the recipe to train (default recipes/tiny.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field, as launch/train.py's --set (repeatable)")
    p.add_argument("--keep", type=Path, help="keep the per-rank counts under this directory")
    args = p.parse_args()
    all_agree = True
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        for text in args.layouts:
            tp, pp, dp = (int(x) for x in text.split(","))
            counts = measure(tp, pp, dp, root / f"tp{tp}-pp{pp}-dp{dp}", args.recipe, args.overrides)
            rows, bookkeeping = compare(counts, *run_model(tp, pp, dp, args.recipe, args.overrides))
            print_table(tp, pp, dp, rows, bookkeeping)
            all_agree &= all(r["measured"] == r["formula"] for r in rows)
    return 0 if all_agree else 1


if __name__ == "__main__":
    sys.exit(main())
