"""Fault soak: hit a random rank at random moments with a random fault, resume each time, and
compare the result with an uninterrupted run bit for bit: every step's loss and gradient norm,
the final weights and the optimizer state (the method and results: docs/performance.md, "Fault
soak"). The faults:
- kill: SIGKILL (an OOM kill, a segfault, a lost node);
- freeze: SIGSTOP, as a hung GPU or a wedged host falls silent; the others must leave by the
  heartbeat (train.heartbeat_timeout_s, 10 s here), then SIGCONT lets the frozen rank see it was
  declared lost and leave without writing;
- term: SIGTERM (a preemption): the job saves after the step and exits 0.

    python bench/faults/fault_soak.py [--steps 8] [--faults 5] [--kinds kill,freeze,term] [--seed 3] [--keep DIR]

The seed fixes every random choice (which fault, which rank, after which step, how long after
it); where the fault lands in the step depends on the machine's timing."""
import argparse
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import psutil
import torch

from bench import REPO
from launch.checkpoints.safe_io import load_safely
from launch.engine.distributed import launcher_command

TINY = REPO / "recipes" / "tiny.yaml"
WORLD = 2  # tp=1 pp=2
HEARTBEAT_TIMEOUT_S = 10  # a frozen rank is declared lost this long after its last heartbeat
KINDS = ("kill", "freeze", "term")


def train_args(run_dir: Path, steps: int, resume: bool, overrides: Sequence[str] = ()) -> List[str]:
    """`launch/train.py`'s arguments: tiny at pp 2 saving every step into run_dir/ck; with
    `resume`, the one command a scheduler would rerun after every fault: `--save ck --load ck`,
    which starts at step 1 while ck holds no checkpoint (docs/resilience.md, "Requeues")."""
    ck = run_dir / "ck"
    args = ["--recipe", str(TINY), "--pp", "2", "--steps", str(steps),
            "--save", str(ck), "--save-every", "1", "--metrics-out", str(run_dir / "metrics.jsonl"),
            "--set", f"train.heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S}"] + [a for o in overrides for a in ("--set", o)]
    return args + (["--load", str(ck)] if resume else [])


def start(run_dir: Path, steps: int, resume: bool, overrides: Sequence[str] = ()) -> subprocess.Popen:
    """`deepspeed --num_gpus 2 launch/train.py` with `train_args`, its output in run_dir/log.txt."""
    cmd = launcher_command(WORLD, REPO / "launch" / "train.py") + train_args(run_dir, steps, resume, overrides)
    log = open(run_dir / "log.txt", "a")
    return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)


def rank_process(launcher: subprocess.Popen, rank: int) -> Optional[psutil.Process]:
    for p in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if f"--local_rank={rank}" in p.cmdline():
                return p
        except psutil.NoSuchProcess:
            pass
    return None


def steps_logged(metrics: Path) -> int:
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def end(job: subprocess.Popen, timeout: float = 180) -> int:
    """Wait for the launcher; if it hangs, kill what is left of this job (ours only)."""
    try:
        return job.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        for p in psutil.Process(job.pid).children(recursive=True):
            p.kill()
        job.kill()
        job.wait()
        raise RuntimeError(f"the job did not end within {timeout} s of the kill")


def latest_step(run_dir: Path) -> int:
    latest = run_dir / "ck" / "latest"
    return int(latest.read_text()[len("step"):]) if latest.exists() else 0


