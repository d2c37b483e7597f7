"""launch/plan.py's arguments resolved into what the planner evaluates: the model (ModelConfig),
the candidate layout and batch (Setup) and the hardware (Hardware), each field from its flag, else
the --recipe's value, else GPT-3 175B's default, with the flags' one-line checks. Separate from
plan_report.py, which turns the resolved plan into text, JSON and a chart: this holds only where
each input comes from."""
import argparse
import dataclasses
from typing import Any, Callable, Optional, Tuple

from launch.analysis.device_profile import DeviceProfile
from launch.analysis.engine_memory import REDUCE_BUCKET_ELEMENTS
from launch.analysis.partition import DEFAULT, parse_partition
from launch.analysis.plan_setup import GIB, GPUS, Hardware, Setup, device_hardware
from model.config import ModelConfig
from launch.config.recipe import load_recipe
from launch.errors import ConfigError

GPT3 = {"layers": 96, "hidden": 12288, "seq_len": 2048, "vocab": 51200}
GPT3_HEAD_DIM = 128


def resolve(args: argparse.Namespace, this_device: Optional[Callable] = None) -> Tuple[ModelConfig, Setup, Hardware]:
    """(ModelConfig, Setup, Hardware) from flags > recipe > GPT-3 defaults."""
    rm = rt = None
    if args.recipe is not None:
        recipe = load_recipe(args.recipe, [])
        rm, rt = recipe.model, recipe.train

    def pick(flag: Any, from_recipe: Any, default: Any) -> Any:
        return flag if flag is not None else from_recipe if from_recipe is not None else default

    hidden = pick(args.hidden, rm and rm.n_embd, GPT3["hidden"])
    vocab = pick(args.vocab, rm and rm.vocab_size, None)
    if vocab is None and rm is not None:  # the recipe takes the tokenizer's vocabulary
        if recipe.data.tokenizer != "builtin":
            raise ConfigError(f"recipe {str(args.recipe)!r} has model.vocab_size=null (the tokenizer's, "
                              f"{recipe.data.tokenizer!r}); pass --vocab N")
        from data.builtin import BUILTIN_VOCAB_SIZE  # slow import, only when needed
        vocab = BUILTIN_VOCAB_SIZE
    # The recipe's architecture switches (arch, n_kv_head, mlp, ...) carry over; flags set the dims.
    model = dataclasses.replace(rm or ModelConfig(), n_layer=pick(args.layers, rm and rm.n_layer, GPT3["layers"]),
                                n_embd=hidden, n_head=pick(args.heads, rm and rm.n_head, max(1, hidden // GPT3_HEAD_DIM)),
                                seq_len=pick(args.seq_len, rm and rm.seq_len, GPT3["seq_len"]),
                                vocab_size=vocab if vocab is not None else GPT3["vocab"],
                                vocab_pad_multiple=pick(args.vocab_pad_multiple, rm and rm.vocab_pad_multiple, 1))
    recompute = args.recompute or (rt.recompute if rt else "none")
    ds_settings = recipe.deepspeed if rm is not None else {}  # the recipe's own DeepSpeed settings
    comm_dtype = ds_settings.get("communication_data_type")
    if comm_dtype not in (None, "fp32", "bf16", "fp16"):
        raise ConfigError(f"deepspeed.communication_data_type={comm_dtype!r} must be fp32, bf16 or fp16")
    cut = parse_partition(args.partition) if args.partition is not None else rt.partition if rt else DEFAULT
    # train.cp arrives with the run's recipe fields; a recipe without it plans cp = 1.
    recipe_cp = rt.cp if rt else None
    setup = Setup(gpus=args.gpus, tp=args.tp, pp=args.pp, cp=pick(args.cp, recipe_cp, 1),
                  ep=pick(args.ep, rt.ep if rt else None, 1),
                  micro_batch=pick(args.micro_batch, rt and rt.micro_batch_size, 1),
                  global_batch=pick(args.global_batch, rt and rt.global_batch_size, 1536),
                  zero=pick(args.zero, rt and rt.zero_stage, 1), recompute=recompute,
                  partition=cut if isinstance(cut, str) else tuple(cut),
                  schedule=args.schedule or (rt.schedule if rt else "1f1b"),
                  virtual_stages=pick(getattr(args, "virtual_stages", None), rt and rt.virtual_stages, 1),
                  compile=bool(rt and rt.compile), document_mask=bool(rm is not None and recipe.data.document_mask),
                  precision=args.precision or (rt.precision if rt else "bf16"), communication_data_type=comm_dtype,
                  reduce_bucket_elements=int(ds_settings.get("zero_optimization", {}).get(
                      "reduce_bucket_size", REDUCE_BUCKET_ELEMENTS)),
                  grad_accum_fusion=rt.grad_accum_fusion if rt else True, expert_load=args.expert_load,
                  optimizer=args.optimizer or (rt.optimizer if rt else "adamw"))
    memory = args.gpu_memory
    for name, value in [("--gpu-memory", memory), ("--peak-tflops", args.peak_tflops),
                        ("--intra-node-gbps", args.intra_node_gbps), ("--inter-node-gbps", args.inter_node_gbps),
                        ("--gpus-per-node", args.gpus_per_node), ("--top", args.top)]:
        if value is not None and value <= 0:
            raise ConfigError(f"{name} {value} must be > 0")
    if args.plot is not None and not args.plot.parent.is_dir():
        raise ConfigError(f"--plot {str(args.plot)!r}: folder {str(args.plot.parent)!r} does not exist")
    if args.expert_load < 1:
        raise ConfigError(f"--expert-load {args.expert_load} must be >= 1 (the busiest expert's rows over the mean)")
    if not 0 < args.efficiency <= 1:
        raise ConfigError(f"--efficiency {args.efficiency} must be in (0, 1]")
    if args.calibrate and args.profile is not None:
        raise ConfigError("--calibrate measures a profile and --profile reads one: give one of them")
    hardware = device_hardware_of(args, setup.precision, this_device)
    # --gpu-memory is the budget as given; else --search keeps a candidate within the device's
    # memory less the headroom (plan_setup.usable_memory_bytes); a single plan checks nothing.
    hardware = dataclasses.replace(hardware, memory_bytes=memory * GIB if memory is not None else
                                   hardware.memory_bytes if args.search else None)
    if args.profile is not None:
        hardware = dataclasses.replace(hardware, profile=read_profile(args.profile))
    return model, setup, hardware


THIS_DEVICE = "this"
"""--gpu this: the GPU this process sees, as --layout auto and a run's prediction take it."""


def device_hardware_of(args: argparse.Namespace, precision: str, this_device: Optional[Callable] = None) -> Hardware:
    """--gpu's Hardware: a datasheet entry (GPUS) with the flags' overrides, or with `--gpu this`
    the device here through the one function --layout auto uses: `this_device`, which launch/plan.py
    hands in (launch/autotune/step_prediction.py: this_device_hardware, a layer above this one)."""
    if args.gpu == THIS_DEVICE:
        import torch
        if not torch.cuda.is_available() or this_device is None:
            raise ConfigError(f"--gpu {THIS_DEVICE}: no GPU is visible here; name one of {', '.join(sorted(GPUS))}")
        hardware, why_not = this_device(precision, args.gpus_per_node)
        if hardware is None:  # an unknown device, not calibrated yet (--calibrate without --gpu this caches one)
            raise ConfigError(f"--gpu {THIS_DEVICE}: {why_not}")
        overrides = {"peak_flops": args.peak_tflops and args.peak_tflops * 1e12,
                     "intra_node_bw": args.intra_node_gbps and args.intra_node_gbps * 1e9,
                     "inter_node_bw": args.inter_node_gbps and args.inter_node_gbps * 1e9}
        return dataclasses.replace(hardware, **{k: v for k, v in overrides.items() if v})
    gpu = GPUS[args.gpu]
    gpu = dataclasses.replace(gpu, peak_flops=args.peak_tflops * 1e12 if args.peak_tflops else gpu.peak_flops,
                              intra_node_bw=args.intra_node_gbps * 1e9 if args.intra_node_gbps else gpu.intra_node_bw,
                              inter_node_bw=args.inter_node_gbps * 1e9 if args.inter_node_gbps else gpu.inter_node_bw)
    hardware, _ = device_hardware(args.gpu, None, None, args.gpus_per_node, precision, args.efficiency, args.roofline,
                                  gpu=gpu)
    return hardware


def read_profile(path) -> DeviceProfile:
    try:
        return DeviceProfile.from_json(path.read_text())
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"--profile {str(path)!r} is not a device profile ({type(e).__name__}); "
                          f"write one with launch/plan.py --calibrate") from None
