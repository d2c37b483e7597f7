"""Where one training step's time goes, ours beside megatron-core's, on bench/peers/peers.py's job.

    .venv-megatron/bin/python bench/peers/step_parts.py [--arch gpt2] [--layout 2x1] [--steps 10] [--timed-from 3]
                                                        [--work DIR] [--set KEY=VALUE]

(.venv-megatron: bash bench/peers/peers_setup.sh.)

Ours: launch/train.py's own `run_training` in tp*pp processes (DeepSpeed's launcher), with
time.perf_counter around the pieces of a step, per rank and step (nothing else changes):
- inside `train_batch`: each DeepSpeed pipeline instruction (ForwardPass, BackwardPass, the
  p2p Send/Recv, LoadMicroBatch, ReduceGrads, ReduceTiedGrads, OptimizerStep) and, within
  OptimizerStep, torch AdamW's step and ZeRO's gradient norm, within BackwardPass ZeRO-1's
  per-parameter gradient hooks; and train_batch's own work around them: setting the data
  iterator, making the schedule, reserving pipe buffers, the instruction loop of _exec_schedule,
  the loss's aggregation and broadcast, the rest of train_batch;
- around it, launch/trainer/loop.py's per-step work: count_step_tokens (the step's draw and its
  token-count all-reduce), the device sync, the memory-peak reset and read, gather_step_numbers
  (an all-gather, which carries the stop requests too), the heartbeat's `completed`, the
  straggler watch, metrics.log, the stop request's `agreed`, the hang watchdog's `step_ended`; the rest of the loop
  iteration is what is left of the time from one train_batch start to the next.
megatron-core: bench/peers/megatron_peer.py on the same command line, which times its own parts.
Printed: ms per step, the mean over the steps from --timed-from on (so that the parts add up),
each rank's, then the mean over ranks; megatron-core's from its last stage's TP rank 0. Times
from CPU processes on a shared machine: compare runs made side by side. Results:
docs/performance.md, "Where a tp 2 step goes, ours against megatron-core".
"""
import argparse
import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench import REPO


# (module, attribute) of launch/trainer/loop.py's per-step calls, wrapped where the loop looks
# them up (its module globals, read at each call), before run_training runs.
LOOP_FUNCTIONS = {
    "count_step_tokens": ("launch.trainer.loop", "count_step_tokens"),
    "device sync": ("launch.trainer.loop", "synchronize_device"),
    "memory peak reset": ("launch.trainer.loop", "reset_step_memory_peak"),
    "memory peak read": ("launch.trainer.loop", "local_step_memory_peak"),
    "gather_step_numbers": ("launch.trainer.loop", "gather_step_numbers"),
    "after_moe_step": ("launch.trainer.loop", "after_moe_step"),
    "router loss scale": ("launch.trainer.loop", "set_router_loss_scale"),
    "loss_scale": ("launch.trainer.loop", "loss_scale"),
    "timed_train_batch": ("launch.trainer.loop", "timed_train_batch"),  # the draw, train_batch, the sync
}
LOOP_METHODS = {
    "heartbeat completed": ("launch.resilience.failure", "FailureWatcher", "completed"),
    "straggler watch": ("launch.instruments.stragglers", "StragglerWatch", "observe"),
    "metrics.log": ("launch.instruments.metrics", "MetricsLogger", "log"),
    "stop request agreed": ("launch.resilience.signals", "StopRequest", "agreed"),
    "hang step_ended": ("launch.resilience.hang_watchdog", "HangWatchdog", "step_ended"),
    "compute clock take": ("launch.instruments.compute_clock", "ComputeClock", "take"),
    "get_lr": ("deepspeed.runtime.pipe.engine", "PipelineEngine", "get_lr"),
    "get_global_grad_norm": ("deepspeed.runtime.pipe.engine", "PipelineEngine", "get_global_grad_norm"),
}

# PipelineEngine's methods train_batch calls around its instructions.
ENGINE_METHODS = ("set_dataiterator", "_train_schedule", "_reserve_pipe_buffers", "_exec_schedule",
                  "_aggregate_total_loss")

# What DeepSpeedZeroOptimizer's per-parameter gradient hook calls (stage_1_and_2.py,
# create_gradient_handling_hooks; count_used_parameters_in_backward is wrapped beside them).
ZERO_HOOK_METHODS = ("should_refresh_expected_hook_count", "reenter_backward_if_needed", "process_gradients",
                     "update_hook_state_and_maybe_run_epilogue")