def gone(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def hit(job: subprocess.Popen, victim: psutil.Process, kind: str) -> None:
    """Deliver fault `kind` to `victim`; for a freeze, wait until every other rank has left (by
    the heartbeat), then let the frozen one run again to see it was declared lost (unless a
    sibling on its host killed it, so that the launcher could end the job)."""
    if kind == "kill":
        victim.kill()
    elif kind == "term":
        victim.send_signal(signal.SIGTERM)
    else:
        victim.suspend()
        others = [rank_process(job, r) for r in range(WORLD)]
        others = [p for p in others if p is not None and p.pid != victim.pid]
        deadline = time.time() + HEARTBEAT_TIMEOUT_S + 60
        while not all(gone(p) for p in others):
            if time.time() > deadline:
                victim.resume()
                raise RuntimeError(f"the other ranks did not leave within {HEARTBEAT_TIMEOUT_S + 60} s of a freeze")
            time.sleep(0.1)
        try:  # a sibling on its host has usually killed it already (launch/resilience/failure.py)
            victim.resume()
        except psutil.NoSuchProcess:
            pass


def fault_once(run_dir: Path, steps: int, planned: int, rank: int, fraction: float,
               kind: str = "kill", overrides: Sequence[str] = ()) -> Optional[Dict[str, object]]:
    """Start (or resume) the run; once it logs step `planned` (or the first step after its
    checkpoint, if that is later), wait `fraction` of two step times (a step and its save) and
    hit rank `rank` with fault `kind`; wait for the job to end. Returns what happened, or None if
    no step before the last is left to hit."""
    metrics, resumed_at = run_dir / "metrics.jsonl", latest_step(run_dir)
    target = max(planned, resumed_at + 1)
    if target >= steps:
        return None
    launched = time.time_ns()
    job = start(run_dir, steps, resume=True, overrides=overrides)

    def reached() -> bool:  # the metrics file as this launch rewrote it, not the killed run's
        return metrics.exists() and metrics.stat().st_mtime_ns > launched and steps_logged(metrics) >= target
    deadline = time.time() + 600
    while not reached():
        if job.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"the run ended or stalled before step {target}: see {run_dir / 'log.txt'}")
        time.sleep(0.02)
    delay = fraction * 2 * json.loads(metrics.read_text().splitlines()[target - 1])["step_time_s"]
    time.sleep(delay)
    victim = rank_process(job, rank)
    if victim is None or job.poll() is not None:
        raise RuntimeError(f"rank {rank} was gone before the fault: see {run_dir / 'log.txt'}")
    at = steps_logged(metrics)
    mid_save = any(not (d / "complete.json").exists() for d in (run_dir / "ck").glob("step*"))
    hit_at = time.time()
    hit(job, victim, kind)
    exit_code = end(job)
    return {"kind": kind, "rank": rank, "resumed_at": resumed_at, "after_step": at, "delay_s": round(delay, 3),
            "mid_save": mid_save, "launcher_exit": exit_code, "ended_s": round(time.time() - hit_at, 1),
            "latest_after": latest_step(run_dir)}


def last_record_per_step(metrics: Path) -> Dict[int, dict]:
    records = {}
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        records[record["step"]] = record
    return records


