"""`--layout auto --auto-sweep K`: measure the planner's K fastest predicted
layouts for a few steps each and train the fastest measured, as NeMo's auto-configurator does
(predictions rank; a short run decides).

Each trial is a real run of launch/train.py at that layout (TRIAL_STEPS steps, nothing saved,
no evaluation, wandb off), started by every rank of the job as its own child process with the
job's variables and a fresh rendezvous port that rank 0 chose, so the trial's ranks form their
own process group on the same machines and devices. The parent has not started its process group
or touched a GPU yet, so the trial has the devices to itself. Rank 0 reads its trial's metrics
(the median step time after the warm-up) and every rank takes its answer (data/job_listing.py:
once_per_job). A trial that fails (out of memory, say) is reported and left out."""
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

from launch.errors import REPO_ROOT

TRIAL_STEPS = 5
WARM_UP = 2  # steps before the timed ones: start-up, first allocations, compilation
TRAIN_SCRIPT = REPO_ROOT / "launch" / "train.py"


def trial_command(args, candidate: Dict[str, int], metrics: Path) -> List[str]:
    """launch/train.py's command line for one trial: the recipe and its --set overrides, the
    candidate's layout (its virtual stages included), TRIAL_STEPS steps, its metrics to `metrics`,
    and none of the run's outputs."""
    command = [sys.executable, str(TRAIN_SCRIPT), "--recipe", str(args.recipe)]
    for override in args.overrides:
        command += ["--set", override]
    if args.seed is not None:
        command += ["--seed", str(args.seed)]
    command += ["--tp", str(candidate["tp"]), "--pp", str(candidate["pp"]), "--cp", str(candidate["cp"]),
                "--ep", str(candidate["ep"]), "--set", f"train.micro_batch_size={candidate['micro_batch']}",
                "--set", f"train.recompute={candidate['recompute']}", "--set", f"train.schedule={candidate['schedule']}",
                # The v the planner costed for it (after the recipe's --set: a trial runs the candidate's v).
                "--set", f"train.virtual_stages={candidate.get('virtual_stages', 1)}",
                "--steps", str(TRIAL_STEPS), "--set", "train.eval_every=0", "--wandb", "disabled",
                "--metrics-out", str(metrics)]
    return command


def measured_step_time(metrics: Path) -> Optional[float]:
    """The median step time after the warm-up of a trial's metrics, or None if it has too few steps."""
    if not metrics.exists():
        return None
    seconds = [json.loads(line)["step_time_s"] for line in metrics.read_text().splitlines() if line.strip()]
    return statistics.median(seconds[WARM_UP:]) if len(seconds) > WARM_UP else None


def run_trials(args, candidates: List[Dict[str, int]], ports: List[int]) -> List[Optional[float]]:
    """This rank's part of every trial, in order; rank 0's measured step times (None: failed)."""
    rank0 = os.environ.get("RANK", "0") == "0"
    times: List[Optional[float]] = []
    with tempfile.TemporaryDirectory(prefix="gpt3d-auto-sweep-") as work:
        for i, (candidate, port) in enumerate(zip(candidates, ports)):
            metrics, log = Path(work) / f"trial{i}.jsonl", Path(work) / f"trial{i}.log"
            env = dict(os.environ, MASTER_PORT=str(port))
            with open(log, "w") as out:
                done = subprocess.run(trial_command(args, candidate, metrics), env=env, stdout=out,
                                      stderr=subprocess.STDOUT)
            seconds = measured_step_time(metrics) if done.returncode == 0 else None
            times.append(seconds)
            if rank0:
                where = (f"measured {seconds:.4g} s a step" if seconds is not None else
                         f"failed (exit {done.returncode}): {_last_line(log)}")
                print(f"auto sweep {i + 1}/{len(candidates)}: {describe(candidate)}: predicted "
                      f"{candidate['step_time_s']:.4g} s, {where}", flush=True)
    return times


def describe(candidate: Dict[str, int]) -> str:
    return (f"tp {candidate['tp']}, pp {candidate['pp']}, cp {candidate['cp']}, dp {candidate['dp']}, "
            f"ep {candidate['ep']}, micro-batch {candidate['micro_batch']}, recompute {candidate['recompute']}"
            + (f", schedule {candidate['schedule']}" if candidate["pp"] > 1 else "")
            + (f", virtual stages {candidate['virtual_stages']}" if candidate.get("virtual_stages", 1) > 1 else ""))


def _last_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:200] if lines else "no output"


def fastest_measured(candidates: List[Dict[str, int]], times: List[Optional[float]]) -> Optional[int]:
    """The index of the fastest measured trial (the earlier, better predicted one on a tie), or None."""
    measured = [(t, i) for i, t in enumerate(times) if t is not None]
    return min(measured)[1] if measured else None
