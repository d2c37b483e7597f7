"""The planner's model states are what DeepSpeed's engine allocates: on each rank, the
real engine of the training run (launch/engine/engine.py, AdamW, after one step so that Adam's
lazily built state exists) is stopped at the end of the next step's backward, the peak of the
model states, and the distinct storages of every tensor it holds are summed: the module's
parameters, their .grad, the optimizer's state and master weights and DeepSpeed's own buffers
(found by walking the optimizer objects). Each sum equals the planner's bytes for that rank's
stage, to the byte, at five layouts: fp32 ZeRO-0 and ZeRO-1 and bf16 ZeRO-1, at pp 1 and 2, and a
Llama at tp 2. The same step's data-parallel gradient all-reduce, as --comm-counts measures it,
equals the planner's DP bytes, and the stage's parameter tensors the planner's count. A hidden size of 30 and an odd vocabulary make ZeRO-1's groups need
padding at dp 2."""
import dataclasses
import tempfile

import pytest
import torch

from helpers.distributed import run_distributed, uses_deepspeed
from helpers.launcher import LLAMA_TINY, TINY

VOCAB = 4095
SMALL_GPT2 = ["model.n_embd=30", "model.n_head=2"]
# 1 or 2 micro-batches of 2 per step: the model states held do not depend on their number.
FEW_MICRO_BATCHES = ["train.global_batch_size=4"]
# (recipe, overrides, tp, pp): dp = 2 / (tp * pp) on the test's two processes.
LAYOUTS = [(TINY, SMALL_GPT2 + ["train.precision=fp32", "train.zero_stage=0"], 1, 2),
           (TINY, SMALL_GPT2 + ["train.precision=fp32", "train.zero_stage=1"], 1, 1),
           (TINY, SMALL_GPT2 + ["train.precision=bf16", "train.zero_stage=1"], 1, 1),
           (TINY, SMALL_GPT2 + ["train.precision=bf16", "train.zero_stage=1"], 1, 2),
           (LLAMA_TINY, ["train.precision=bf16", "train.zero_stage=1"], 2, 1),
           # Key/value heads shared by the TP ranks (the fused q/k/v weight keeps a bf16 .grad),
           # and bf16 without gradient-accumulation fusion (every parameter keeps one).
           (LLAMA_TINY, ["train.precision=bf16", "train.zero_stage=1", "model.n_kv_head=1"], 2, 1),
           (TINY, SMALL_GPT2 + ["train.precision=bf16", "train.zero_stage=1", "train.grad_accum_fusion=false"], 1, 1)]
STATES = ("weights", "gradients", "optimizer", "buffers")


def _storages(obj, path: str, found: dict, seen: set, depth: int = 0) -> None:
    """path of the first place each distinct storage is found, walking tensors, containers and
    DeepSpeed's and torch.optim's objects. 0-dim tensors are left out (AdamW's step counts, on the
    host on a GPU; the last gradient norm), and meta tensors (ZeRO-1's shape records) own no memory."""
    if depth > 6 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        if obj.dim() > 0 and obj.device.type != "meta":
            storage = obj.untyped_storage()
            found.setdefault(storage.data_ptr(), (path, storage.nbytes()))
        return
    items = (obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple))
             else vars(obj).items() if type(obj).__module__.startswith(("deepspeed", "torch.optim")) else ())
    for key, value in items:
        _storages(value, f"{path}.{key}" if isinstance(key, (str, int)) else path, found, seen, depth + 1)


def held_bytes(engine) -> dict:
    """{weights, gradients, optimizer, buffers}: the bytes of the distinct storages the engine
    holds, each counted where it is first found: parameters; their .grad; the basic optimizer's
    state and parameters (AdamW's moments; the fp32 master weights, or at fp32 ZeRO-0 the
    parameters themselves); then what the DeepSpeed optimizer wrapping it holds, gradients if the
    attribute names them (BF16_Optimizer's fp32 accumulation buffer), else buffers."""
    found, seen = {}, set()
    for name, param in engine.module.named_parameters():
        _storages(param, "weights", found, seen)
    for name, param in engine.module.named_parameters():
        _storages(param.grad, "gradients", found, seen)
    _storages(engine.basic_optimizer.state, "optimizer", found, seen)
    _storages(engine.basic_optimizer.param_groups, "optimizer", found, seen)
    if engine.optimizer is not engine.basic_optimizer:
        for name, value in vars(engine.optimizer).items():
            _storages(value, "gradients" if "grad" in name else "buffers", found, seen)
    out = dict.fromkeys(STATES, 0)
    for path, nbytes in found.values():
        out[path.split(".")[0]] += nbytes
    return out


