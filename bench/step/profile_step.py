"""Where the time of one training step goes: model compute, copies, communication, optimizer,
other ops and Python/engine, per pipeline stage and per collective call site.

    python bench/step/profile_step.py [--recipe recipes/demo.yaml] [--tp 2 --pp 2 --dp 2]
                                      [--warmup 3] [--profile-steps 2] [--set key=value ...] [--json]

Runs `launch/train.py`'s own `main()` in tp*pp*dp processes through DeepSpeed's launcher and
profiles the steps after `--warmup`, from one `train_batch` to the next; it only wraps what it
measures (torch.profiler, the torch.distributed calls, DeepSpeed's pipeline instructions). What
each category holds and measured results: docs/performance.md, "Profiling a step". Times come
from CPU processes sharing the machine's cores: compare runs made side by side."""
import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import REPO

COMM_FUNCTIONS = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
                  "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "reduce", "send", "recv", "barrier",
                  "all_reduce_coalesced")
COPY_OPS = {"aten::copy_", "aten::clone", "aten::contiguous", "aten::_to_copy", "aten::to", "aten::cat",
            "aten::zero_", "aten::fill_", "aten::zeros", "aten::zeros_like", "aten::empty_like",
            "aten::_foreach_zero_", "aten::new_zeros", "aten::detach_", "aten::resize_"}
