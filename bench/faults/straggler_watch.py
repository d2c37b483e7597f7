"""What judging stragglers costs rank 0 at thousands of ranks, against the all-pairs rule,
measured in the same run.

One process simulates --world ranks (4,096) at each --layouts PP,TP (dp = world / (pp x tp)):
launch/instruments/stragglers.py's StragglerWatch is built from every rank's stage, in-pass group
(the TP group of a replica: global rank minus its TP rank, as in_pass_group gives it at cp = ep = 1)
and host, then fed --steps (50) steps of random compute seconds (stage-dependent, +-5%) in which
--slow (3) groups are twice as slow from step 10, and two ranks wait 40% of the step on data.
The reference is the all-pairs rule, written out below: every rank against statistics.median
of every other rank of its stage, with its O(world^2) peer lists built once; it takes seconds
per step, so it runs --reference-steps (2) steps. Times are the median over the steps (the
constructor: one build each); memory is the constructor's peak by tracemalloc (numpy reports its
arrays to it). summarise_seconds (the record's compute_s summary) is timed against the same
summary in plain Python over every rank. Target: observe <= 10 ms per step at 4,096 ranks.

    python bench/faults/straggler_watch.py [--world 4096] [--layouts 1,1 1,8 8,8] [--steps 50]
                                           [--reference-steps 2] [--slow 3] [--json]
"""
import argparse
import json
import statistics
import time
import tracemalloc
from typing import Callable, Dict, List, Sequence, Tuple

import numpy as np

from launch.instruments.stragglers import FACTOR, STREAK, StragglerWatch, summarise_seconds

RANKS_PER_HOST = 8


class ReferenceWatch:
    """The all-pairs rule: each rank against the median of every other rank of its stage, O(world^2)."""

    def __init__(self, stages: Sequence[int], hosts: Sequence[str]):
        self.stages, self.hosts = list(stages), list(hosts)
        self.peers = [[q for q, s in enumerate(self.stages) if s == stage and q != r]
                      for r, stage in enumerate(self.stages)]
        self.streak = [0] * len(self.stages)

    def observe(self, step: int, seconds: Sequence[float]) -> List[str]:
        lines = []
        for r, peers in enumerate(self.peers):
            if not peers:
                continue
            median = statistics.median(seconds[q] for q in peers)
            self.streak[r] = self.streak[r] + 1 if seconds[r] > FACTOR * median else 0
            if self.streak[r] == STREAK:
                lines.append(f"warning: rank {r} on {self.hosts[r]} is a straggler")
        return lines


def reference_summary(seconds: Sequence[float], stages: Sequence[int]) -> Dict[str, object]:
    """summarise_seconds in plain Python: the max and median over all ranks and over each stage's."""
    def summary(ranks: List[int]) -> Dict[str, object]:
        slowest = max(ranks, key=lambda r: seconds[r])
        return {"max": seconds[slowest], "median": statistics.median(seconds[r] for r in ranks),
                "slowest_rank": slowest}
    by_stage = [summary([r for r, s in enumerate(stages) if s == stage]) for stage in sorted(set(stages))]
    return dict(summary(list(range(len(seconds)))), by_stage=by_stage)


