"""The first run on a GPU machine, in one command: is it right, how fast, how big. Every check runs
in a process of its own under a time budget, so a check that fails, crashes the GPU or hangs is one
row of the table, and the table is always printed and written as JSON.

    bash bench/gpu/device_command.sh                     # on a GPU machine: install, check, one archive, < 540 s
    python bench/gpu/gpu_check.py                        # NVIDIA GPU(s), no network; one H200: under 8.5 minutes
    python bench/gpu/gpu_check.py --devices 1            # only the first GPU (the one-GPU checks)
    python bench/gpu/gpu_check.py --cpu --devices 1      # the same checks on CPU processes, at toy sizes
    python bench/gpu/gpu_check.py --checks document-mask,moe-mfu   # some of the checks
    python bench/gpu/gpu_check.py --budget-scale 2       # every check's budget doubled (a slower machine)

The checks (bench/gpu/gpu_check_rows.py, which says how each is measured):
1. parity: recipes/tiny.yaml, fp32, eager, 5 steps at (tp, pp, dp) = (1,1,1) and, with 2 devices
   or more, (1,2,1) and (2,1,1): losses and gradient norms within 1e-5 relative of (1,1,1). With one
   GPU, (1,1,1) on the GPU against (1,1,1) on the CPU instead (other kernels): within 1e-4.
2. gpt2-mfu: tokens/s, TFLOP/s and MFU of the GPT-2 124M recipe (bf16, compiled, one device, 16 x 4
   samples of 1024 tokens, 20 steps, the first 5 left out), and its peak memory against
   launch/plan.py's prediction.
3. llama-mfu: the same for recipes/llama3.2-1b.yaml (selective recompute, 8 x 4 samples of 2048
   tokens, 12 steps, the first 4 left out).
4. moe-mfu: the same for Qwen3-30B-A3B's blocks (128 experts of width 768, top 8 renormalised,
   hidden 2048, 32/4 heads of 128) cut to the most layers, up to 6, whose planned memory
   (launch/plan.py) is within 85% of the device's total: 6 on an H200 (86.6 GiB), 4 on an 80 GB
   H100 (61.2 GiB); on one device (ep 1, no recompute; at 6 layers 4.4B parameters, 0.96B active
   per token): MFU of the active FLOPs (the 8 routed experts a token uses). Eager: an MoE block
   breaks the compiled graph at its host sync and recompiles per block.
5. document-mask: data.document_mask against the causal path in bf16, on a corpus of one document
   (where the two masks are the same): flex_attention against SDPA's flash kernel (is_causal, no
   mask: the speed floor). Llama 3.2 1B cut to 4 blocks, compiled, 2 x 1 sample of 8192 tokens, 6
   steps: the losses and gradient norms within 5e-3 relative, and the two step times.
6. zb-h1: train.schedule=zb-h1 against 1f1b at pp = 2 (2 devices), the GPT-2 124M recipe in fp32,
   eager, 8 micro-batches of 4: losses and gradient norms identical to the bit, the step-time ratio.
7. grad-accum-fusion: the bf16 weight-gradient GEMM that adds into the fp32 main gradient
   (model/parallel/weight_grad.py add_product_into) at Llama-2-7B's MLP shape (4096 x 11008
   weight, 8192 tokens): its error against an fp32 GEMM of the same bf16 operands, and its time
   against the unfused bf16 GEMM, cast and add.
8. step-prediction: the planner's predicted step time against the measured one (launch/plan.py
   --calibrate on this device first, then two eager GPT-2 124M runs of 16 x 1024 tokens a step on
   the embedded corpus: micro-batch 4 without and 8 with full recompute; 8 steps, the first 3
   left out).
Every check runs offline: the embedded corpus and tokenizer (GPT-2's or the recipe's vocabulary
kept), wandb disabled. A check that would compile trains eager where torch.compile cannot build
GPU kernels (no Triton, no C compiler; --eager forces it), and its row says "eager (why)".
Every row names the GEMM paths its processes took: the fused bf16-into-fp32 GEMM's
(model/parallel/weight_grad.py) and the experts' grouped one (model/transformer/grouped_gemm.py),
each probed once per process on a GPU; "-" where the probe never ran (CPU, fp32, no experts).
A check the machine cannot run (zb-h1 on one device) is a row marked skipped, with the reason.

Output: the table (a row per result: ok, FAIL, ERROR with its one-line cause, skipped, or measured
where there is no bar), the same as JSON in --json-out (default runs/gpu_check.json, rewritten
after every check) and as text beside it (gpu_check.txt), each check's full output in
runs/gpu_check-logs/CHECK.log (an ERROR row carries its last 60 lines in the JSON: the failed
run's traceback and cause), and each check's folder runs/gpu_check-logs/CHECK/: the metrics its
training runs wrote, a record a step, kept (and counted in the row) when the check is stopped.
Exit 1 if a row is FAIL or ERROR. Paste the table into docs/performance.md with the date, device
and commit.

Time on one H200 (989 TFLOP/s dense bf16): an estimate from reading the code, not a measurement
(no GPU has been lent yet), at about 25 s of start-up per training run (Python, CUDA, DeepSpeed)
and 30-35 s of compiling a block:
    check               estimate  budget  what takes the time
    parity                  45 s    50 s  2 tiny runs (device, CPU)
    gpt2-mfu                60 s    65 s  start-up, compile, 20 steps of 5.6e13 FLOPs (0.14 s at 40%), planner 5 s
    llama-mfu               85 s    90 s  start-up and the 1.2B model's init, compile, 12 steps of 5.4e14 (1.4 s)
    moe-mfu                 60 s    70 s  planner 4 x 2 s, the 4.4B model's init, 12 steps of 8.4e13 (0.4 s at 20%)
    document-mask          115 s   125 s  2 runs, each compiling; flex_attention's kernels; 6 steps of 6.3e13
    zb-h1                    2 s     5 s  skipped (needs 2 devices)
    grad-accum-fusion       10 s    15 s  CUDA start, 22 GEMMs of 7.4e11 FLOPs
    step-prediction         75 s    85 s  calibration 15 s, 2 runs' start-up, 8 steps of 1.2e13 each
About 7.5 minutes; the budgets add up to 505 s, so bench/gpu/device_command.sh (the wheelhouse's
install, this, the archive) ends within its 540 s; --deadline-s cuts the last checks' budgets to
the time left if the machine is slower. With 2 GPUs or more, parity's budget is 100 s and zb-h1
runs (85 s). With --cpu every check runs at toy sizes, eager, under 300 s each; with --cpu
--standin each is a CPU stand-in of a second (the device command's dry run).

Test hooks (hidden): --fail-row CHECK makes that check's training runs fail before their first
step, and --hang-row CHECK hang before their third (after two steps' metrics), through
launch/train.py's own fault hook (GPT3D_FAULT_INJECT=0:1, 0:3:hang): what a real failure or hang
does to the table (tests/analysis/test_gpu_check.py).
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from bench import REPO
# FAULT_ENV: launch/resilience/failure.py's, without importing torch (the dry run's processes skip it)
from bench.gpu.gpu_check_rows import CHECKS, ERROR, FAIL, FAULT_ENV, SKIPPED, TRAINING_CHECKS, error_row
from bench.gpu.gpu_check_runs import error_line

DEFAULT_JSON = REPO / "runs" / "gpu_check.json"  # runs/ is git-ignored
ONE_DOCUMENT = "one-document.jsonl"  # document-mask's corpus (gpu_check_rows.document_mask), not metrics
LOG_TAIL_LINES = 60  # of an ERROR row's log, in the JSON: a training run's traceback and its cause
# Seconds each check may take (the docstring's estimates, plus a margin); past it the check is
# stopped and is an ERROR row. On one GPU they add up to 505 s: with the wheelhouse's install and
# the archive, bench/gpu/device_command.sh ends within its 540 s.
GPU_BUDGET_S = {"parity": 50, "gpt2-mfu": 65, "llama-mfu": 90, "moe-mfu": 70, "document-mask": 125,
                "zb-h1": 5, "grad-accum-fusion": 15, "step-prediction": 85}  # zb-h1 is skipped on one GPU
# Two GPUs or more: parity's three runs, two of them through DeepSpeed's launcher; zb-h1's two at pp = 2.
MULTI_GPU_BUDGET_S = {"parity": 100, "zb-h1": 85}
CPU_BUDGET_S = 300  # a toy check on a loaded 2-core machine
STANDIN_BUDGET_S = 30  # --standin: a second's work, on a loaded machine
DEADLINE_RESERVE_S = 5  # --deadline-s: what is left after the last check, for the table and JSON


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="run the checks on CPU processes, at toy sizes")
    p.add_argument("--devices", type=int, help="devices to use (default: every GPU; with --cpu, 2 processes)")
    p.add_argument("--checks", default=",".join(CHECKS), help="comma-separated, of " + ", ".join(CHECKS))
    p.add_argument("--json-out", type=Path, default=DEFAULT_JSON,
                   help="the table as JSON (default %(default)s); the checks' logs go beside it")
    p.add_argument("--budget-scale", type=float, default=1.0,
                   help="multiply every check's time budget (default %(default)s)")
    p.add_argument("--deadline-s", type=float,
                   help="the whole run's wall limit: a check's budget is cut to the time left, and a check "
                        "with none left is a skipped row (bench/gpu/device_command.sh sets it)")
    p.add_argument("--eager", action="store_true",
                   help="no check compiles (what a machine where torch.compile cannot build kernels does)")
    p.add_argument("--standin", action="store_true",
                   help="a CPU stand-in of a second for each check: a dry run of the harness (with --cpu)")
    p.add_argument("--fail-row", choices=TRAINING_CHECKS, help=argparse.SUPPRESS)  # the test's hooks
    p.add_argument("--hang-row", choices=TRAINING_CHECKS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    unknown = [c for c in args.checks if c not in CHECKS]
    if unknown or not args.checks:
        p.error(f"--checks {','.join(unknown) or '(none)'}: choose from {','.join(CHECKS)}")
    if args.devices is not None and args.devices < 1:
        p.error(f"--devices {args.devices}: give 1 or more")
    if not args.budget_scale > 0:
        p.error(f"--budget-scale {args.budget_scale}: give a positive factor")
    if args.deadline_s is not None and not args.deadline_s > 0:
        p.error(f"--deadline-s {args.deadline_s}: give a positive number of seconds")
    if args.standin and not args.cpu:
        p.error("--standin: give --cpu too (the stand-ins run on CPU)")
    return args


def device_count(args: argparse.Namespace) -> int:
    """The devices the checks use: --devices, else every GPU (2 CPU processes with --cpu)."""
    if args.cpu:
        return args.devices or 2
    import torch
    found = torch.cuda.device_count()
    if found == 0:
        raise SystemExit("no GPU found (torch.cuda.device_count() == 0); use --cpu to check the script")
    if args.devices is not None and args.devices > found:
        print(f"error: --devices {args.devices}: this machine has {found} GPU(s); give at most {found}",
              file=sys.stderr)
        raise SystemExit(2)
    return args.devices or found


def device_name(args: argparse.Namespace, devices: int) -> str:
    if args.cpu:
        return f"{devices} CPU process(es)"
    import torch
    return f"{devices} x {torch.cuda.get_device_name(0)}"


def budget_s(check: str, devices: int, args: argparse.Namespace) -> float:
    if args.standin:
        seconds = STANDIN_BUDGET_S
    elif args.cpu:
        seconds = CPU_BUDGET_S
    else:
        seconds = MULTI_GPU_BUDGET_S.get(check, GPU_BUDGET_S[check]) if devices >= 2 else GPU_BUDGET_S[check]
    return seconds * args.budget_scale


# ---------------------------------------------------------------- one check, isolated

def run_isolated(check: str, args: argparse.Namespace, devices: int, workdir: Path, budget: float,
                 log: Path) -> List[dict]:
    """The check's rows, from a process of its own (bench/gpu/gpu_check_rows.py) in a session of its own.
    Past `budget` seconds, and in any case once it ends, its whole process group is killed (its
    training runs, DeepSpeed's ranks, the compiler's workers), so nothing it started outlives it
    or holds the GPU for the next check. A process that ends without rows (a crash) or is stopped
    is one ERROR row. Its training runs write their metrics into `workdir` (the logs' folder
    CHECK/), flushed every step: a stopped check keeps the steps it took, and every row names them."""
    rows_out = workdir / f"{check}.rows.json"
    cmd = [sys.executable, "-m", "bench.gpu.gpu_check_rows", check, "--devices", str(devices),
           "--workdir", str(workdir), "--rows-out", str(rows_out)] + \
        [flag for flag, on in (("--cpu", args.cpu), ("--eager", args.eager), ("--standin", args.standin)) if on]
    env = dict(os.environ)
    if check == args.fail_row:
        env[FAULT_ENV] = "0:1"  # rank 0 raises before step 1, in every training run of the check
    elif check == args.hang_row:
        env[FAULT_ENV] = "0:3:hang"  # rank 0 hangs before step 3, after writing two steps' metrics
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            kill_group(proc)
    kept = metrics_kept(workdir)
    if code is None:
        steps = sum(kept.values())
        rows = [error_row(check, f"stopped: over its budget of {budget:.3g} s (--budget-scale gives more); "
                                 f"kept {steps} step(s) of metrics in {len(kept)} file(s)")]
    elif rows_out.exists():
        rows = json.loads(rows_out.read_text())
    else:
        rows = [error_row(check, f"its process {exit_description(code)} without a row: {error_line(log.read_text())}")]
    tail = log_tail(log)
    return [dict(r, metrics=kept, **({"log_tail": tail} if r["status"] == ERROR else {})) for r in rows]


def metrics_kept(workdir: Path) -> Dict[str, int]:
    """Each metrics file under a check's folder (relative to the logs' folder) and its records."""
    return {str(path.relative_to(workdir.parent)): len(path.read_text().splitlines())
            for path in sorted(workdir.rglob("*.jsonl")) if path.name != ONE_DOCUMENT}


def log_tail(log: Path, lines: int = LOG_TAIL_LINES) -> List[str]:
    """The last `lines` lines of a check's log: the failed run's traceback and its one-line cause
    (gpu_check_runs.train prints the end of a failed run's output, then this process's traceback)."""
    return log.read_text(errors="replace").splitlines()[-lines:]


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to every process left in `proc`'s group (none, after a check that ended cleanly)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def exit_description(code: int) -> str:
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited {code}"


# ---------------------------------------------------------------- the table

def failed(rows: List[dict]) -> bool:
    return any(r["status"] in (FAIL, ERROR) for r in rows)


def gemm_paths_text(paths: Optional[dict]) -> str:
    if paths is None:
        return "unknown"
    return f"fusion {','.join(paths['fusion']) or '-'}; grouped {','.join(paths['grouped']) or '-'}"


def table_text(header: str, rows: List[dict]) -> str:
    columns = ("check", "row", "measured", "bar", "status", "note", "GEMM paths", "time / budget")
    cells = [columns] + [(r["check"], r["what"], r["measured"], r["bar"], r["status"], r["note"],
                          gemm_paths_text(r["gemm_paths"]), f"{r['wall_s']:.0f} / {r['budget_s']:.0f} s")
                         for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join([header] + ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip()
                                  for line in cells]) + "\n"


def git_commit() -> Optional[str]:
    try:
        proc = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True)
    except OSError:  # no git on the machine: the table comes without the commit
        return None
    return proc.stdout.strip() or None


def interrupt(signum, frame) -> None:
    """SIGTERM (a scheduler, `timeout`) does what Ctrl-C does: the running check's process group
    is killed (in a session of its own it would not get the signal) and the table still comes."""
    raise KeyboardInterrupt


def write_json(path: Path, summary: dict, rows: List[dict]) -> None:
    """Written whole each time (a crash of this process keeps the checks done so far)."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(dict(summary, rows=rows), indent=1) + "\n")
    tmp.replace(path)


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, interrupt)
    devices = device_count(args)
    logs = args.json_out.parent / f"{args.json_out.stem}-logs"
    logs.mkdir(parents=True, exist_ok=True)
    summary = {"device": device_name(args, devices), "devices": devices, "cpu": args.cpu,
               "date": time.strftime("%Y-%m-%d"), "commit": git_commit(), "checks": args.checks,
               "complete": False}
    start = time.perf_counter()
    rows: List[dict] = []
    interrupted = False
    for check in args.checks:
        budget = budget_s(check, devices, args)
        if args.deadline_s is not None:  # cut to the time left
            budget = min(budget, args.deadline_s - DEADLINE_RESERVE_S - (time.perf_counter() - start))
        began = time.perf_counter()
        if interrupted:
            found = [dict(error_row(check, "not run: interrupted"), status=SKIPPED)]
        elif args.deadline_s is not None and budget < 1:
            found = [dict(error_row(check, f"not run: no time left of --deadline-s {args.deadline_s:g}"),
                          status=SKIPPED)]
        else:
            print(f"{check} (budget {budget:.0f} s) ...", flush=True)
            (logs / check).mkdir(exist_ok=True)
            try:
                found = run_isolated(check, args, devices, logs / check, budget, logs / f"{check}.log")
            except KeyboardInterrupt:  # its process group is killed; the table still comes
                interrupted, found = True, [dict(error_row(check, "interrupted"), metrics=metrics_kept(logs / check))]
        wall = time.perf_counter() - began
        for r in found:  # a stopped or crashed check's GEMM paths are unknown: None
            rows.append({"check": check, **r, "gemm_paths": r.get("gemm_paths"), "wall_s": wall,
                         "budget_s": max(budget, 0), "log": str(logs / f"{check}.log")})
        print(f"  {', '.join(r['status'] for r in found)} in {wall:.0f} s", flush=True)
        write_json(args.json_out, dict(summary, wall_s=time.perf_counter() - start), rows)
    total = time.perf_counter() - start
    code = 130 if interrupted else 1 if failed(rows) else 0
    write_json(args.json_out, dict(summary, wall_s=total, complete=not interrupted, exit_code=code), rows)
    table = table_text(f"gpu_check on {summary['device']}, {summary['date']}, commit {summary['commit']}, "
                       f"{total:.0f} s", rows)
    args.json_out.with_suffix(".txt").write_text(table)
    print("\n" + table)
    print(f"JSON: {args.json_out}; the table: {args.json_out.with_suffix('.txt')}; each check's output: "
          f"{logs}/CHECK.log, its metrics and rows in {logs}/CHECK/")
    return code


if __name__ == "__main__":
    sys.exit(main())
