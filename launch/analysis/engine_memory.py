"""The model states DeepSpeed 0.19.8's engine allocates on one rank, per precision and ZeRO stage,
and the bytes its data-parallel gradient all-reduce moves: what the planner counts, checked
against the tensors a real engine holds (tests/analysis/test_plan_engine.py).

The ZeRO paper's 16 bytes per parameter (memory_formulas.model_state_bytes, [R20] sec. 3.1) leave
out what this engine adds. Which optimizer wraps AdamW follows the engine's own choice
(`DeepSpeedEngine._do_optimizer_sanity_check`):
  fp32, ZeRO-0   torch's AdamW on the parameters: weights 4, .grad 4, Adam moments 8 bytes each.
  bf16, ZeRO-1   BF16_Optimizer (docs/design.md contract 8): bf16 weights 2, the fp32
                 gradient-accumulation buffer 4 (whole, not split over dp), fp32 master weights
                 4/d and moments 8/d; a bf16 .grad 2 only for the parameters whose gradient does
                 not go straight into the buffer (train.grad_accum_fusion: biases, norms, learned
                 positions; every parameter with the fusion off).
  fp32 or fp16, ZeRO-1   DeepSpeedZeroOptimizer (stage 1): weights and .grad in the model dtype,
                 fp32 master weights 4/d (a copy even in fp32) and moments 8/d, and, from the
                 first backward to the reduction, a reduce bucket of reduce_bucket_size elements
                 (5e8 by default: 1.9 GiB in fp32) whatever the model's size.
  fp16, ZeRO-0   FP16_Optimizer: weights and .grad 2, fp32 master weights 4 and moments 8 (read
                 from DeepSpeed's code, not measured: fp16 is a CPU test mode here).
Every ZeRO-1 path flattens each parameter group (matrices; biases and norms) into one tensor
padded to a multiple of 2*d elements (nccl_start_alignment_factor), so those terms count the
padded sizes. Scalars (AdamW's step counts, kept on the host; the last gradient norm) are not
model states and are not counted.
"""
from typing import Dict, List, Optional, Tuple

ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
FP32 = 4
ADAM_MOMENTS = 2  # exp_avg, exp_avg_sq: fp32, shaped as the master weights
ALIGNMENT = 2  # DeepSpeed nccl_start_alignment_factor: each flat group padded to a multiple of 2*d
REDUCE_BUCKET_ELEMENTS = 500_000_000  # DeepSpeed's zero_optimization.reduce_bucket_size default


