"""Train a GPT with 3D parallelism: `deepspeed launch/train.py --tp 4 --pp 4` (dp = world / 16).

On CPU: `deepspeed --num_gpus 16 launch/train.py --tp 4 --pp 4` runs the same layout as 16
processes over gloo. `python launch/train.py` runs one process.
Order of work: parse and validate everything (exit 2 on bad input), then start
torch.distributed, build the pipeline and DeepSpeed engine, then train.
"""
import argparse
import math
import os
import socket
import sys
import time
from pathlib import Path
from typing import List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from launch.config import ConfigError, Recipe, load_recipe, report_bad_input  # noqa: E402
from launch.layout import Layout, check_vocab, derive_layout  # noqa: E402

DEFAULT_RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "demo.yaml"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 2, like every other bad input
        raise ConfigError(f"{message} (see --help)")


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", type=Path, default=DEFAULT_RECIPE, help="YAML recipe (default: %(default)s)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (stages)")
    p.add_argument("--steps", type=int, help="optimizer steps (overrides train.steps)")
    p.add_argument("--seed", type=int, help="seed (overrides train.seed)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field, e.g. --set train.lr=3e-4 (repeatable)")
    p.add_argument("--metrics-out", type=Path, help="JSON lines, one per optimizer step")
    p.add_argument("--wandb", choices=["online", "offline", "disabled"], help="overrides wandb.mode")
    p.add_argument("--save", type=Path, help="save checkpoints under this directory")
    p.add_argument("--save-every", type=int, default=0, metavar="N",
                   help="save every N steps (and always at the end, or when signalled)")
    p.add_argument("--keep-last", type=int, default=0, metavar="K", help="keep only the K newest checkpoints")
    p.add_argument("--load", type=Path, help="resume: a save directory (its latest complete checkpoint) or one "
                   "checkpoint directory; --steps stays the run's total")
    p.add_argument("--init-from-hf", metavar="DIR_OR_NAME",
                   help="start from GPT-2-format (transformers) weights of the recipe's model shape")
    p.add_argument("--timeline", type=Path, metavar="FILE.png",
                   help="draw the measured 1F1B schedule (per-stage forward/backward times) of a few steps")
    p.add_argument("--timeline-steps", type=int, default=3, metavar="N",
                   help="steps --timeline records, after one warm-up step (default: %(default)s)")
    p.add_argument("--comm-counts", type=Path, metavar="DIR",
                   help="count each collective's bytes per step into DIR/rank{R}.json (bench/comm_volume.py)")
    p.add_argument("--verbose", action="store_true",
                   help="show every library message, including the known-harmless ones launch/console.py silences")
    p.add_argument("--local_rank", "--local-rank", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.timeline_steps < 1:
        p.error(f"--timeline-steps {args.timeline_steps} must be >= 1")
    return args


def resolve_recipe(args: argparse.Namespace) -> Recipe:
    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    if args.seed is not None:
        overrides.append(f"train.seed={args.seed}")
    if args.wandb is not None:
        overrides.append(f"wandb.mode={args.wandb}")
    return load_recipe(args.recipe, overrides)


def on_cpu() -> bool:
    from deepspeed.accelerator import get_accelerator
    return get_accelerator().device_name() == "cpu"


def check_precision_supported(precision: str) -> None:
    """deepspeed.initialize refuses fp16 where the accelerator declares none (DeepSpeed's CPU
    accelerator on CPUs without oneDNN fp16 kernels): say so before the start."""
    from deepspeed.accelerator import get_accelerator
    if precision == "fp16" and not get_accelerator().is_fp16_supported():
        raise ConfigError(f"train.precision=fp16: the {get_accelerator().device_name()} accelerator does not "
                          f"support fp16 here; use fp32 or bf16")


def ensure_single_process_env() -> None:
    """`python launch/train.py` without a launcher: a world of one, on a free local port."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def print_role_map(layout: Layout, state, stages: List[Tuple[int, str]], seq_len: int,
                   sequence_parallel: bool = False, recompute: str = "none") -> None:
    def groups(lists):
        return " ".join(str(g) for g in lists)
    print(f"layout: world {layout.world_size} = tp {layout.tp} x pp {layout.pp} x dp {layout.dp} "
          f"(axis order pipe, data, model: TP ranks adjacent)\n"
          f"  TP groups  (split each weight matrix):  {groups(state.tp_groups)}\n"
          f"  pipelines  (split the layers, stage 0 first): {groups(state.pipelines)}\n"
          f"  DP groups  (split the data, all-reduce grads): {groups(state.dp_groups)}")
    for stage, contents in stages:
        print(f"  stage {stage}: {contents}")
    print(f"batch: global {layout.global_batch_size} = micro {layout.micro_batch_size} x dp {layout.dp} "
          f"x {layout.grad_accum_steps} micro-batches per step; {layout.global_batch_size * seq_len} "
          f"tokens per step")
    shard = f"(b, T/tp, h) = ({layout.micro_batch_size}, {seq_len // layout.tp}, h): sequence parallel" \
        if sequence_parallel and layout.tp > 1 else f"(b, T, h) = ({layout.micro_batch_size}, {seq_len}, h)"
    print(f"activations: {shard} per rank between TP linears and across stages; recompute {recompute}",
          flush=True)


def param_groups(module):
    """AdamW decays matrices and embeddings, not biases or LayerNorm (GPT-2 / nanoGPT)."""
    params = [p for p in module.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2]},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def evaluate(engine, data, state, layout: Layout, eval_batches: int, device) -> float:
    """Mean validation loss over the same global batches at every call, via `eval_batch`."""
    from data.pipeline import on_device
    n = data.eval_global_batches(eval_batches)
    batches = on_device(data.val_batches(state.dp_rank, layout.dp, n), device)
    return sum(engine.eval_batch(data_iter=batches).item() for _ in range(n)) / n


def build_engine(args: argparse.Namespace, recipe: Recipe, layout: Layout, state, config, logging_rank: bool):
    """The run's PipelineModule (seeded init, or `--init-from-hf` weights) inside a DeepSpeed
    engine with AdamW, ZeRO, clipping and the LR schedule; and, for fp32 ZeRO-0, our own
    gradient norm and clipping (launch/grad_norm.py), else None."""
    import deepspeed

    from launch.console import quiet_stdout
    from launch.ds_config import deepspeed_config
    from launch.grad_norm import Zero0GradNorm, uses_own_grad_norm
    from launch.schedule import warmup_cosine
    from model.pipe import build_pipeline, stage_contents

    t = recipe.train
    with quiet_stdout(not args.verbose):  # DeepSpeed's own layer listing: the role map shows it
        pipe = build_pipeline(config, state, t.full_recompute_interval)
    if args.init_from_hf is not None:  # before deepspeed.initialize: the optimizer starts from them
        from launch.hf_init import init_from_hf
        init_from_hf(pipe, args.init_from_hf, config, state)
    if logging_rank:
        print_role_map(layout, state, stage_contents(pipe, config), recipe.seq_len,
                       recipe.model.sequence_parallel, t.recompute_mode)
    ds_config = deepspeed_config(recipe, layout)
    own_norm = uses_own_grad_norm(t.zero_stage, t.precision)
    if own_norm:  # DeepSpeed's fp32 ZeRO-0 clipping miscounts across stages: ours clips instead
        ds_config["gradient_clipping"] = 0.0
    engine, _, _, _ = deepspeed.initialize(
        model=pipe, model_parameters=param_groups(pipe), config=ds_config,
        lr_scheduler=warmup_cosine(t.warmup_steps, t.steps, t.min_lr_ratio))
    grad_norm = Zero0GradNorm(engine, state.tp_rank, t.grad_clip) if own_norm else None
    return engine, grad_norm


def restore(engine, resume_from, layout: Layout, state, config, logging_rank: bool) -> Tuple[int, int]:
    """(first step to train, samples consumed so far): (1, 0), or after the checkpoint's step."""
    from launch import checkpoint
    if resume_from is None:
        return 1, 0
    client_state = checkpoint.load(engine, resume_from, vars(layout), state, config)
    step, samples = client_state["step"], client_state["samples"]
    if logging_rank:
        saved = resume_from.meta["layout"]
        print(f"resumed from {resume_from.path} at step {step} ({samples} samples consumed)"
              + ("" if checkpoint.same_layout(saved, vars(layout)) else
                 f", re-sharded from tp={saved['tp']} pp={saved['pp']} dp={saved['dp']}"), flush=True)
    return step + 1, samples


def train(args: argparse.Namespace, recipe: Recipe, layout: Layout, data, vocab_size: int,
          resume_from=None) -> None:
    import torch
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    from launch import checkpoint
    from launch.comm_counter import install_comm_counter
    from launch.distributed import shut_down_distributed, start_rank
    from launch.failure import FailureWatcher, fault_injection, maybe_inject_fault
    from launch.metrics import (MetricsLogger, is_logging_rank, loss_scale, reset_step_memory_peak, run_arithmetic,
                                step_memory_peak, synchronize_device)
    from launch.preemption import StopRequest
    from model.parallel_state import init_parallel_state

    t = recipe.train
    start_rank(layout.world_size, t.dist_timeout_s)
    watcher = FailureWatcher(int(os.environ["RANK"]), layout.world_size)  # one rank fails: all stop
    fault = fault_injection()  # a test hook, None unless GPT3D_FAULT_INJECT is set
    state = init_parallel_state(layout.tp, layout.pp)
    logging_rank = is_logging_rank(state.global_rank)
    config = recipe.gpt_config(vocab_size)
    engine, own_grad_norm = build_engine(args, recipe, layout, state, config, logging_rank)
    install_comm_counter(engine, state, args.comm_counts)  # does nothing without --comm-counts
    timeline = None
    if args.timeline is not None:
        from launch.timeline import install_timeline_recorder
        timeline = install_timeline_recorder(engine, args.timeline_steps, t.steps,
                                             one_per_stage=state.tp_rank == 0 and state.dp_rank == 0)
    first_step, samples = restore(engine, resume_from, layout, state, config, logging_rank)

    saved_recipe = resolved_recipe_dict(recipe, vocab_size)
    batches = data.train_batches(state.dp_rank, layout.dp, start_sample=samples,
                                 data_state=resume_from.meta.get("data_state") if resume_from is not None else None)
    device = torch.device(get_accelerator().current_device_name())
    feed = data.feed(batches, state.tp_group, device)
    tokens_per_step = layout.global_batch_size * recipe.seq_len
    stop = StopRequest(get_accelerator().device_name())
    metrics = None
    if logging_rank:
        metrics = MetricsLogger(args.metrics_out, recipe.wandb.mode, recipe.wandb.project,
                                recipe.wandb.name, dict(recipe.to_dict(), layout=vars(layout)),
                                run_arithmetic(config, layout, recipe.seq_len, t.steps),
                                resume_after_step=first_step - 1 if resume_from is not None else None,
                                wandb_run_id=resume_from.meta.get("wandb_run_id") if resume_from is not None else None)
    for step in range(first_step, t.steps + 1):
        lr = engine.get_lr()[0]  # the rate this step uses; the scheduler advances after it
        maybe_inject_fault(fault, state.global_rank, step)
        reset_step_memory_peak()
        start = time.perf_counter()
        loss = engine.train_batch(data_iter=feed)
        synchronize_device()  # the clock stops when the device is done, optimizer step included
        seconds = time.perf_counter() - start
        peak_allocated, peak_reserved = step_memory_peak()  # a MAX all-reduce: every rank calls it
        samples += layout.global_batch_size
        grad_norm = own_grad_norm.value if own_grad_norm is not None else engine.get_global_grad_norm()
        record = {"step": step, "samples": samples, "loss": loss.item(), "grad_norm": float(grad_norm),
                  "lr": lr, "loss_scale": loss_scale(engine), "tokens": step * tokens_per_step,
                  "tokens_per_s": tokens_per_step / seconds, "step_time_s": seconds,
                  "peak_memory_bytes": peak_allocated, "peak_reserved_bytes": peak_reserved}
        if t.eval_every and (step % t.eval_every == 0 or step == t.steps):
            val_loss = evaluate(engine, data, state, layout, t.eval_batches, device)
            record.update(val_loss=val_loss, val_ppl=math.exp(min(val_loss, 50.0)))
        if metrics is not None:
            metrics.log(record)
        stopping = stop.agreed()
        if args.save and (stopping or step == t.steps or (args.save_every and step % args.save_every == 0)):
            path = checkpoint.save(engine, args.save, step, samples, saved_recipe, vars(layout),
                                   args.keep_last, is_writer=logging_rank,
                                   wandb_run_id=metrics.wandb_run_id if metrics is not None else None,
                                   data_state=data.gather_data_state(batches))
            if logging_rank:
                print(f"saved {path}", flush=True)
        if stopping:
            if logging_rank:
                print(f"stopped by signal after step {step}", flush=True)
            break
    if timeline is not None:
        timeline.draw(args.timeline, logging_rank)  # collective: every rank gathers
    if metrics is not None:
        metrics.close()
    dist.barrier()  # every rank's work is done (rank 0's wandb too), failures still watched
    watcher.stop()  # before shut_down_distributed's barrier, after which rank 0 (the store) may exit
    shut_down_distributed()


def resolved_recipe_dict(recipe: Recipe, vocab_size: int) -> dict:
    """The recipe as trained: the vocabulary resolved from the tokenizer."""
    resolved = recipe.to_dict()
    resolved["model"]["vocab_size"] = vocab_size
    return resolved


def load_checked_tokenizer(recipe: Recipe):
    """The run's tokenizer and the model's vocabulary size, or a ConfigError naming the fix."""
    from data.builtin import load_tokenizer
    from data.spec import DataError
    from data.tokens import require_eos
    try:
        tokenizer = load_tokenizer(recipe.data.tokenizer)
    except DataError:  # already one line (e.g. the data cache's lock timed out)
        raise
    except (OSError, ValueError) as e:
        raise ConfigError(f"data.tokenizer={recipe.data.tokenizer!r} could not be loaded "
                          f"({type(e).__name__}); use 'builtin' or a local tokenizer directory") from None
    require_eos(tokenizer, recipe.data.tokenizer)
    return tokenizer, check_vocab(recipe, len(tokenizer))


def prepare(recipe: Recipe, layout: Layout):
    """Tokenizer, vocabulary and the run's data (cache built once, by one process)."""
    from data.pipeline import prepare_run_data
    tokenizer, vocab_size = load_checked_tokenizer(recipe)
    data = prepare_run_data(recipe.data, tokenizer, recipe.seq_len, recipe.train.seed,
                            layout.global_batch_size, layout.micro_batch_size,
                            evaluate=recipe.train.eval_every > 0, eval_batches=recipe.train.eval_batches)
    return data, vocab_size


def main(argv: Optional[List[str]] = None) -> int:
    from data.spec import DataError
    try:
        args = parse_args(argv)
        if not args.verbose:
            from launch.console import silence_known_noise
            silence_known_noise()
        recipe = resolve_recipe(args)
        ensure_single_process_env()
        layout = derive_layout(recipe, int(os.environ["WORLD_SIZE"]), args.tp, args.pp, on_cpu())
        check_precision_supported(recipe.train.precision)
        if args.save_every < 0 or args.keep_last < 0:
            raise ConfigError(f"--save-every {args.save_every} and --keep-last {args.keep_last} must be >= 0")
        if (args.save_every or args.keep_last) and args.save is None:
            raise ConfigError("--save-every and --keep-last need --save DIR")
        from launch.preflight import check_before_start
        check_before_start(recipe, args.metrics_out, args.save, args.timeline, args.comm_counts)
        resume_from = None
        if args.load is not None:
            from launch.checkpoint import check_compatible, find_checkpoint
            resume_from = find_checkpoint(args.load)
        data, vocab_size = prepare(recipe, layout)
        if args.init_from_hf is not None:
            from launch.hf_init import check_hf_source
            check_hf_source(args.init_from_hf, recipe.gpt_config(vocab_size), resuming=resume_from is not None)
        if resume_from is not None:
            check_compatible(resume_from, resolved_recipe_dict(recipe, vocab_size), vars(layout))
            data.check_data_state(resume_from.meta.get("data_state"), resume_from.meta["samples"])
            if resume_from.meta["step"] >= recipe.train.steps:
                raise ConfigError(f"checkpoint {resume_from.path} is at step {resume_from.meta['step']}, "
                                  f"not before --steps {recipe.train.steps}: nothing to train")
        if args.save is not None:  # last: only a run that passed every check moves files
            from launch.checkpoint import prepare_save_dir
            prepare_save_dir(args.save, resume_from, is_writer=os.environ["RANK"] == "0")
    except (ConfigError, DataError) as e:
        return report_bad_input(e)
    try:
        train(args, recipe, layout, data, vocab_size, resume_from)
    except Exception as e:  # one line naming this rank and the cause; every other rank stops too
        from launch.failure import report_failure
        report_failure(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