def layout_roles(world: int, pp: int, tp: int) -> Tuple[List[int], List[int], List[str]]:
    """Stage, in-pass group and host of every rank: DeepSpeed's (pipe, data, model) order puts a
    TP group at adjacent ranks, stage-major (model/parallel/state.py)."""
    per_stage = world // pp
    ranks = range(world)
    return [r // per_stage for r in ranks], [r - r % tp for r in ranks], [f"node{r // RANKS_PER_HOST:04d}" for r in ranks]


def simulated_steps(seed: int, stages: List[int], groups: List[int], steps: int, slow: int):
    """(compute seconds as a list, data waits, step time) per step (module docstring)."""
    rng = np.random.default_rng(seed)
    stage_of, group_of = np.asarray(stages), np.asarray(groups)
    slow_groups = rng.choice(np.unique(group_of), size=slow, replace=False)
    readers = rng.choice(len(stages), size=2, replace=False)
    for step in range(1, steps + 1):
        compute = (1.0 + 0.1 * stage_of) * rng.uniform(0.95, 1.05, len(stages))
        if step >= 10:
            compute[np.isin(group_of, slow_groups)] *= 2.0
        step_time = float(compute.max()) * 1.1
        waits = np.zeros(len(stages))
        waits[readers] = 0.4 * step_time
        yield compute.tolist(), waits, step_time


def timed(fn: Callable[[], object]) -> Tuple[object, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def peak_mib(fn: Callable[[], object]) -> float:
    tracemalloc.start()
    fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak / 2 ** 20


def measure(world: int, pp: int, tp: int, steps: int, reference_steps: int, slow: int) -> Dict[str, object]:
    stages, groups, hosts = layout_roles(world, pp, tp)
    watch, build_s = timed(lambda: StragglerWatch(stages, groups, hosts))
    observe_s, summary_s, lines = [], [], []
    for step, (compute, waits, step_time) in enumerate(simulated_steps(0, stages, groups, steps, slow), start=1):
        new_lines, seconds = timed(lambda: watch.observe(step, compute, waits, step_time))
        observe_s.append(seconds)
        lines += new_lines
        summary_s.append(timed(lambda: summarise_seconds(compute, stages))[1])
    reference, reference_build_s = timed(lambda: ReferenceWatch(stages, hosts))
    reference_observe_s, reference_summary_s = [], []
    for step, (compute, _, _) in enumerate(simulated_steps(0, stages, groups, reference_steps, slow), start=1):
        reference_observe_s.append(timed(lambda: reference.observe(step, compute))[1])
        reference_summary_s.append(timed(lambda: reference_summary(compute, stages))[1])
    reference = None  # its O(world^2) lists freed before the memory is measured
    return {"world": world, "pp": pp, "tp": tp, "dp": world // (pp * tp), "groups": len(set(groups)),
           "build_ms": build_s * 1e3, "reference_build_ms": reference_build_s * 1e3,
           "build_MiB": peak_mib(lambda: StragglerWatch(stages, groups, hosts)),
           "reference_build_MiB": peak_mib(lambda: ReferenceWatch(stages, hosts)),
           "observe_ms": statistics.median(observe_s) * 1e3, "observe_max_ms": max(observe_s) * 1e3,
           "reference_observe_ms": statistics.median(reference_observe_s) * 1e3,
           "summary_ms": statistics.median(summary_s) * 1e3,
           "reference_summary_ms": statistics.median(reference_summary_s) * 1e3,
           "lines": len(lines), "straggler_line": next((line for line in lines if "straggler" in line), None)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4096)
    parser.add_argument("--layouts", nargs="+", default=["1,1", "1,8", "8,8"], metavar="PP,TP")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--reference-steps", type=int, default=2, help="the reference's steps (seconds each)")
    parser.add_argument("--slow", type=int, default=3, help="groups slowed twofold from step 10")
    parser.add_argument("--json", action="store_true", help="last line: one JSON list with the rows")
    args = parser.parse_args()
    layouts = [tuple(int(v) for v in layout.split(",")) for layout in args.layouts]
    for pp, tp in layouts:
        if pp < 1 or tp < 1 or args.world % (pp * tp):
            parser.error(f"--layouts {pp},{tp}: pp x tp must divide --world {args.world}")
    if args.steps < 10 + STREAK or args.reference_steps < 1:
        parser.error(f"--steps must be >= {10 + STREAK} (the slow groups start at step 10), --reference-steps >= 1")

    rows = [measure(args.world, pp, tp, args.steps, args.reference_steps, args.slow) for pp, tp in layouts]
    print(f"straggler judging on rank 0 at {args.world} ranks: median ms per step over {args.steps} steps "
          f"(reference, the all-pairs rule: {args.reference_steps} steps); constructor once, peak MiB by tracemalloc")
    header = (f"{'pp,tp,dp':>12} {'groups':>6} | {'observe':>8} {'max':>6} {'reference':>10} {'ratio':>7} | "
              f"{'build':>7} {'MiB':>6} {'reference':>10} {'MiB':>7} | {'summary':>7} {'reference':>9}")
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{row['pp']:>4},{row['tp']},{row['dp']:<5} {row['groups']:>6} | {row['observe_ms']:>8.2f} "
              f"{row['observe_max_ms']:>6.2f} {row['reference_observe_ms']:>10.0f} "
              f"{row['reference_observe_ms'] / row['observe_ms']:>6.0f}x | {row['build_ms']:>7.2f} {row['build_MiB']:>6.2f} "
              f"{row['reference_build_ms']:>10.0f} {row['reference_build_MiB']:>7.0f} | {row['summary_ms']:>7.2f} "
              f"{row['reference_summary_ms']:>9.2f}")
    for row in rows:
        print(f"pp={row['pp']} tp={row['tp']}: {row['lines']} lines (the {args.slow} slowed groups, 2 slow readers), "
              f"e.g. {row['straggler_line']}")
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