def padded_group(elements: int, dp: int) -> int:
    """One flattened parameter group as ZeRO-1 allocates it: padded to a multiple of 2*d."""
    alignment = ALIGNMENT * dp
    return -(-elements // alignment) * alignment


def built_zero_stage(zero_stage: int, precision: str, data_ranks: int, experts: bool = False) -> int:
    """The ZeRO stage the run's engine is built with: the recipe's `zero_stage`, except 0 for a dense
    fp32 model on one data-parallel rank (dp x cp = 1). There ZeRO-1 partitions nothing and only
    adds a flat fp32 copy of every weight, its gradient hooks and copies, and a wrapped optimizer
    step (25-35 ms of a 900 ms tp 2 step). fp16 keeps ZeRO-1 (its ZeRO-0 is another
    optimizer, FP16_Optimizer, whose checkpoints launch/checkpoints/reshard.py does not read), bf16
    has no ZeRO-0 path, and a mixture of experts keeps its expert files' ZeRO-1 layout."""
    return 0 if data_ranks == 1 and precision == "fp32" and not experts else zero_stage


def reduces_gradients(precision: str, zero_stage: int, data_ranks: int) -> bool:
    """Whether the engine runs DeepSpeed's data-parallel gradient reduction: not a ZeRO-0 fp32 one
    on one data rank, where it would flatten every gradient, all-reduce it over that one rank and
    copy it back (launch/engine/engine.py switches it off: 9 ms of a 750 ms tp 2 step)."""
    return not (zero_stage == 0 and precision == "fp32" and data_ranks == 1)


def uses_bf16_optimizer(precision: str, zero_stage: int) -> bool:
    """bf16 weights with fp32 gradient accumulation at ZeRO-1: DeepSpeed's BF16_Optimizer."""
    return precision == "bf16" and zero_stage == 1


def gradient_bytes(precision: str, zero_stage: int, params: int, padded: int,
                   params_with_grad: Optional[int] = None) -> int:
    """The gradients one rank holds at the end of a step's backward, in two explicit parts:
      fp32 accumulation buffer  BF16_Optimizer's flat fp32 copy of every gradient (4 bytes per
                                padded element), into which each micro-batch's .grad is added;
      .grad                     autograd's gradient, in the model dtype, of each parameter that
                                still gets one (`params_with_grad`, None: every parameter; a
                                weight whose gradient is added straight into the fp32 buffer
                                allocates none: stage_memory.params_with_bf16_grad).
    `padded`: the flat groups' padded size (padded_group)."""
    buffer = FP32 * padded if uses_bf16_optimizer(precision, zero_stage) else 0
    dot_grad = ELEMENT_BYTES[precision] * (params if params_with_grad is None else params_with_grad)
    return buffer + dot_grad


def model_state_bytes_per_rank(precision: str, zero_stage: int, dp: int, matrices: int, vectors: int,
                               reduce_bucket_elements: int = REDUCE_BUCKET_ELEMENTS,
                               params_with_grad: Optional[int] = None) -> Dict[str, int]:
    """{weights, gradients, optimizer, buffers}: bytes one rank holds at the end of backward
    (the peak of the model states: every gradient and, from the first step on, the optimizer's
    state), for a stage of `matrices` weight-decayed and `vectors` other parameters on this rank
    (launch/engine/engine.py: param_groups, two groups)."""
    if precision not in ELEMENT_BYTES or zero_stage not in (0, 1):
        raise ValueError(f"precision={precision!r} zero_stage={zero_stage}: fp32, bf16 or fp16 at ZeRO 0 or 1")
    element, params = ELEMENT_BYTES[precision], matrices + vectors
    flat = zero_stage == 1  # ZeRO-1 (and the BF16_Optimizer) flatten and pad each group
    padded = padded_group(matrices, dp) + padded_group(vectors, dp) if flat else params
    master = 0 if precision == "fp32" and zero_stage == 0 else FP32 * padded // (dp if flat else 1)
    moments = ADAM_MOMENTS * FP32 * padded // (dp if flat else 1)
    bucket = element * reduce_bucket_elements if flat and not uses_bf16_optimizer(precision, zero_stage) else 0
    return {"weights": element * padded,
            "gradients": gradient_bytes(precision, zero_stage, params, padded, params_with_grad),
            "optimizer": master + moments, "buffers": bucket}


def reduce_dtype(precision: str) -> str:
    """The dtype the run's DP all-reduce uses unless the recipe sets deepspeed.communication_data_type:
    fp32 for bf16 (launch/engine/ds_config.py sets it, docs/design.md contract 8), else the model's."""
    return "fp32" if precision == "bf16" else precision


def dp_allreduce_bytes(precision: str, zero_stage: int, dp: int, matrices: int, vectors: int,
                       communication_data_type: Optional[str] = None) -> int:
    """Bytes this rank hands to the data-parallel gradient all-reduce per step. DeepSpeed casts
    the gradients to `communication_data_type` (the recipe's `deepspeed.communication_data_type`;
    unset, `reduce_dtype`, which our DeepSpeed config sets: DeepSpeed's own default is the model
    dtype, DeepSpeedEngine.communication_data_type) and reduces the BF16_Optimizer's padded flat
    fp32 buffers, ZeRO-1's or torch's gradients unpadded (as --comm-counts measures them); none
    where the engine skips the reduction (reduces_gradients)."""
    if not reduces_gradients(precision, zero_stage, dp):
        return 0
    element = ELEMENT_BYTES[communication_data_type or reduce_dtype(precision)]
    if uses_bf16_optimizer(precision, zero_stage):
        return element * (padded_group(matrices, dp) + padded_group(vectors, dp))
    return element * (matrices + vectors)


def adamw_step_temporary_bytes(zero_stage: int, groups: List[Tuple[int, int]]) -> int:
    """What torch's AdamW allocates during the step, beyond its state: AdamW.step updates one parameter
    group per call, and its foreach path (_multi_tensor_adam: the default for CUDA tensors, which
    DeepSpeed's torch_adam keeps by passing foreach=None) makes one fp32 tensor per parameter,
    torch._foreach_sqrt(exp_avg_sqs), freed when the group is done: 4 bytes per element of the
    largest group the rank steps. `groups`: each group's (elements, the ranks ZeRO-1 partitions it
    over); ZeRO-1 steps each group's padded flat partition (padded_group / d), ZeRO-0 the
    parameters. (The single-tensor path, CPU's default, holds 8 bytes of one tensor at a time:
    the sqrt and its quotient.)"""
    stepped = [padded_group(n, d) // d if zero_stage >= 1 else n for n, d in groups if n]
    return FP32 * max(stepped, default=0)
