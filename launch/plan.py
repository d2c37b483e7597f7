"""Plan a 3D-parallel layout before spending GPU hours.

  python launch/plan.py --layers 72 --hidden 10240 --heads 80 --seq-len 2048 --vocab 51200 \\
      --gpus 128 --tp 4 --pp 4 --micro-batch 8 --global-batch 256 --gpu-memory 80
  python launch/plan.py --recipe recipes/demo.yaml --gpus 8 --tp 2 --pp 2
  python launch/plan.py --recipe recipes/llama3.2-1b-32k.yaml --gpus 8 --cp 4 --tp 2   # context parallel
  python launch/plan.py --recipe recipes/mixtral-8x7b.yaml --gpus 64 --tp 4 --pp 2 --ep 8   # experts over 8 ranks
  python launch/plan.py ... --search          # every valid layout (and ep), fastest first
  python launch/plan.py ... --search --calibrate   # ranked with this machine's measured GEMMs
  python launch/plan.py ... --plot plan.png   # device grid + 1F1B schedule
  python launch/plan.py ... --partition blocks  # stages cut by block count (default: balanced)
  python launch/plan.py ... --schedule zb-h1 --plot zb.png  # the zero-bubble schedule, drawn
  python launch/plan.py ... --pp 4 --virtual-stages 2   # interleaved 1F1B, 2 chunks per rank

Model fields not given come from --recipe, else GPT-3 defaults (Brown et al. 2020, 175B):
96 layers, hidden 12288, heads = hidden / 128, sequence 2048, vocabulary 51200 (GPT-2's
50257 padded as in Narayanan et al. 2021). Memory is what DeepSpeed 0.19.8 allocates for the
precision and ZeRO stage (launch/analysis/engine_memory.py) and what a GPU's fused attention
stores (no s x s scores).
Formulas: launch/analysis/formulas.py; cost model of --search: launch/analysis/planner.py.
"""
import argparse
import os
import sys
from typing import List, Optional

