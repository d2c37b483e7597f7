"""Run a test body on N CPU processes joined by a gloo process group (no DeepSpeed launcher),
and build the training run's engine there for a test's model (`sgd_engine`).

The processes are forked from tests/helpers/rank_server.py, which has torch and DeepSpeed imported
already (tests/helpers/forked.py); fn must be a module-level function (it travels pickled, by name)."""
import base64
import dataclasses
import os
import pickle
import sys
import traceback

from helpers.forked import run_forked
from launch.engine.distributed import free_port


def run_body(rank: int, world_size: int, port: int, fn, args) -> None:
    """In rank `rank`'s process: join the group, call fn(*args), leave. A failure is printed
    (to the rank's stderr) and raised."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    try:
        if fn.__dict__.get("uses_deepspeed"):
            from launch.engine.distributed import init_distributed
            init_distributed(600, dist_backend="gloo", verbose=False)
        else:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        fn(*args)
        dist.barrier()
    except BaseException:
        print(f"rank {rank}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: int = 600) -> None:
    """Call fn(*args) on `world_size` processes; raise AssertionError with the first failure."""
    call = base64.b64encode(pickle.dumps((fn, args))).decode()
    reply, _, stderr = run_forked({"call": call, "world": world_size, "port": free_port()}, timeout)
    if reply["returncode"] != 0:
        raise AssertionError(("timed out after %d s\n" % timeout if reply["timed_out"] else "") + stderr[-6000:])


def uses_deepspeed(fn):
    """Mark a test body that needs DeepSpeed's communication backend initialised."""
    fn.uses_deepspeed = True
    return fn


def sgd_engine(config, state, micro_batch_size: int, micro_batches: int, full_recompute: bool = False):
    """The training run's engine (launch/engine/engine.py) for `config` (a GPTConfig) on this
    process group, in fp32 with ZeRO-0, no clipping and plain SGD of lr 1 instead of AdamW: one
    step's update is minus the gradient averaged over `micro_batches` micro-batches and dp."""
    import torch
    import torch.distributed as dist

    from launch.config.layout import check_and_derive_layout
    from launch.config.recipe import Recipe
    from launch.engine.engine import build_engine
    from model.config import ModelConfig

    recipe = Recipe(model=ModelConfig(**{f.name: getattr(config, f.name) for f in dataclasses.fields(ModelConfig)}))
    train_cfg = recipe.train
    train_cfg.micro_batch_size, train_cfg.global_batch_size = micro_batch_size, micro_batch_size * micro_batches * state.dp_size
    train_cfg.precision, train_cfg.zero_stage, train_cfg.grad_clip, train_cfg.warmup_steps, train_cfg.min_lr_ratio = "fp32", 0, 0.0, 0, 1.0  # lr 1 throughout
    train_cfg.recompute = "full" if full_recompute else "selective" if config.recompute_attention else "none"
    train_cfg.cp = state.cp_size
    layout = check_and_derive_layout(recipe, dist.get_world_size(), state.tp_size, state.pp_size, on_cpu=True)
    engine, _ = build_engine(recipe, layout, state, config, optimizer=lambda groups: torch.optim.SGD(groups, lr=1.0))
    return engine
