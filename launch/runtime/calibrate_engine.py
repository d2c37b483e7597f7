"""What DeepSpeed's pipeline engine costs around the model (issue 36, item 1: "the fixed cost per
micro-batch of the pipeline engine"): its instructions per micro-batch (load, forward, backward
and their bookkeeping) and per step (the loss and gradient-norm reductions, clipping, the
optimizer's call, the gradient reduction's calls), measured in the calibration's process group
on a layer that costs nothing, so only the engine's own time is left.

`train_batch` with m micro-batches takes per_step + m x per_microbatch: timed at m = 1 and m =
PROBE_MICROBATCHES, the difference gives the slope. Every rank runs the same number of steps (the
engine's collectives pair up)."""
from typing import Tuple

PROBE_MICROBATCHES = 8
PROBE_STEPS = 6  # timed, after one warm-up step
WIDTH = 8  # the probe layer's features: its arithmetic is nothing beside the engine's


def _step_seconds(procs: int, micro_batches: int, dtype: str, zero: int) -> float:
    """Median seconds of `train_batch` with `micro_batches` micro-batches of one sample."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    from launch.runtime.calibrate_timing import median_seconds
    from launch.runtime.console import quiet_stdout
    element = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": micro_batches,
              "train_batch_size": micro_batches * procs, "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": zero}}
    if dtype == "bf16":
        config.update(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"})
    with quiet_stdout(True):  # DeepSpeed prints its topology and layers
        module = PipelineModule(layers=[LayerSpec(torch.nn.Linear, WIDTH, WIDTH)],
                                topology=PipeModelDataParallelTopology(num_pp=1, num_mp=1, num_dp=procs),
                                loss_fn=lambda out, target: (out.float() - target.float()).square().mean())
        engine, *_ = deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=config)
    sample = (torch.zeros(1, WIDTH, dtype=element), torch.zeros(1, WIDTH, dtype=element))

    def batches():
        while True:
            yield sample
    data = batches()
    return median_seconds(lambda: engine.train_batch(data), PROBE_STEPS, before=dist.barrier)


def engine_overheads(procs: int, dtype: str, zero: int = 1) -> Tuple[float, float]:
    """(seconds per step, seconds per micro-batch) of the engine alone, in the group already started."""
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)  # adopts the calibration's process group
    one = _step_seconds(procs, 1, dtype, zero)
    many = _step_seconds(procs, PROBE_MICROBATCHES, dtype, zero)
    per_microbatch = max(0.0, (many - one) / (PROBE_MICROBATCHES - 1))
    return max(0.0, one - per_microbatch), per_microbatch
