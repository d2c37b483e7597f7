"""The training run of a checked job (launch/trainer/startup.py), in the shape of torchtitan's
Trainer (torchtitan/train.py): `Trainer.__init__` starts the rank and builds everything up to the
first step, `train_step` is one step, `train` runs the steps until the last or an agreed stop
signal, and `close` ends the run on every rank."""
from __future__ import annotations

import dataclasses
import os
import time
from typing import TYPE_CHECKING, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from data.reading import reading_now
from launch.autotune.step_prediction import predict_step_time
from launch.checkpoints import store
from launch.checkpoints.async_save import AsyncSaver
from launch.config.layout import runs_zero_bubble
from launch.engine.compiler import blocks_to_compile
from launch.engine.distributed import shut_down_distributed, start_rank
from launch.engine.engine import build_engine, print_role_map
from launch.engine.experts import after_moe_step, set_router_loss_scale
from launch.engine.zero_bubble import check_weight_passes_ran
from launch.evaluation.task_scoring import score_tasks, task_sequences
from launch.evaluation.validation import validation_record
from launch.feed.replica_reader import replica_reader_groups
from launch.feed.run_inputs import resolved_recipe_dict
from launch.feed.step_tokens import RouterTokens, count_step_tokens
from launch.instruments.comm_counter import install_comm_counter
from launch.instruments.compute_clock import install_compute_clock
from launch.instruments.metrics import (MetricsLogger, RunArithmetic, is_logging_rank, local_step_memory_peak,
                                        loss_scale, reset_step_memory_peak, run_arithmetic, synchronize_device)
from launch.instruments.stragglers import (StepNumbers, StragglerWatch, gather_rank_roles, gather_step_numbers,
                                           in_pass_group)
from launch.optim.grad_norm import last_grad_norm
from launch.resilience.failure import FailureWatcher, fault_injection, maybe_inject_fault
from launch.resilience.hang_line import stacks_dir
from launch.resilience.hang_watchdog import HangWatchdog
from launch.resilience.restarts import StartRecord
from launch.resilience.signals import StopRequest
from launch.trainer.resume import restore
from launch.trainer.startup import TrainingJob
from launch.trainer.step_record import step_record
from model.parallel.context_parallel import sequence_shards
from model.parallel.state import init_parallel_state

if TYPE_CHECKING:  # annotations only
    from pathlib import Path

    from deepspeed.runtime.pipe.engine import PipelineEngine
    from launch.evaluation.task_scoring import TaskSequences
    from model.parallel.state import ParallelState


def run_training(job: TrainingJob) -> None:
    """Train `job` on this rank (launch/train.py calls it on every rank). A failure raises out of
    here without `close`: launch/resilience/failure.py stops every rank."""
    trainer = Trainer(job)
    trainer.train()
    trainer.close()