@uses_deepspeed
def _engine_holds_the_planned_bytes():
    import torch.distributed as dist
    from deepspeed.runtime.pipe import schedule

    from launch.analysis import engine_memory
    from launch.analysis.partition import with_stage_boundaries
    from launch.analysis.plan_setup import GPUS, Hardware, Setup
    from launch.analysis.planner import estimate_plan
    from launch.analysis.stage_memory import stage_groups
    from launch.config.layout import check_and_derive_layout
    from launch.config.recipe import load_recipe
    from launch.engine.engine import build_engine
    from launch.instruments.comm_counter import CommCounter
    from model.parallel.state import init_parallel_state

    gpu = GPUS["H100"]
    for recipe_path, overrides, tp, pp in LAYOUTS:
        recipe = load_recipe(recipe_path, overrides + FEW_MICRO_BATCHES)
        # The training run's layout and stage boundaries (launch/trainer/startup.py).
        layout = with_stage_boundaries(check_and_derive_layout(recipe, dist.get_world_size(), tp, pp, True), recipe,
                                       VOCAB)
        config = recipe.gpt_config(VOCAB)
        state = init_parallel_state(tp, pp)
        engine, _ = build_engine(recipe, layout, state, config)
        held = {}
        handlers = dict(engine._INSTRUCTION_MAP)
        reduce_grads = handlers[schedule.ReduceGrads]

        def count_then_reduce(eng, **kwargs):  # the end of the step's last backward
            held.update(held_bytes(eng))
            reduce_grads(eng, **kwargs)
        tokens = torch.randint(0, VOCAB, (2, layout.grad_accum_steps, layout.micro_batch_size, config.seq_len + 1))
        engine.train_batch(iter([(t[:, :-1], t[:, 1:]) for t in tokens[0]]))  # Adam's state now exists
        handlers[schedule.ReduceGrads] = count_then_reduce
        engine._INSTRUCTION_MAP = handlers
        counter = CommCounter(state.topology, state.global_rank, tempfile.mkdtemp())
        counter.install(engine)
        engine.train_batch(iter([(t[:, :-1], t[:, 1:]) for t in tokens[1]]))

        train = recipe.train
        setup = Setup(gpus=layout.world_size, tp=tp, pp=pp, micro_batch=train.micro_batch_size,
                      global_batch=train.global_batch_size, zero=train.zero_stage, recompute=train.recompute,
                      partition=train.partition, schedule=train.schedule, precision=train.precision,
                      grad_accum_fusion=train.grad_accum_fusion)
        plan = estimate_plan(dataclasses.replace(recipe.model, vocab_size=VOCAB), setup,
                             Hardware(gpu.peak_flops, gpu.intra_node_bw, gpu.inter_node_bw))
        planned = plan["memory_per_stage_bytes"][state.pp_rank]
        where = (f"{train.precision} zero {train.zero_stage} (tp {tp}, pp {pp}, dp {layout.dp}), "
                 f"rank {state.global_rank}")
        assert held == {k: planned[k] for k in STATES}, f"{where}: engine holds {held}, planned {planned}"
        # The tensors the engine's per-tensor costs are charged by (launch/analysis/parameter_tensors.py).
        tensors = len(list(engine.module.parameters()))
        assert plan["parameter_tensors_per_stage"][state.pp_rank] == tensors, (where, plan["parameter_tensors_per_stage"], tensors)

        groups = stage_groups(config, tp, pp, state.pp_rank, list(engine.module.parts))
        reduced = sum(nbytes for (purpose, _, _), (_, _, nbytes) in counter.counts["step 1"].items()
                      if purpose == "dp-grads")
        # The stage built: ZeRO-0 for fp32 at dp 1, which skips the reduction there.
        predicted = engine_memory.dp_allreduce_bytes(train.precision, engine.zero_optimization_stage(), layout.dp, *groups)
        assert reduced == predicted, f"{where}: DP all-reduce moved {reduced} bytes, planned {predicted}"
        assert plan["comm_bytes_per_step"]["dp"] == (predicted if layout.dp > 1 else 0)


@pytest.mark.parametrize("processes", [2])
def test_engine_holds_what_the_planner_counts(processes):
    run_distributed(_engine_holds_the_planned_bytes, processes)