def tensors(obj, prefix: str = "") -> Iterator[Tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            yield from tensors(obj[key], f"{prefix}/{key}")
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            yield from tensors(item, f"{prefix}/{i}")


def checkpoint_files(tag_dir: Path) -> List[str]:
    """The layer files (fp32 weights) and ZeRO optimizer files (master weights, Adam moments)."""
    return sorted(p.name for p in tag_dir.glob("layer_*")) + sorted(p.name for p in tag_dir.glob("*optim_states.pt"))


def compare_checkpoints(a: Path, b: Path) -> List[str]:
    """Differences between the tensors of two checkpoints' layer and optimizer files."""
    names = checkpoint_files(a)
    if not names or names != checkpoint_files(b):
        return [f"different files: {names} vs {checkpoint_files(b)}"]
    problems = []
    for name in names:
        x, y = dict(tensors(load_safely(a / name))), dict(tensors(load_safely(b / name)))
        if x.keys() != y.keys():
            problems.append(f"{name}: different tensors")
        problems += [f"{name}{key}" for key in x if key in y and not torch.equal(x[key], y[key])]
    return problems


def soak(work: Path, steps: int, kills: int, seed: int,
         reference: Optional[Tuple[Path, Path]] = None, kinds: Tuple[str, ...] = ("kill",),
         overrides: Sequence[str] = (), last_resume: Optional[Callable[[Path, List[str]], int]] = None
         ) -> Dict[str, object]:
    """Run the soak in `work` with `kills` faults of `kinds`; `reference` = (metrics file, final
    checkpoint directory) of an uninterrupted run of the same command, or None to run it here;
    `last_resume(run_dir, train_args)`, the exit code of the resume after the last fault, if not
    DeepSpeed's launcher (the test suite forks its ranks: nothing hits that one). Returns the report."""
    started = time.time()
    if reference is None:
        ref_dir = work / "uninterrupted"
        ref_dir.mkdir(parents=True)
        if end(start(ref_dir, steps, resume=False, overrides=overrides), timeout=900) != 0:
            raise RuntimeError(f"the uninterrupted run failed: see {ref_dir / 'log.txt'}")
        reference = (ref_dir / "metrics.jsonl", ref_dir / "ck" / f"step{steps:08d}")
    reference_s = time.time() - started
    run_dir = work / "killed"
    run_dir.mkdir(parents=True)
    rng = random.Random(seed)
    # Kills after steps 1 .. N-2, so that most land before the last step (a slow machine can
    # still finish it first: then the kill hits the job's shutdown, and the report says so).
    plan = [(step, rng.randrange(WORLD), rng.random())
            for step in sorted(rng.sample(range(1, max(steps - 1, 2)), kills))]
    kind_rng = random.Random(f"{seed} kinds")  # its own generator: the plan above does not depend on the kinds
    kinds_drawn = [kinds[0] if len(kinds) == 1 else kind_rng.choice(kinds) for _ in plan]
    events = [e for e in (fault_once(run_dir, steps, *planned, kind, overrides)
                          for planned, kind in zip(plan, kinds_drawn)) if e is not None]
    if latest_step(run_dir) < steps:
        code = (end(start(run_dir, steps, resume=True, overrides=overrides), timeout=900) if last_resume is None
                else last_resume(run_dir, train_args(run_dir, steps, resume=True, overrides=overrides)))
        if code != 0:
            raise RuntimeError(f"the last resume failed: see {run_dir / 'log.txt'}")
    ref, got = last_record_per_step(reference[0]), last_record_per_step(run_dir / "metrics.jsonl")
    differing = [s for s in range(1, steps + 1)
                 if s not in got or (ref[s]["loss"], ref[s]["grad_norm"]) != (got[s]["loss"], got[s]["grad_norm"])]
    problems = compare_checkpoints(reference[1], run_dir / "ck" / f"step{steps:08d}")
    return {"steps": steps, "kills": len(events), "seed": seed, "events": events, "steps_logged": sorted(got),
            "steps_differing": differing, "tensors_differing": problems,
            "tensor_files_compared": len(checkpoint_files(reference[1])),
            "bitwise_equal": not differing and not problems,
            "reference_s": round(reference_s, 1), "soak_s": round(time.time() - started - reference_s, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8, help="N, the run's steps (default: %(default)s)")
    p.add_argument("--faults", type=int, default=5, help="K, faults (default: %(default)s)")
    p.add_argument("--kinds", default=",".join(KINDS), help="the faults drawn from (default: %(default)s)")
    p.add_argument("--seed", type=int, default=3, help="fixes the plan (default %(default)s)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="a recipe override for every run of the soak, e.g. --set train.async_save=true (repeatable)")
    p.add_argument("--keep", type=Path, help="work in this directory and keep it (default: a temporary one)")
    args = p.parse_args()
    if not 1 <= args.faults <= args.steps - 2:
        p.error(f"--faults {args.faults} must be between 1 and --steps - 2 = {args.steps - 2}")
    kinds = tuple(args.kinds.split(","))
    if not kinds or any(k not in KINDS for k in kinds):
        p.error(f"--kinds {args.kinds!r}: a comma-separated choice of {', '.join(KINDS)}")
    work = args.keep or Path(tempfile.mkdtemp(prefix="fault_soak-"))
    try:
        report = soak(work, args.steps, args.faults, args.seed, kinds=kinds, overrides=args.overrides)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"fault soak: N={report['steps']} steps, K={report['kills']} faults ({args.kinds}), seed {report['seed']}, "
          f"tp=1 pp=2 on {WORLD} CPU processes, heartbeat timeout {HEARTBEAT_TIMEOUT_S} s")
    for i, e in enumerate(report["events"], 1):
        print(f"  fault {i}: launch resumed at step {e['resumed_at']}, rank {e['rank']} hit by {e['kind']} "
              f"{e['delay_s']} s after step {e['after_step']} was logged{' (during a save)' if e['mid_save'] else ''}; "
              f"launcher exit {e['launcher_exit']} {e['ended_s']} s later, latest checkpoint then step {e['latest_after']}"
              f"{' (the run had already finished)' if e['latest_after'] == report['steps'] else ''}")
    print(f"  steps logged: {report['steps_logged']}; losses/grad norms differing at steps: "
          f"{report['steps_differing']}")
    print(f"  final checkpoint: {report['tensor_files_compared']} layer/optimizer files compared, tensors differing: "
          f"{report['tensors_differing'] or 'none'}")
    print(f"  result: {'bitwise equal to the uninterrupted run' if report['bitwise_equal'] else 'DIFFERENT'} "
          f"(uninterrupted run {report['reference_s']} s, killed-and-resumed runs {report['soak_s']} s)")
    sys.exit(0 if report["bitwise_equal"] else 1)


if __name__ == "__main__":
    main()
