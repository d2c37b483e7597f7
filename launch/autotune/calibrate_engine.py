"""What DeepSpeed's pipeline engine costs around the model (the device profile's fixed
cost per micro-batch): its instructions per micro-batch (load, forward, backward
and their bookkeeping) and per step (the loss and gradient-norm reductions, clipping, the
optimizer's call, the gradient reduction's calls), measured in the calibration's process group
on a layer that costs nothing, so only the engine's own time is left.

Much of that time is per parameter tensor, not per layer or per byte: ZeRO-1 hooks every
parameter's gradient (each micro-batch's backward), and reduces, clips and copies back per
parameter at the step. On this 2-core machine 60 tensors of 8 elements added about 10 ms a
micro-batch and 20 ms a step at dp 4 (4 processes), as much as a tiny model's arithmetic. So the
probe's layer holds `n` tensors of WIDTH elements, and a step of m micro-batches is modelled as

    seconds = per_step + n x per_tensor_step + m x (per_microbatch + n x per_tensor_microbatch),

timed at m in (1, PROBE_MICROBATCHES) and n in (FEW_TENSORS, MANY_TENSORS): the four corners give
the four costs (the planner charges each stage by the tensors it holds). Every rank runs the same
number of steps (the engine's collectives pair up). On GPUs the same probe runs on each process's
device in the NCCL group, each timed step ended by a synchronize."""
from dataclasses import dataclass

PROBE_MICROBATCHES = 8
PROBE_STEPS = 6  # timed, after one warm-up step
WIDTH = 8  # elements of each probe tensor: their arithmetic is nothing beside the engine's
FEW_TENSORS, MANY_TENSORS = 2, 64  # a real stage holds tens to hundreds (GPT-2 124M: 12 a block)


@dataclass(frozen=True)
class EngineOverheads:
    per_step_s: float
    per_microbatch_s: float
    per_tensor_step_s: float
    per_tensor_microbatch_s: float


def _probe_layer(tensors: int):
    """A pipeline layer of `tensors` parameters of WIDTH elements, each in the output's graph."""
    import torch

    class ProbeLayer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(WIDTH)) for _ in range(tensors))

        def forward(self, x):  # (1, WIDTH) -> (1, WIDTH)
            return x + torch.stack(list(self.weights)).sum(dim=0).to(x.dtype)
    return ProbeLayer()


def _step_seconds(procs: int, micro_batches: int, tensors: int, dtype: str, zero: int) -> float:
    """Median seconds of `train_batch` with `micro_batches` micro-batches of one sample."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    from launch.autotune.calibrate_timing import median_seconds
    from launch.engine.console import quiet_stdout
    element = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": micro_batches,
              "train_batch_size": micro_batches * procs, "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": zero}}
    if dtype == "bf16":
        config.update(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"})
    with quiet_stdout(True):  # DeepSpeed prints its topology and layers
        module = PipelineModule(layers=[_probe_layer(tensors).to(element)],
                                topology=PipeModelDataParallelTopology(num_pp=1, num_mp=1, num_dp=procs),
                                loss_fn=lambda out, target: (out.float() - target.float()).square().mean())
        engine, *_ = deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=config)
    sample = (torch.zeros(1, WIDTH, dtype=element, device=device), torch.zeros(1, WIDTH, dtype=element, device=device))

    def batches():
        while True:
            yield sample
    data = batches()
    return median_seconds(lambda: (engine.train_batch(data), sync()), PROBE_STEPS,
                          before=lambda: (dist.barrier(), sync()))


def engine_overheads(procs: int, dtype: str, zero: int = 1, backend: str = "gloo") -> EngineOverheads:
    """The engine's own costs (module docstring), in the group already started (`backend`: gloo on
    CPU, nccl on GPUs)."""
    from launch.engine.distributed import init_distributed
    # Adopts the calibration's process group; ours, not DeepSpeed's own: that one JIT-builds a CPU
    # shared-memory op first (35 s alone, 2-4 minutes beside the test suite, in each new environment).
    init_distributed(600, dist_backend=backend, verbose=False)
    per_step, per_microbatch = {}, {}
    for n in (FEW_TENSORS, MANY_TENSORS):
        one = _step_seconds(procs, 1, n, dtype, zero)
        many = _step_seconds(procs, PROBE_MICROBATCHES, n, dtype, zero)
        per_microbatch[n] = max(0.0, (many - one) / (PROBE_MICROBATCHES - 1))
        per_step[n] = max(0.0, one - per_microbatch[n])
    extra = MANY_TENSORS - FEW_TENSORS
    tensor_step = max(0.0, (per_step[MANY_TENSORS] - per_step[FEW_TENSORS]) / extra)
    tensor_microbatch = max(0.0, (per_microbatch[MANY_TENSORS] - per_microbatch[FEW_TENSORS]) / extra)
    return EngineOverheads(per_step_s=max(0.0, per_step[FEW_TENSORS] - FEW_TENSORS * tensor_step),
                           per_microbatch_s=max(0.0, per_microbatch[FEW_TENSORS] - FEW_TENSORS * tensor_microbatch),
                           per_tensor_step_s=tensor_step, per_tensor_microbatch_s=tensor_microbatch)