from launch.analysis.plan_report import plan_output, plot
from launch.analysis.plan_args import THIS_DEVICE
from launch.analysis.plan_setup import GPUS
from launch.config.cli import OneLineErrorParser, local_path
from launch.config.recipe import PRECISIONS, RECOMPUTE_MODES, SCHEDULES
from launch.errors import ConfigError, report_bad_input


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model (default: --recipe's, else GPT-3 175B's)")
    m.add_argument("--recipe", type=local_path, help="YAML recipe: model dims, batch sizes, zero, recompute")
    m.add_argument("--layers", type=int, help="transformer blocks (GPT-3: 96)")
    m.add_argument("--hidden", type=int, help="hidden size (GPT-3: 12288)")
    m.add_argument("--heads", type=int, help="attention heads (GPT-3: hidden / 128)")
    m.add_argument("--seq-len", type=int, help="sequence length (GPT-3: 2048)")
    m.add_argument("--vocab", type=int, help="vocabulary (GPT-3: 51200)")
    m.add_argument("--vocab-pad-multiple", type=int, help="pad vocab to a multiple of this * tp (default 1)")
    lay = p.add_argument_group("layout and batch")
    lay.add_argument("--gpus", type=int, required=True, help="devices in the job (G)")
    lay.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    lay.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
    lay.add_argument("--cp", type=int, help="context-parallel degree: each rank holds seq/cp tokens of every "
                                            "sequence (default: the recipe's train.cp, else 1)")
    lay.add_argument("--ep", type=int, help="expert-parallel degree: each MoE block's experts split over ep ranks of "
                                            "the dp x cp data axis (default: the recipe's train.ep, else 1)")
    lay.add_argument("--optimizer", choices=["adamw", "muon"],
                     help="train.optimizer (default: recipe's, else adamw): Muon's one momentum, gathers and "
                          "Newton-Schulz FLOPs")
    lay.add_argument("--expert-load", type=float, default=1.0, metavar="F",
                     help="MoE: the busiest expert's routed rows over the mean (default 1, balanced; a run's metrics "
                          "record each block's expert_load)")
    lay.add_argument("--micro-batch", type=int, help="samples per micro-batch per replica (default: recipe's, else 1)")
    lay.add_argument("--global-batch", type=int, help="samples per step (default: recipe's, else 1536 as GPT-3)")
    lay.add_argument("--zero", type=int, choices=[0, 1], help="ZeRO stage (default: recipe's, else 1)")
    lay.add_argument("--recompute", choices=RECOMPUTE_MODES,
                     help="activation recompute: none, selective (the attention core) or full (whole blocks); "
                          "default: the recipe's train.recompute, else none")
    lay.add_argument("--precision", choices=PRECISIONS,
                     help="train.precision: decides DeepSpeed's optimizer, its buffers and the activations' bytes "
                          "(default: the recipe's, else bf16)")
    lay.add_argument("--schedule", choices=SCHEDULES,
                     help="pipeline schedule (default: the recipe's train.schedule, else 1f1b)")
    lay.add_argument("--virtual-stages", type=int, metavar="V",
                     help="chunks of the layer table per pipeline rank (interleaved 1F1B: bubble (p-1)/(v m), v "
                          "times the point-to-point sends, a deeper warm-up's activations); default: the recipe's "
                          "train.virtual_stages, else 1")
    lay.add_argument("--partition", metavar="balanced|blocks|N,N,...",
                     help="where stages are cut: balanced compute, equal blocks, or blocks per stage "
                          "(default: the recipe's train.partition, else balanced)")
    hw = p.add_argument_group("hardware (--gpu: a datasheet entry of launch/analysis/plan_setup.py GPUS, matched to "
                              "the name torch reports, e.g. H100 " + ", ".join(
        f"{g.peak_flops / 1e12:.0f} TFLOP/s, {g.memory_gib:g} GiB, {g.intra_node_bw / 1e9:.0f} GB/s in node, "
        f"{g.inter_node_bw / 1e9:.0f} GB/s across" for g in [GPUS["H100"]]) + "; or `this`)")
    hw.add_argument("--gpu", choices=sorted(GPUS) + [THIS_DEVICE], default="H100",
                    help="GPU type (default H100, the SXM); `this`: the GPU this process sees, its name, memory "
                         "and cached calibration as --layout auto takes them")
    hw.add_argument("--gpu-memory", type=float, help="GiB per device (plan: no check if absent; --search: the "
                                                    "--gpu's memory less a headroom for the CUDA context and "
                                                    "fragmentation)")
    hw.add_argument("--gpus-per-node", type=int, default=8, help="(default 8)")
    hw.add_argument("--peak-tflops", type=float, help="dense bf16 TFLOP/s per GPU")
    hw.add_argument("--intra-node-gbps", type=float, help="GB/s per GPU one way inside a node")
    hw.add_argument("--inter-node-gbps", type=float, help="GB/s per GPU one way across nodes")
    hw.add_argument("--efficiency", type=float, default=0.5,
                    help="datasheet cost model: fraction of peak every GEMM reaches (default 0.5)")
    hw.add_argument("--roofline", action="store_true",
                    help="datasheet profile: each GEMM at most its arithmetic intensity x the memory bandwidth "
                         "(small per-rank GEMMs slow down; docs/planner-and-metrics.md)")
    hw.add_argument("--calibrate", action="store_true",
                    help="measure this machine's GEMMs (the candidates' shapes, in --precision) and memory "
                         "bandwidth, with min(--gpus, --gpus-per-node) processes at once on CPU; cached under "
                         "$GPT3D_CACHE/calibration (launch/autotune/calibrate.py)")
    hw.add_argument("--profile", type=local_path, metavar="FILE.json",
                    help="a device profile saved by --calibrate (another machine's, or a given table)")
    out = p.add_argument_group("output")
    out.add_argument("--search", action="store_true",
                     help="rank every valid layout for --gpus (ignores --tp, --cp, --pp, --ep, --micro-batch)")
    out.add_argument("--top", type=int, default=10, help="layouts --search shows (default 10)")
    out.add_argument("--json", action="store_true", help="one JSON object instead of text")
    out.add_argument("--plot", type=local_path, metavar="FILE.png", help="draw the device grid and 1F1B schedule")
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    try:
        args = parse_args(argv)
        measure = None
        if args.calibrate:
            from launch.autotune.calibrate import calibrated_profile  # torch: only when measuring
            measure = calibrated_profile
        this_device = None
        if args.gpu == THIS_DEVICE:
            from launch.autotune.step_prediction import this_device_hardware  # torch: only for --gpu this
            this_device = this_device_hardware
        output, chosen = plan_output(args, measure, this_device)
    except ConfigError as e:
        return report_bad_input(e)
    print(output)
    if args.plot is not None:
        plot(args.plot, chosen)
        if not args.json:
            print(f"\nwrote {args.plot}")
    return 0


if __name__ == "__main__":
    # The planner uses only DeepSpeed's pure helpers: skip its accelerator probe and warning.
    # Set here, not at import, so importing this module never changes another process's device.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    sys.exit(main())