class StepParts:
    """Seconds per named part, per step; a step runs from one train_batch start to the next."""

    def __init__(self):
        self.steps, self.current, self.started = [], collections.Counter(), None

    def timed(self, name, fn):
        from bench.peers.timed_calls import timed_into
        return timed_into(self.current, name, fn)  # self.current is emptied in place at every step

    def step_starts(self):
        now = time.perf_counter()
        if self.started is not None:
            self.current["loop iteration"] = now - self.started
            self.steps.append(dict(self.current))
        self.current.clear()
        self.started = now

    def install(self):
        import importlib

        import torch
        from deepspeed.runtime.pipe.engine import PipelineEngine
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
        for name, (module, attr) in LOOP_FUNCTIONS.items():
            module = importlib.import_module(module)
            setattr(module, attr, self.timed(name, getattr(module, attr)))
        for name, (module, cls, attr) in LOOP_METHODS.items():
            cls = getattr(importlib.import_module(module), cls)
            setattr(cls, attr, self.timed(name, getattr(cls, attr)))
        for attr in ENGINE_METHODS:  # train_batch's own work besides the instructions
            setattr(PipelineEngine, attr, self.timed(f"engine.{attr}", getattr(PipelineEngine, attr)))
        for instruction, method in list(PipelineEngine._INSTRUCTION_MAP.items()):
            PipelineEngine._INSTRUCTION_MAP[instruction] = self.timed(f"engine {instruction.__name__}", method)
        # before the engine exists: torch wraps an optimizer class's step when it is instantiated
        torch.optim.AdamW.step = self.timed("AdamW step", torch.optim.AdamW.step)
        DeepSpeedZeroOptimizer.scaled_global_norm = self.timed("ZeRO grad norm", DeepSpeedZeroOptimizer.scaled_global_norm)
        # ZeRO-1's hook on every parameter's gradient, run inside each BackwardPass (its parts are
        # looked up on the optimizer and the module at each call, so wrapping them times every call)
        from deepspeed.runtime.zero import stage_1_and_2
        for attr in ZERO_HOOK_METHODS:
            setattr(DeepSpeedZeroOptimizer, attr, self.timed("ZeRO grad hooks", getattr(DeepSpeedZeroOptimizer, attr)))
        stage_1_and_2.count_used_parameters_in_backward = self.timed(
            "ZeRO grad hooks", stage_1_and_2.count_used_parameters_in_backward)
        train_batch = self.timed("train_batch", PipelineEngine.train_batch)

        def starting_step(engine, *args, **kwargs):
            self.step_starts()
            return train_batch(engine, *args, **kwargs)
        PipelineEngine.train_batch = starting_step


def run_rank(train_argv, out_dir: Path) -> int:
    """Inside one launched process: time the parts, train as launch/train.py does, write them."""
    from launch.config.cli import parse_training_args
    from launch.trainer.loop import run_training
    from launch.trainer.startup import prepare_training_job
    parts = StepParts()
    parts.install()
    job = prepare_training_job(parse_training_args(train_argv))
    run_training(job)
    parts.step_starts()  # closes the last step (its iteration then ends at the loop's end)
    (out_dir / f"ours-rank{os.environ['RANK']}.json").write_text(json.dumps(parts.steps))
    return 0


def means(steps, timed_from):
    """Each part's mean over the timed steps (means, not medians: the parts then add up)."""
    names = sorted({n for s in steps for n in s})
    return {n: statistics.fmean(s.get(n, 0.0) for s in steps[timed_from - 1:]) for n in names}


