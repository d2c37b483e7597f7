"""The training loop of a checked job: start the ranks, build the engine, resume, then per step
train, measure, validate, log and save, until the last step or an agreed stop signal."""
from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import TYPE_CHECKING, Callable, Iterator, List, Optional, Tuple

from launch.config.layout import Layout, runs_zero_bubble
from launch.feed.run_inputs import resolved_recipe_dict
from launch.trainer.startup import TrainingJob

if TYPE_CHECKING:  # annotations only: no import cost at run time
    import torch
    from data.pipeline import RunData, SourceData
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from launch.checkpoints.locate import CheckpointRef
    from launch.evaluation.task_scoring import TaskSequences
    from model.config import GPTConfig
    from model.parallel.state import ParallelState


def validation_loss(engine: PipelineEngine, data: SourceData, state: ParallelState, layout: Layout,
                    eval_batches: int, device: torch.device, progress: Callable[[], None] = lambda: None) -> float:
    """Mean validation loss over the same global batches at every call, via `eval_batch`;
    `progress()` after each (the hang watchdog times validation batch by batch)."""
    from data.pipeline import on_device
    from launch.feed.step_tokens import count_step_tokens
    from model.parallel.context_parallel import sequence_shards
    n = data.eval_global_batches(eval_batches)
    batches = sequence_shards(on_device(data.val_batches(state.dp_rank, layout.dp, n), device),
                              state.cp_rank, state.cp_size)
    total = 0.0
    for _ in range(n):
        total += engine.eval_batch(data_iter=count_step_tokens(engine, batches, layout.grad_accum_steps)).item()
        progress()
    return total / n


def validation_record(engine: PipelineEngine, data: RunData, state: ParallelState, layout: Layout,
                      eval_batches: int, device: torch.device, logging_rank: bool,
                      progress: Callable[[], None] = lambda: None) -> dict:
    """val_loss, val_ppl and (on the logging rank) val_bpb, bits per byte (data/bits_per_byte.py);
    for a mixture also val_loss_by_source (label -> that source's own validation loss), with
    val_loss and val_bpb their means weighted by the mixture's weights."""
    from data.bits_per_byte import validation_loss_and_bpb
    val_loss, by_source, val_bpb = validation_loss_and_bpb(
        data, lambda part: validation_loss(engine, part, state, layout, eval_batches, device, progress),
        lambda part: part.eval_global_batches(eval_batches), with_bpb=logging_rank)
    record = {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}
    if val_bpb is not None:
        record["val_bpb"] = val_bpb
    if by_source is not None:
        record["val_loss_by_source"] = by_source
    return record


def task_record(engine: PipelineEngine, job: TrainingJob, tasks: List[TaskSequences], state: ParallelState,
                device: torch.device, progress: Callable[[], None] = lambda: None) -> dict:
    """eval.tasks scored now (launch/evaluation/task_scoring.py: `tasks` its TaskSequences): name ->
    acc, acc_norm, n and the gold choices' mean log-likelihood (each choice's own stays with
    launch/evaluate.py --metrics-out)."""
    from launch.evaluation.task_scoring import score_tasks
    scores = score_tasks(engine, state, job.layout, tasks, device, progress)
    return {name: {k: v for k, v in values.items() if k != "choice_loglikelihoods"} for name, values in scores.items()}


def restore(engine: PipelineEngine, resume_from: Optional[CheckpointRef], layout: Layout, state: ParallelState,
            config: GPTConfig, logging_rank: bool, progress: Callable[[], None] = lambda: None) -> Tuple[int, int]:
    """(first step to train, samples consumed so far): (1, 0), or after the checkpoint's step;
    `progress()` after each file read."""
    from launch.checkpoints import store
    from launch.checkpoints.locate import same_layout, saved_zero_stage
    from launch.checkpoints.safe_io import each_file_loaded
    if resume_from is None:
        return 1, 0
    with each_file_loaded(progress):
        client_state = store.load(engine, resume_from, vars(layout), state, config)
    step, samples = client_state["step"], client_state["samples"]
    if logging_rank:
        saved = resume_from.meta["layout"]
        stages = (saved_zero_stage(resume_from.meta), engine.zero_optimization_stage())
        print(f"resumed from {resume_from.path} at step {step} ({samples} samples consumed)"
              + ("" if stages[0] == stages[1] else f", ZeRO-{stages[0]} state re-sharded for ZeRO-{stages[1]}")
              + ("" if same_layout(saved, vars(layout)) else
                 f", re-sharded from tp={saved['tp']} pp={saved['pp']} dp={saved['dp']}"
                 + (f" cp={saved.get('cp', 1)}" if layout.cp > 1 or saved.get("cp", 1) > 1 else "")
                 + (f" ep={saved.get('ep', 1)}" if layout.ep > 1 or saved.get("ep", 1) > 1 else "") + " "
                 f"(stage boundaries {list(saved['parts'])} -> {list(layout.parts)})"), flush=True)
    return step + 1, samples