class Trainer:
    """One rank's training run. Every rank builds, steps and closes in the same order: the
    collectives (all-gathers, validation, saves) line up across ranks."""

    def __init__(self, job: TrainingJob):
        self.job = job
        self.args, self.recipe, self.layout, self.data = job.args, job.recipe, job.layout, job.data
        args, recipe, layout, data, train_cfg = job.args, job.recipe, job.layout, job.data, job.recipe.train
        self.steps = train_cfg.steps
        start_rank(layout.world_size, train_cfg.dist_timeout_s)
        rank = int(os.environ["RANK"])

        # One rank fails, falls silent or hangs: all stop.
        self.hang = HangWatchdog(rank, layout.world_size, stacks_dir(args.save, args.metrics_out),
                                 train_cfg.hang_timeout_s, train_cfg.first_step_timeout_s or 0.8 * train_cfg.dist_timeout_s,
                                 save_timeout_s=train_cfg.save_timeout_s,
                                 stall_timeout_s=recipe.data.stall_timeout_s or 0.8 * train_cfg.dist_timeout_s,
                                 reading_now=reading_now)  # a stall's line names what the data reads
        self.watcher = FailureWatcher(rank, layout.world_size, train_cfg.heartbeat_timeout_s, self.hang)
        self.starts = StartRecord.begin(args.save, job.resume_from, rank)  # rank 0's, in DIR/starts.jsonl
        self.fault = fault_injection()  # a test hook, None unless GPT3D_FAULT_INJECT is set

        # The model, its engine and what watches it.
        self.state = state = init_parallel_state(layout.tp, layout.pp, layout.cp, layout.ep,
                                                 experts=recipe.model.moe.enabled)
        self.logging_rank = is_logging_rank(state.global_rank)
        self.config = recipe.gpt_config(job.vocab_size, data.tokenizer.eos_token_id)
        compiled = blocks_to_compile(train_cfg.compile, get_accelerator().device_name(), self.logging_rank)
        self.engine, self.own_grad_norm = build_engine(recipe, layout, state, self.config, compiled,
                                                       init_from_hf=args.init_from_hf, verbose=args.verbose)
        if self.logging_rank:
            print_role_map(recipe, layout, state, self.config, self.engine.module)
        install_comm_counter(self.engine, state, args.comm_counts)  # does nothing without --comm-counts
        self.compute_clock = install_compute_clock(self.engine, state.global_rank)
        self.stragglers = StragglerWatch(**gather_rank_roles(state.pp_rank, in_pass_group(state)),
                                         group_kind="tensor/context/expert-parallel" if layout.ep > 1
                                         else "tensor/context-parallel")
        self.timeline = timeline_recorder(self.engine, args.timeline, args.timeline_steps, self.steps, state)

        self.hang.start()  # from here the run is timed: a load file by file, then each step and phase by its rule
        with self.hang.phase("load"):
            self.first_step, self.samples = restore(self.engine, job.resume_from, layout, state, self.config,
                                                    self.logging_rank, self.hang.progress)
        self.saved_recipe = resolved_recipe_dict(recipe, job.vocab_size)

        # The data: the run's batches, fed to the engine.
        # The data's own position: samples since its order began (not the run's, after --restart-data).
        self.batches = data.train_batches(state.dp_rank, layout.dp, start_sample=self.samples - job.data_origin_samples,
                                          data_state=job.data_state)
        self.device = torch.device(get_accelerator().current_device_name())
        # The CP ranks of a replica drew the same samples (same dp rank); each keeps its sequence shard.
        # One rank of each replica reads; the others drawing micro-batches receive them (launch/feed/replica_reader.py).
        # Each draw is a data wait, bounded by data.stall_timeout_s rather than the step's bound.
        drawn = data.feed(self.batches, *replica_reader_groups(state, data.streamed), self.device)
        self.feed = sequence_shards(self.hang.timed_draws(drawn), state.cp_rank, state.cp_size)

        # What each step reports, and how a run stops early.
        # The run summary prints it, with the planner's step time for this layout (rank 0 plans it).
        prediction = predict_step_time(recipe, layout, job.vocab_size) if self.logging_rank else None
        arithmetic = run_arithmetic(self.config, layout, recipe.seq_len, self.steps, prediction,
                                    train_cfg.virtual_stages)
        self.tokens_per_step = arithmetic.tokens_per_step
        self.stop = StopRequest(state.global_rank, train_cfg.stop_grace_s)
        # train.async_save: saves return after a host snapshot; one background write at a time.
        self.saver = AsyncSaver(train_cfg.dist_timeout_s) if train_cfg.async_save and args.save else None
        self.start_ended: Optional[Tuple[int, bool]] = None  # an async final save: recorded once committed
        self.metrics = metrics_logger(job, arithmetic, self.first_step) if self.logging_rank else None
        # With experts every stage's routers learn which tokens count (launch/feed/step_tokens.py).
        self.routers = (RouterTokens((layout.micro_batch_size, recipe.seq_len // layout.cp), layout.cp)
                        if recipe.model.moe.enabled else None)
        report = data.repeat_report(self.steps)  # a mixture says once which sources repeat, and how often
        if report is not None and self.logging_rank:
            print(report, flush=True)
        self.tasks = task_sequences(job.tasks, data.tokenizer, recipe.seq_len)  # tokenized once, scored every eval.every

    def train(self) -> None:
        """The steps from the first (1, or the one after the checkpoint's) to the last, or to the
        step after which the ranks agreed to stop."""
        for step in range(self.first_step, self.steps + 1):
            if self.train_step(step):
                break

    def train_step(self, step: int) -> bool:
        """Train, gather every rank's numbers, validate and score when due, log, save when due;
        True when the ranks agreed to stop after this step."""
        lr = self.engine.get_lr()[0]  # the rate this step uses; the scheduler advances after it
        maybe_inject_fault(self.fault, self.state.global_rank, step)
        loss, seconds, data_wait_s = self.run_batch(step)
        # An all-gather (every rank calls it), which carries the ranks' stop requests too.
        numbers = gather_step_numbers(self.compute_clock.take(), data_wait_s, *local_step_memory_peak(),
                                      self.stop.signalled, self.device)
        self.samples += self.layout.global_batch_size
        record = self.record(step, loss, lr, seconds, numbers)
        if self.validation_due(step):
            with self.hang.phase("validation"):
                record.update(validation_record(self.engine, self.data, self.state, self.layout,
                                                self.recipe.train.eval_batches, self.device, self.logging_rank,
                                                self.hang.progress))
        if self.tasks_due(step):
            with self.hang.phase("tasks"):
                record["tasks"] = task_record(self.engine, self.job, self.tasks, self.state, self.device,
                                              self.hang.progress)
        if self.metrics is not None:
            for line in self.stragglers.observe(step, numbers.compute_s, numbers.data_wait_s, seconds):
                print(line, flush=True)
            self.metrics.log(record)
        stopping = self.stop.agreed(numbers.stop_requested)
        if self.save_due(step, stopping):
            self.save(step, stopping)
        if stopping and self.logging_rank:
            print(f"stopped by signal after step {step}", flush=True)
        return stopping

    def run_batch(self, step: int) -> Tuple[torch.Tensor, float, float]:
        """(loss, seconds, seconds this rank waited for data) of the engine's `train_batch` on the
        step's micro-batches, drawn as it asks for them."""
        reset_step_memory_peak()
        waited_before = self.data_waited_s()
        self.compute_clock.start_step()
        set_router_loss_scale(self.engine, self.layout)  # the fp16 loss scale may have changed after the last step
        # The step's loss is its mean over every counted token (model/gpt/pipe.py: TokenMeanLoss).
        loss, seconds = timed_train_batch(self.engine, lambda: count_step_tokens(
            self.engine, self.feed, self.layout.grad_accum_steps, self.routers))
        self.hang.step_ended()
        if step == self.first_step and runs_zero_bubble(self.recipe.train.schedule, self.layout.pp):
            check_weight_passes_ran(self.engine)  # the hooks took: W passes computed weight gradients
        self.watcher.completed(step)  # the heartbeat names it if this rank is lost later
        return loss, seconds, self.data_waited_s() - waited_before

    def data_waited_s(self) -> float:
        """Seconds drawing from the data has waited so far: streamed data times its draws
        (data/streaming.py); data in memory never waits."""
        return getattr(self.batches, "waited_s", 0.0)

    def record(self, step: int, loss: torch.Tensor, lr: float, seconds: float, numbers: StepNumbers) -> Dict:
        """The step's metrics record (launch/trainer/step_record.py), with the experts' and the data's
        numbers (collective with experts: every rank calls it)."""
        layout_choice = self.job.layout_choice if step == self.first_step else None  # --layout auto: what it chose, and why
        record = step_record(step, self.samples, loss.item(), last_grad_norm(self.engine, self.own_grad_norm), lr,
                             loss_scale(self.engine), seconds, self.tokens_per_step, numbers, self.stragglers.stages,
                             dataclasses.asdict(layout_choice) if layout_choice is not None else None,
                             self.args.metrics_per_rank)
        record.update(after_moe_step(self.engine, self.config, self.layout))  # collective; {} without experts
        record.update(self.data.step_record(self.samples - self.job.data_origin_samples))
        return record

    def validation_due(self, step: int) -> bool:
        eval_every = self.recipe.train.eval_every
        return bool(eval_every) and (step % eval_every == 0 or step == self.steps)

    def tasks_due(self, step: int) -> bool:
        every = self.recipe.eval.every
        return bool(self.job.tasks) and ((bool(every) and step % every == 0) or step == self.steps)

    def save_due(self, step: int, stopping: bool) -> bool:
        save_every = self.args.save_every
        return bool(self.args.save) and (stopping or step == self.steps or bool(save_every and step % save_every == 0))

    def save(self, step: int, stopping: bool) -> None:
        """A checkpoint after `step` (collective: every rank writes its shards); the last one of a
        start also ends its line in DIR/starts.jsonl."""
        job, metrics, saver = self.job, self.metrics, self.saver
        with self.stop.saving(), self.hang.phase("save"):  # a save has its own bound, and a stop request waits for it
            if saver is not None:
                saver.wait()  # at most one save in flight: the previous one is written and committed first
            path = store.save(self.engine, self.args.save, step, self.samples, self.saved_recipe, vars(self.layout),
                              self.args.keep_last, is_writer=self.logging_rank,
                              wandb_run_id=metrics.wandb_run_id if metrics is not None else None,
                              data_state=self.data.gather_data_state(self.batches),
                              data_identity={"data_fingerprint": job.data_fingerprint,
                                             "data_origin_samples": job.data_origin_samples},
                              layout_auto=dataclasses.asdict(job.layout_choice) if job.layout_choice else None,
                              saver=saver, remote=job.remote_save)
        if stopping or step == self.steps:  # how this start ended, once its last save is committed
            self.start_ended = (step, stopping)
            if saver is None:
                self.record_start_end()
        # How long a stop needs; leaves if a later request came during the save (an asynchronous
        # one once its background write is committed).
        self.stop.saved(path, self.logging_rank, write_s=saver.write_s if saver is not None else None,
                        asynchronous=saver is not None, before_leaving=self.finish_save)

    def finish_save(self) -> None:
        """train.async_save: wait for the last save's background write and commit, bounded as a save
        is and never cut short by a later stop request; then record how this start ended."""
        if self.saver is not None and self.saver.in_flight:
            with self.stop.saving(), self.hang.phase("save"):
                self.saver.wait()
            if self.logging_rank:
                print(f"checkpoint written and committed in the background in {self.saver.write_s:.1f} s", flush=True)
        self.record_start_end()

    def record_start_end(self) -> None:
        if self.starts is not None and self.start_ended is not None:  # DIR/starts.jsonl
            self.starts.ended(self.start_ended[0], stopped=self.start_ended[1])
            self.start_ended = None

    def close(self) -> None:
        """The end of a run that trained to its last step or stopped: every rank, in this order."""
        self.finish_save()  # train.async_save: the last save's background write, committed
        self.hang.finished()
        # The read-ahead thread ends before the interpreter does (a daemon thread inside pyarrow at
        # finalization aborts the process). A failure leaves by os._exit, where no finalization runs.
        self.data.close_batches(self.batches)
        if self.timeline is not None:
            self.timeline.draw(self.args.timeline, self.logging_rank)  # collective: every rank gathers
        if self.metrics is not None:
            self.metrics.close()
        dist.barrier()  # every rank's work is done (rank 0's wandb too), failures still watched
        self.watcher.stop()  # before shut_down_distributed's barrier, after which rank 0 (the store) may exit
        shut_down_distributed()


def timed_train_batch(engine: PipelineEngine, draw_step: Callable[[], Iterator]) -> Tuple[torch.Tensor, float]:
    """(loss, seconds) of one `train_batch` on the feed `draw_step()` returns (which may draw the
    step's micro-batches now: launch/feed/step_tokens.py), the draw included. The clock stops
    when the device is done, optimizer step included: on a GPU `train_batch` returns with kernels
    still queued (the pp=1 optimizer step runs asynchronously), so without the sync a step would be
    timed at its launch."""
    start = time.perf_counter()
    loss = engine.train_batch(data_iter=draw_step())
    synchronize_device()
    return loss, time.perf_counter() - start


def metrics_logger(job: TrainingJob, arithmetic: RunArithmetic, first_step: int) -> MetricsLogger:
    """The logging rank's metrics: JSON lines (--metrics-out), the console, wandb (a resumed run
    continues its wandb run)."""
    recipe, resume_from = job.recipe, job.resume_from
    return MetricsLogger(job.args.metrics_out, recipe.wandb.mode, recipe.wandb.project,
                         recipe.wandb.name, dict(recipe.to_dict(), layout=vars(job.layout), layout_auto=(
                             dataclasses.asdict(job.layout_choice) if job.layout_choice else None)),
                         arithmetic,
                         resume_after_step=first_step - 1 if resume_from is not None else None,
                         wandb_run_id=resume_from.meta["wandb_run_id"] if resume_from is not None else None)


def timeline_recorder(engine: PipelineEngine, out: Optional[Path], steps_to_time: int, steps: int,
                      state: ParallelState):
    """--timeline: each stage's measured pass times, drawn at the end; None without it."""
    if out is None:
        return None
    from launch.instruments.timeline import install_timeline_recorder  # matplotlib: imported only when asked
    return install_timeline_recorder(engine, steps_to_time, steps,
                                     one_per_stage=state.tp_rank == 0 and state.cp_rank == 0 and state.dp_rank == 0)


def task_record(engine: PipelineEngine, job: TrainingJob, tasks: List[TaskSequences], state: ParallelState,
                device: torch.device, progress: Callable[[], None] = lambda: None) -> dict:
    """eval.tasks scored now (launch/evaluation/task_scoring.py: `tasks` its TaskSequences): name ->
    acc, acc_norm, n and the gold choices' mean log-likelihood (each choice's own stays with
    launch/evaluate.py --metrics-out)."""
    scores = score_tasks(engine, state, job.layout, tasks, device, progress)
    return {name: {k: v for k, v in values.items() if k != "choice_loglikelihoods"} for name, values in scores.items()}