def ours_rows(per_rank):
    """Mean over ranks of each part's mean, with the derived remainders."""
    names = sorted({n for r in per_rank for n in r})
    mean = {n: statistics.fmean(r.get(n, 0.0) for r in per_rank) for n in names}
    instructions = sum(v for n, v in mean.items() if n.startswith("engine "))
    loop_parts = [n for n in LOOP_FUNCTIONS if n in mean] + [n for n in LOOP_METHODS if n in mean]
    rows = {"loop iteration (whole step)": mean["loop iteration"], "train_batch": mean["train_batch"]}
    rows.update({n: v for n, v in mean.items() if n.startswith("engine ")})
    rows["  of OptimizerStep: AdamW step"] = mean.get("AdamW step", 0.0)
    rows["  of OptimizerStep: ZeRO grad norm"] = mean.get("ZeRO grad norm", 0.0)
    rows["  of BackwardPass: ZeRO grad hooks"] = mean.get("ZeRO grad hooks", 0.0)
    engine = {a: mean.get(f"engine.{a}", 0.0) for a in ENGINE_METHODS}
    for attr in ("set_dataiterator", "_train_schedule", "_reserve_pipe_buffers", "_aggregate_total_loss"):
        rows[f"engine: {attr}"] = engine[attr]
    # _exec_schedule = reserving the buffers + the instructions + its own loop over them
    rows["engine: _exec_schedule's own loop"] = engine["_exec_schedule"] - engine["_reserve_pipe_buffers"] - instructions
    rows["engine: rest of train_batch"] = mean["train_batch"] - sum(
        engine[a] for a in ("set_dataiterator", "_train_schedule", "_exec_schedule", "_aggregate_total_loss"))
    inside = ("count_step_tokens", "device sync")  # called within timed_train_batch
    rows.update({f"loop: {n}": mean[n] for n in loop_parts if n != "timed_train_batch"})
    rows["loop: timed_train_batch - train_batch - its draw and sync"] = (
        mean["timed_train_batch"] - mean["train_batch"] - sum(mean[n] for n in inside))
    rows["loop: rest"] = mean["loop iteration"] - mean["timed_train_batch"] - sum(
        mean[n] for n in loop_parts if n not in inside + ("timed_train_batch",))
    return rows


def megatron_rows(steps, timed_from):
    timed = steps[timed_from - 1:]
    periods = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(steps[timed_from - 2:], timed)]
    part = {n: statistics.fmean(s["parts_s"][n] for s in timed) for n in timed[0]["parts_s"]}
    rows = {"loop iteration (whole step)": statistics.fmean(periods),
            "forward_backward (schedule)": part["forward_backward"], "  forward_step": part["forward"],
            "  backward_step": part["backward"],
            "  schedule rest (p2p, dispatch)": part["forward_backward"] - part["forward"] - part["backward"],
            "embedding grads all-reduce": part["embedding_grads"], "optimizer (AdamW + lr)": part["optimizer"],
            "zero_grad": part["zero_grad"]}
    rows["loop: rest"] = rows["loop iteration (whole step)"] - statistics.fmean(s["step_time_s"] for s in timed)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="gpt2", choices=("gpt2", "llama"))
    p.add_argument("--layout", default="2x1", help="TxP: tp T, pp P on T*P processes (default %(default)s)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--timed-from", type=int, default=3)
    p.add_argument("--work", type=Path, default=Path("/tmp/step_parts"))
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="one more recipe override for both sides (repeatable), e.g. train.zero_stage=0")
    argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # DeepSpeed's launcher adds it
    if argv[:1] == ["--rank-of"]:  # inside the launcher: --rank-of DIR, then launch/train.py's argv
        return run_rank(argv[2:], Path(argv[1]))
    args = p.parse_args(argv)

    from bench.peers.peers import launch, train_argv as peers_argv, write_hf_checkpoint
    tp, pp = map(int, args.layout.split("x"))
    args.work.mkdir(parents=True, exist_ok=True)
    hf_dir = args.work / f"{args.arch}-hf"
    if not hf_dir.exists():
        write_hf_checkpoint(peers_argv(args.arch, tp, pp, args.steps, hf_dir, args.work / "unused.jsonl"), hf_dir)
    ours_argv = peers_argv(args.arch, tp, pp, args.steps, hf_dir, args.work / "ours.jsonl", args.overrides)
    launch(Path(__file__).resolve(), tp * pp, ["--rank-of", str(args.work)] + ours_argv, threads=1)
    launch(REPO / "bench" / "peers" / "megatron_peer.py", tp * pp,
           peers_argv(args.arch, tp, pp, args.steps, hf_dir, args.work / "megatron.jsonl", args.overrides), threads=1)
    per_rank = [means(json.loads((args.work / f"ours-rank{r}.json").read_text()), args.timed_from)
                for r in range(tp * pp)]
    megatron = megatron_rows([json.loads(line) for line in (args.work / "megatron.jsonl").read_text().splitlines()],
                             args.timed_from)
    print(f"\n{args.arch} tp {tp} pp {pp}, ms per step (mean of steps {args.timed_from}..{args.steps}; "
          f"ours: mean over its {tp * pp} ranks, megatron-core: its last stage's TP rank 0)")
    print("ours")
    for name, seconds in ours_rows(per_rank).items():
        print(f"  {name:<48}{seconds * 1e3:>9.1f}")
    print("megatron-core")
    for name, seconds in megatron.items():
        print(f"  {name:<48}{seconds * 1e3:>9.1f}")
    print(json.dumps({"ours": ours_rows(per_rank), "ours_by_rank": per_rank, "megatron": megatron}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