def timed_train_batch(engine: PipelineEngine, draw_step: Callable[[], Iterator]) -> Tuple[torch.Tensor, float]:
    """(loss, seconds) of one `train_batch` on the feed `draw_step()` returns (which may draw the
    step's micro-batches now: launch/feed/step_tokens.py), the draw included. The clock stops
    when the device is done, optimizer step included: on a GPU `train_batch` returns with kernels
    still queued (the pp=1 optimizer step runs asynchronously), so without the sync a step would be
    timed at its launch."""
    from launch.instruments.metrics import synchronize_device
    start = time.perf_counter()
    loss = engine.train_batch(data_iter=draw_step())
    synchronize_device()
    return loss, time.perf_counter() - start


def run_training(job: TrainingJob) -> None:
    import torch
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    from data.reading import reading_now
    from launch.autotune.step_prediction import predict_step_time
    from launch.checkpoints import store
    from launch.engine.compiler import blocks_to_compile
    from launch.engine.distributed import shut_down_distributed, start_rank
    from launch.engine.engine import build_engine, print_role_map
    from launch.engine.experts import after_moe_step, set_router_loss_scale
    from launch.engine.zero_bubble import check_weight_passes_ran
    from launch.feed.replica_reader import replica_reader_groups
    from launch.feed.step_tokens import RouterTokens, count_step_tokens
    from launch.instruments.comm_counter import install_comm_counter
    from launch.instruments.compute_clock import install_compute_clock
    from launch.instruments.metrics import (MetricsLogger, is_logging_rank, loss_scale, reset_step_memory_peak,
                                            run_arithmetic, local_step_memory_peak)
    from launch.instruments.stragglers import (StragglerWatch, gather_rank_roles, gather_step_numbers, in_pass_group,
                                               slowest_data_reader, summarise_seconds)
    from launch.optim.grad_norm import last_grad_norm
    from launch.resilience.failure import FailureWatcher, fault_injection, maybe_inject_fault
    from launch.resilience.hang_line import stacks_dir
    from launch.resilience.hang_watchdog import HangWatchdog
    from launch.resilience.restarts import StartRecord
    from launch.resilience.signals import StopRequest
    from model.parallel.context_parallel import sequence_shards
    from model.parallel.state import init_parallel_state

    args, recipe, layout, data, resume_from = job.args, job.recipe, job.layout, job.data, job.resume_from
    train_cfg = recipe.train
    start_rank(layout.world_size, train_cfg.dist_timeout_s)
    # One rank fails, falls silent or hangs: all stop.
    hang = HangWatchdog(int(os.environ["RANK"]), layout.world_size, stacks_dir(args.save, args.metrics_out),
                        train_cfg.hang_timeout_s, train_cfg.first_step_timeout_s or 0.8 * train_cfg.dist_timeout_s,
                        save_timeout_s=train_cfg.save_timeout_s,
                        stall_timeout_s=recipe.data.stall_timeout_s or 0.8 * train_cfg.dist_timeout_s,
                        reading_now=reading_now)  # a stall's line names what the data reads
    watcher = FailureWatcher(int(os.environ["RANK"]), layout.world_size, train_cfg.heartbeat_timeout_s, hang)
    starts = StartRecord.begin(args.save, resume_from, int(os.environ["RANK"]))  # rank 0's, in DIR/starts.jsonl
    fault = fault_injection()  # a test hook, None unless GPT3D_FAULT_INJECT is set
    state = init_parallel_state(layout.tp, layout.pp, layout.cp, layout.ep, experts=recipe.model.moe.enabled)
    logging_rank = is_logging_rank(state.global_rank)
    config = recipe.gpt_config(job.vocab_size, data.tokenizer.eos_token_id)
    compiled = blocks_to_compile(train_cfg.compile, get_accelerator().device_name(), logging_rank)
    engine, own_grad_norm = build_engine(recipe, layout, state, config, compiled,
                                         init_from_hf=args.init_from_hf, verbose=args.verbose)
    if logging_rank:
        print_role_map(recipe, layout, state, config, engine.module)
    install_comm_counter(engine, state, args.comm_counts)  # does nothing without --comm-counts
    compute_clock = install_compute_clock(engine, state.global_rank)
    stragglers = StragglerWatch(**gather_rank_roles(state.pp_rank, in_pass_group(state)),
                                group_kind="tensor/context/expert-parallel" if layout.ep > 1 else "tensor/context-parallel")
    timeline = None
    if args.timeline is not None:
        from launch.instruments.timeline import install_timeline_recorder
        timeline = install_timeline_recorder(engine, args.timeline_steps, train_cfg.steps,
                                             one_per_stage=state.tp_rank == 0 and state.cp_rank == 0 and state.dp_rank == 0)
    hang.start()  # from here the run is timed: a load file by file, then each step and phase by its rule
    with hang.phase("load"):
        first_step, samples = restore(engine, resume_from, layout, state, config, logging_rank, hang.progress)

    saved_recipe = resolved_recipe_dict(recipe, job.vocab_size)
    # The data's own position: samples since its order began (not the run's, after --restart-data).
    batches = data.train_batches(state.dp_rank, layout.dp, start_sample=samples - job.data_origin_samples,
                                 data_state=job.data_state)
    device = torch.device(get_accelerator().current_device_name())
    # The CP ranks of a replica drew the same samples (same dp rank); each keeps its sequence shard.
    # One rank of each replica reads; the others drawing micro-batches receive them (launch/feed/replica_reader.py).
    # Each draw is a data wait, bounded by data.stall_timeout_s rather than the step's bound.
    drawn = data.feed(batches, *replica_reader_groups(state, data.streamed), device)
    feed = sequence_shards(hang.timed_draws(drawn), state.cp_rank, state.cp_size)
    # The run summary prints it, with the planner's step time for this layout (rank 0 plans it).
    prediction = predict_step_time(recipe, layout, job.vocab_size) if logging_rank else None
    arithmetic = run_arithmetic(config, layout, recipe.seq_len, train_cfg.steps, prediction)
    tokens_per_step = arithmetic.tokens_per_step
    stop = StopRequest(state.global_rank, train_cfg.stop_grace_s)
    metrics = None
    if logging_rank:
        metrics = MetricsLogger(args.metrics_out, recipe.wandb.mode, recipe.wandb.project,
                                recipe.wandb.name, dict(recipe.to_dict(), layout=vars(layout), layout_auto=(
                                    dataclasses.asdict(job.layout_choice) if job.layout_choice else None)),
                                arithmetic,
                                resume_after_step=first_step - 1 if resume_from is not None else None,
                                wandb_run_id=resume_from.meta.get("wandb_run_id") if resume_from is not None else None)
    # With experts every stage's routers learn which tokens count (launch/feed/step_tokens.py).
    routers = (RouterTokens((layout.micro_batch_size, recipe.seq_len // layout.cp), layout.cp)
               if recipe.model.moe.enabled else None)
    report = data.repeat_report(train_cfg.steps)  # a mixture says once which sources repeat, and how often
    if report is not None and logging_rank:
        print(report, flush=True)
    from launch.evaluation.task_scoring import task_sequences
    tasks = task_sequences(job.tasks, data.tokenizer, recipe.seq_len)  # tokenized once, scored every eval.every
    for step in range(first_step, train_cfg.steps + 1):
        lr = engine.get_lr()[0]  # the rate this step uses; the scheduler advances after it
        maybe_inject_fault(fault, state.global_rank, step)
        reset_step_memory_peak()
        waited_before = getattr(batches, "waited_s", 0.0)  # streamed data times its draws (data/streaming.py)
        compute_clock.start_step()
        set_router_loss_scale(engine, layout)  # the fp16 loss scale may have changed after the last step
        # The step's loss is its mean over every counted token (model/gpt/pipe.py: TokenMeanLoss).
        loss, seconds = timed_train_batch(engine, lambda: count_step_tokens(engine, feed, layout.grad_accum_steps,
                                                                            routers))
        hang.step_ended()
        if step == first_step and runs_zero_bubble(train_cfg.schedule, layout.pp):
            check_weight_passes_ran(engine)  # the hooks took: W passes computed weight gradients
        watcher.completed(step)  # the heartbeat names it if this rank is lost later
        # An all-gather (every rank calls it), which carries the ranks' stop requests too.
        numbers = gather_step_numbers(compute_clock.take(), getattr(batches, "waited_s", 0.0) - waited_before,
                                      *local_step_memory_peak(), stop.signalled, device)
        peak_allocated, peak_reserved = numbers.peak_allocated, numbers.peak_reserved
        compute_by_rank = numbers.compute_s
        reader = slowest_data_reader(numbers.data_wait_s)
        samples += layout.global_batch_size
        record = {"step": step, "samples": samples, "loss": loss.item(), "grad_norm": last_grad_norm(engine, own_grad_norm),
                  "lr": lr, "loss_scale": loss_scale(engine), "tokens": step * tokens_per_step,
                  "tokens_per_s": tokens_per_step / seconds, "step_time_s": seconds,
                  "peak_memory_bytes": peak_allocated, "peak_reserved_bytes": peak_reserved,
                  "data_wait_s": reader["seconds"], "data_wait_rank": reader["rank"],
                  "compute_s": summarise_seconds(compute_by_rank, stragglers.stages)}
        if step == first_step and job.layout_choice is not None:  # --layout auto: what it chose, and why
            record["layout_auto"] = dataclasses.asdict(job.layout_choice)
        if args.metrics_per_rank:
            record["compute_s_by_rank"] = compute_by_rank.tolist()
        record.update(after_moe_step(engine, config, layout))  # collective; {} without experts
        record.update(data.step_record(samples - job.data_origin_samples))
        if train_cfg.eval_every and (step % train_cfg.eval_every == 0 or step == train_cfg.steps):
            with hang.phase("validation"):
                record.update(validation_record(engine, data, state, layout, train_cfg.eval_batches, device,
                                                logging_rank, hang.progress))
        if job.tasks and ((recipe.eval.every and step % recipe.eval.every == 0) or step == train_cfg.steps):
            with hang.phase("tasks"):
                record["tasks"] = task_record(engine, job, tasks, state, device, hang.progress)
        if metrics is not None:
            for line in stragglers.observe(step, compute_by_rank, numbers.data_wait_s, seconds):
                print(line, flush=True)
            metrics.log(record)
        stopping = stop.agreed(numbers.stop_requested)
        if args.save and (stopping or step == train_cfg.steps or (args.save_every and step % args.save_every == 0)):
            with stop.saving(), hang.phase("save"):  # a save has its own bound, and a stop request waits for it
                path = store.save(engine, args.save, step, samples, saved_recipe, vars(layout),
                                  args.keep_last, is_writer=logging_rank,
                                  wandb_run_id=metrics.wandb_run_id if metrics is not None else None,
                                  data_state=data.gather_data_state(batches),
                                  data_identity={"data_fingerprint": job.data_fingerprint,
                                                 "data_origin_samples": job.data_origin_samples},
                                  layout_auto=dataclasses.asdict(job.layout_choice) if job.layout_choice else None)
            if starts is not None and (stopping or step == train_cfg.steps):  # how this start ended
                starts.ended(step, stopped=stopping)
            stop.saved(path, logging_rank)  # how long a stop needs; leaves if a later request came during the save
        if stopping:
            if logging_rank:
                print(f"stopped by signal after step {step}", flush=True)
            break
    hang.finished()
    # The read-ahead thread ends before the interpreter does (a daemon thread inside pyarrow at
    # finalization aborts the process). A failure leaves by os._exit, where no finalization runs.
    data.close_batches(batches)
    if timeline is not None:
        timeline.draw(args.timeline, logging_rank)  # collective: every rank gathers
    if metrics is not None:
        metrics.close()
    dist.barrier()  # every rank's work is done (rank 0's wandb too), failures still watched
    watcher.stop()  # before shut_down_distributed's barrier, after which rank 0 (the store) may exit
    shut_down_distributed()