COMPUTE_PHASES = ("ForwardPass", "BackwardPass")
CATEGORIES = ("model compute", "copies", "communication", "optimizer", "other ops", "python/engine")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", type=Path, default=REPO / "recipes" / "demo.yaml")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3, help="steps before the profiled ones (default %(default)s)")
    p.add_argument("--profile-steps", type=int, default=2, help="steps profiled; times are per step")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="recipe override passed to launch/train.py (repeatable)")
    p.add_argument("--json", action="store_true", help="last line: the split as one JSON object")
    p.add_argument("--local_rank", "--local-rank", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.warmup < 1 or args.profile_steps < 1:
        p.error("--warmup and --profile-steps must be >= 1")
    return args


def train_argv(args) -> list:
    """launch/train.py's command line: the profiled steps end at the start of one more step."""
    argv = ["--recipe", str(args.recipe), "--tp", str(args.tp), "--pp", str(args.pp),
            "--steps", str(args.warmup + args.profile_steps + 1), "--set", "train.eval_every=0"]
    for item in args.overrides:
        argv += ["--set", item]
    return argv


# ---------------------------------------------------------------- what each rank records

class StepProfiler:
    """Profiles steps warmup+1 .. warmup+profile_steps of the engine's `train_batch` calls."""

    def __init__(self, args):
        self.args = args
        self.calls = 0
        self.active = False
        self.comm = collections.defaultdict(lambda: [0, 0.0])  # (name, site) -> [calls, seconds]
        self.step_times = []
        self.profiler = None

    # -- torch.distributed: wall time per call, named by group and caller

    def wrap_collectives(self):
        import torch.distributed as dist
        for name in COMM_FUNCTIONS:
            setattr(dist, name, self._timed(name, getattr(dist, name)))

    def _timed(self, name, fn):
        import torch
        profiler = self

        def timed(*a, **kw):
            if not profiler.active:
                return fn(*a, **kw)
            kind = "p2p" if name in ("send", "recv") else group_kind(kw.get("group"), profiler.args)
            key = (f"{name} {kind}", caller_site())
            start = time.perf_counter()
            with torch.profiler.record_function(f"comm::{name}"):
                out = fn(*a, **kw)
            entry = profiler.comm[key]
            entry[0] += 1
            entry[1] += time.perf_counter() - start
            return out
        return timed

    # -- DeepSpeed's pipeline instructions as named profiler ranges

    def wrap_instructions(self):
        import torch
        from deepspeed.runtime.pipe.engine import PipelineEngine
        for instruction, method in list(PipelineEngine._INSTRUCTION_MAP.items()):
            def ranged(engine, *a, _method=method, _name=instruction.__name__, **kw):
                with torch.profiler.record_function(f"phase::{_name}"):
                    return _method(engine, *a, **kw)
            PipelineEngine._INSTRUCTION_MAP[instruction] = ranged
        original = PipelineEngine.train_batch
        profiler = self

        def train_batch(engine, *a, **kw):
            profiler.on_step_start()
            return original(engine, *a, **kw)
        PipelineEngine.train_batch = train_batch

    def on_step_start(self):
        import torch
        self.calls += 1
        first = self.args.warmup + 1
        if self.calls == first:
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.profiler.__enter__()
            self.active = True
            self.start = time.perf_counter()
        elif self.calls == first + self.args.profile_steps:
            wall = time.perf_counter() - self.start
            self.active = False
            self.profiler.__exit__(None, None, None)
            self.report(split_events(self.profiler.events(), wall, self.comm, self.args.profile_steps))

    def report(self, split):
        """Gather every rank's split (all ranks are at the start of the same step) and print."""
        import torch.distributed as dist
        state = {"rank": dist.get_rank(), "split": split}
        everything = [None] * dist.get_world_size()
        dist.all_gather_object(everything, state)
        if dist.get_rank() == 0:
            print_report(everything, self.args)


def group_kind(group, args) -> str:
    """TP / DP / PP / world for a group of the (pipe, data, model) topology; p2p without one."""
    import torch.distributed as dist
    if group is None:
        return "world"
    ranks = sorted(dist.get_process_group_ranks(group))
    tp, dp = args.tp, args.dp
    if len(ranks) == dist.get_world_size():
        return "world"
    if ranks == list(range(ranks[0], ranks[0] + len(ranks))) and len(ranks) == tp:
        return "TP"
    stride = ranks[1] - ranks[0] if len(ranks) > 1 else 0
    if all(b - a == stride for a, b in zip(ranks, ranks[1:])):
        if stride == tp and len(ranks) == dp:
            return "DP"
        if stride == tp * dp:
            return "PP"
    if len(ranks) == tp * args.pp:
        return "TPxPP"  # DeepSpeed's model-parallel group: one replica (the grad norm)
    return f"group{ranks}"


def caller_site() -> str:
    """The first frame outside torch.distributed, DeepSpeed's comm wrappers and this file."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if not any(part in path for part in ("torch/distributed", "deepspeed/comm", "profile_step.py")):
            short = path.split("site-packages/")[-1].replace(str(REPO) + "/", "")
            return f"{short}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def split_events(events, wall_s: float, comm, steps: int) -> dict:
    """Milliseconds per step in each category, the comm call sites and the top compute ops."""
    ms = collections.Counter()
    compute_ops = collections.Counter()
    for e in events:
        if not e.name.startswith("aten::"):
            continue  # ranges (ours, autograd nodes, custom Functions): their own time is the rest
        ancestors = []
        parent = e.cpu_parent
        while parent is not None:
            ancestors.append(parent.name)
            parent = parent.cpu_parent
        if any(a.startswith("comm::") for a in ancestors):
            continue  # counted by the collective's wall time
        phase = next((a[len("phase::"):] for a in ancestors if a.startswith("phase::")), None)
        self_ms = e.self_cpu_time_total / 1e3
        if phase in COMPUTE_PHASES:
            if e.name in COPY_OPS:
                ms["copies"] += self_ms
            else:
                ms["model compute"] += self_ms
                compute_ops[e.name] += self_ms
        elif phase == "OptimizerStep":
            ms["optimizer"] += self_ms
        else:
            ms["other ops"] += self_ms
    comm_rows = {f"{name} | {site}": {"calls": n / steps, "ms": s * 1e3 / steps}
                 for (name, site), (n, s) in comm.items()}
    ms["communication"] = sum(s for _, s in comm.values()) * 1e3
    ms = {k: v / steps for k, v in ms.items()}
    step_ms = wall_s * 1e3 / steps
    ms["python/engine"] = step_ms - sum(ms.values())
    return {"step_ms": step_ms, "ms": {c: ms.get(c, 0.0) for c in CATEGORIES}, "comm": comm_rows,
            "compute_ops": {k: v / steps for k, v in compute_ops.most_common(8)}}


# ---------------------------------------------------------------- rank 0's report

def print_report(ranks, args) -> None:
    per_stage = args.tp * args.dp  # ranks of one stage: (pipe, data, model) order
    stages = [[r["split"] for r in ranks if r["rank"] // per_stage == s] for s in range(args.pp)]
    mean = lambda splits, f: statistics.fmean(f(s) for s in splits)  # noqa: E731
    print(f"\nprofile: {args.recipe.name} at (tp, pp, dp) = ({args.tp}, {args.pp}, {args.dp}), "
          f"{args.profile_steps} step(s) after {args.warmup} warm-up; ms per step, mean over the ranks of a stage")
    header = f"{'':<16}" + "".join(f"{'stage ' + str(s):>18}" for s in range(args.pp)) + f"{'all ranks':>18}"
    print(header)
    everyone = [r["split"] for r in ranks]
    for category in ("step_ms",) + CATEGORIES:
        def value(s, c=category):
            return s["step_ms"] if c == "step_ms" else s["ms"][c]
        cells = [mean(st, value) for st in stages] + [mean(everyone, value)]
        step = [mean(st, lambda s: s["step_ms"]) for st in stages] + [mean(everyone, lambda s: s["step_ms"])]
        label = "step (wall)" if category == "step_ms" else category
        print(f"{label:<16}" + "".join(
            f"{c:>10.1f}" + ("" if category == "step_ms" else f" ({c / t:>5.1%})") + ("" if category != "step_ms" else " " * 8)
            for c, t in zip(cells, step)))
    sites = collections.defaultdict(lambda: [0.0, 0.0])
    for s in everyone:
        for key, row in s["comm"].items():
            sites[key][0] += row["calls"] / len(everyone)
            sites[key][1] += row["ms"] / len(everyone)
    print("\ncommunication by call site (mean per rank per step):")
    for key, (calls, spent) in sorted(sites.items(), key=lambda kv: -kv[1][1]):
        print(f"  {spent:>8.1f} ms {calls:>6.1f} calls  {key}")
    ops = collections.Counter()
    for s in everyone:
        ops.update({k: v / len(everyone) for k, v in s["compute_ops"].items()})
    print("\nmodel compute, largest ops (mean per rank per step):")
    for name, spent in ops.most_common(8):
        print(f"  {spent:>8.1f} ms  {name}")
    if args.json:
        print(json.dumps({"layout": [args.tp, args.pp, args.dp], "recipe": str(args.recipe),
                          "stages": [{c: mean(st, lambda s, c=c: s["ms"][c]) for c in CATEGORIES}
                                     | {"step_ms": mean(st, lambda s: s["step_ms"])} for st in stages],
                          "mean": {c: mean(everyone, lambda s, c=c: s["ms"][c]) for c in CATEGORIES}
                          | {"step_ms": mean(everyone, lambda s: s["step_ms"])},
                          "comm": {k: {"calls": v[0], "ms": v[1]} for k, v in sites.items()}}), flush=True)
    sys.stdout.flush()


# ---------------------------------------------------------------- entry points

def run_rank(args) -> int:
    """Inside one launched process: instrument, then train the way launch/train.py does."""
    from launch.config.cli import parse_training_args
    from launch.trainer.loop import run_training
    from launch.trainer.startup import prepare_training_job
    profiler = StepProfiler(args)
    profiler.wrap_collectives()
    profiler.wrap_instructions()
    run_training(prepare_training_job(parse_training_args(train_argv(args))))
    return 0


def launch_all(args, argv) -> int:
    """Outside a launcher: start tp*pp*dp processes of this script through DeepSpeed's launcher."""
    from launch.engine.distributed import launcher_command
    cmd = launcher_command(args.tp * args.pp * args.dp, Path(__file__).resolve()) + argv
    return subprocess.run(cmd, cwd=REPO).returncode


def main() -> int:
    argv = sys.argv[1:]
    args = parse_args(argv)
    if "RANK" not in os.environ:
        return launch_all(args, argv)
    return run_rank(args)


if __name__ == "__main__":
    sys.exit(main())
