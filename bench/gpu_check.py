"""The first run on a GPU machine, in one command and under 10 minutes: is it right, how fast, how big.

    python bench/gpu_check.py                        # NVIDIA GPU(s), no network
    python bench/gpu_check.py --devices 1            # only the first GPU (the one-GPU checks)
    python bench/gpu_check.py --cpu --devices 1      # the same checks on CPU processes, at toy sizes
    python bench/gpu_check.py --checks document-mask,zb-h1   # some of the checks

1. parity: recipes/tiny.yaml, fp32, 5 steps, through launch/train.py at (tp, pp, dp) = (1,1,1)
   and, with 2 devices or more, (1,2,1) and (2,1,1). Losses and gradient norms against (1,1,1),
   within 1e-5 relative (the CPU tests' bar). With one GPU, (1,1,1) on the GPU against (1,1,1) on
   the CPU instead: different kernels (cuBLAS, flash attention), so the bar is 1e-4.
2. gpt2-mfu: tokens/s and MFU of the GPT-2 124M recipe (bf16, one device, bench/gpu_mfu.py), and
   its measured per-step peak memory against launch/plan.py's prediction.
3. llama-mfu: the same for recipes/llama3.2-1b.yaml (bf16, selective recompute, 8 x 4 samples of
   2048 tokens, 15 steps, the first 5 left out), against the planner's prediction with the
   recipe's selective recompute and fused attention (no s x s scores stored).
4. document-mask: data.document_mask (flex_attention on a GPU with dropout 0) against the default
   SDPA causal path, on a corpus of one document, where the two masks are the same: the losses
   and gradient norms of 8 steps within 1e-4 relative, and the step-time ratio. llama3.2-1b cut
   to 4 blocks, fp32 (the kernels' own rounding, not bf16's), 4 samples of 2048 tokens a step.
5. zb-h1: train.schedule=zb-h1 against 1f1b at pp = 2 (2 devices), the GPT-2 124M recipe in
   fp32, 8 micro-batches of 4: losses and gradient norms identical to the bit, the step-time ratio.
6. grad-accum-fusion: the bf16 weight-gradient GEMM that adds into the fp32 main gradient
   (model/parallel/weight_grad.py add_product_into, train.grad_accum_fusion) at Llama-2-7B's MLP shape
   (4096 x 11008 weight, 8192 tokens): which GEMM path this torch build takes, its error against
   an fp32 GEMM of the same bf16 operands, and its time against the unfused bf16 GEMM, cast and add.
A check the machine cannot run (zb-h1 on one device) is a row marked skipped, with the reason.
It ends with one summary table. Paste it into docs with the date and the device.

Time on one H200 (989 TFLOP/s dense bf16, about 67 fp32; estimated at 40% of peak, plus about
30 s of start-up per launched run): parity 2 runs, 60 s; gpt2-mfu 30 steps of 5.6e13 FLOPs
(0.14 s), 35 s; llama-mfu 15 steps of 5.4e14 FLOPs (1.4 s), 60 s with the 1.2B model's
initialisation; document-mask 2 runs of 8 steps of 2.7e13 FLOPs in fp32 (1 s), 110 s with
flex_attention's compilation; grad-accum-fusion 22 GEMMs of 7.4e11 FLOPs, under 5 s: about 4.5
minutes. With 2 GPUs, parity 90 s and zb-h1 2 runs of
8 steps of 2.8e13 FLOPs in fp32 on 2 devices (0.6 s), 70 s: about 6.5 minutes.
With --cpu every check runs at toy sizes (tests/analysis/test_gpu_check.py runs the document-mask and
zb-h1 checks so at --devices 1).
"""
import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.gpu_check_runs import (identical, max_relative_difference, one_document_corpus, step_time_ratio, train)
from bench.gpu_mfu import OFFLINE

REPO = Path(__file__).resolve().parent.parent
TINY, LLAMA_TINY = REPO / "recipes" / "tiny.yaml", REPO / "recipes" / "llama-tiny.yaml"
LLAMA, GPT2 = REPO / "recipes" / "llama3.2-1b.yaml", REPO / "recipes" / "gpt2-124m.yaml"
CHECKS = ("parity", "gpt2-mfu", "llama-mfu", "document-mask", "zb-h1", "grad-accum-fusion")
STEPS = 5
SKIPPED = "skipped"


def parity(devices: int, workdir: Path, on_cpu: bool) -> list:
    """Rows of the parity runs this machine allows."""
    def tiny(tp: int, pp: int, cpu: bool) -> list:
        return train(TINY, [], tp, pp, STEPS, workdir / f"tiny-tp{tp}-pp{pp}-{'cpu' if cpu else 'gpu'}.jsonl", cpu)

    def row(what: str, diff: float, bar: float) -> tuple:
        return what, f"max rel. diff {diff:.1e}", f"<= {bar:.0e}", "ok" if diff <= bar else "FAIL"
    reference = tiny(1, 1, on_cpu)
    if devices >= 2:
        return [row("tiny (1,2,1) vs (1,1,1)", max_relative_difference(reference, tiny(1, 2, on_cpu)), 1e-5),
                row("tiny (2,1,1) vs (1,1,1)", max_relative_difference(reference, tiny(2, 1, on_cpu)), 1e-5)]
    # One device: that device against the CPU (with --cpu both are CPU runs: the branch is exercised).
    return [row("tiny (1,1,1) device vs CPU", max_relative_difference(tiny(1, 1, True), reference), 1e-4)]


def mfu_rows(recipe: Path, on_cpu: bool, extra: list) -> list:
    """bench/gpu_mfu.py's throughput and peak memory of one recipe (bf16, one device), the peak
    against launch/plan.py's prediction for the model, micro-batch and step it trained."""
    cmd = [sys.executable, str(REPO / "bench" / "gpu_mfu.py"), "--recipes", recipe.stem, "--json"] + extra
    proc = subprocess.run(cmd + (["--tiny"] if on_cpu else []), cwd=REPO, capture_output=True, text=True, timeout=600)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"bench/gpu_mfu.py failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    run = json.loads(lines[-1])["results"][0]
    mfu = "n/a (no peak on CPU)" if run["mfu"] is None else f"MFU {run['mfu']:.1%}"
    planned = planned_memory(recipe, run)
    return [(f"{recipe.stem} bf16 throughput", f"{run['tokens_per_s']:,.0f} tok/s",
             f"{run['tflops_per_device']:.3g} TFLOP/s", mfu),
            (f"{recipe.stem} peak memory", f"measured {run['peak_memory_bytes'] / 2 ** 30:.2f} GiB",
             f"planned {planned / 2 ** 30:.2f} GiB", f"ratio {run['peak_memory_bytes'] / planned:.2f}")]


def planned_memory(recipe: Path, run: dict) -> int:
    """launch/plan.py's bytes per device for the run's model (the recipe's architecture and
    recompute, the run's dims), micro-batch and step size on one device."""
    cmd = [sys.executable, str(REPO / "launch" / "plan.py"), "--gpus", "1", "--json", "--recipe", str(recipe),
           "--layers", str(run["n_layer"]), "--hidden", str(run["n_embd"]), "--heads", str(run["n_head"]),
           "--seq-len", str(run["seq_len"]), "--vocab", str(run["vocab_size"]), "--vocab-pad-multiple", "128",
           "--micro-batch", str(run["micro_batch_size"]), "--global-batch", str(run["global_batch_size"])]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise SystemExit(f"launch/plan.py failed: {proc.stdout[-1000:]}{proc.stderr[-1000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["memory_per_device_bytes"]


def document_mask(workdir: Path, on_cpu: bool) -> list:
    """The document-mask path against the SDPA causal path where both masks are the causal mask."""
    corpus = one_document_corpus(workdir / "one-document.jsonl")
    data = ["data.name=" + str(corpus), "data.config=null", "data.tokenizer=builtin", "data.streaming=false",
            "data.val_fraction=0.0", "train.eval_every=0", "wandb.mode=disabled", "train.precision=fp32",
            "model.dropout=0.0"]
    if on_cpu:  # the CPU path: SDPA with the boolean document mask
        recipe, steps, warmup, bar = LLAMA_TINY, 4, 1, 1e-5
        shape = ["train.micro_batch_size=2", "train.global_batch_size=4"]
    else:
        recipe, steps, warmup, bar = LLAMA, 8, 3, 1e-4
        shape = ["model.n_layer=4", "train.micro_batch_size=4", "train.global_batch_size=4"]
    runs = {mask: train(recipe, data + shape + [f"data.document_mask={mask}"], 1, 1, steps,
                        workdir / f"document-mask-{mask}.jsonl", on_cpu) for mask in ("false", "true")}
    diff = max_relative_difference(runs["false"], runs["true"])
    ratio = step_time_ratio(runs["true"], runs["false"], warmup)
    return [(f"{recipe.stem} document mask vs SDPA causal, fp32", f"max rel. diff {diff:.1e}",
             f"<= {bar:.0e}", ("ok" if diff <= bar else "FAIL") + f", step time x{ratio:.2f}")]


def zero_bubble(devices: int, workdir: Path, on_cpu: bool) -> list:
    """ZB-H1 against 1F1B at pp = 2: the same arithmetic in another order, so the same bits."""
    what = "zb-h1 vs 1f1b at pp=2, fp32"
    if devices < 2:
        return [(what, SKIPPED, f"needs 2 devices, {devices} here", SKIPPED)]
    if on_cpu:
        recipe, sets, steps, warmup = TINY, ["train.eval_every=0"], 4, 1  # steps timed alike
    else:
        recipe, steps, warmup = GPT2, 8, 3
        sets = OFFLINE + ["train.precision=fp32", "train.micro_batch_size=4", "train.global_batch_size=32"]
    runs = {schedule: train(recipe, sets + [f"train.schedule={schedule}"], 1, 2, steps,
                            workdir / f"schedule-{schedule}.jsonl", on_cpu) for schedule in ("1f1b", "zb-h1")}
    same = identical(runs["1f1b"], runs["zb-h1"])
    ratio = step_time_ratio(runs["zb-h1"], runs["1f1b"], warmup)
    measured = "losses, grad norms identical" if same else \
        f"max rel. diff {max_relative_difference(runs['1f1b'], runs['zb-h1']):.1e}"
    return [(f"{recipe.stem} {what}", measured, "bit-identical", ("ok" if same else "FAIL") + f", step time x{ratio:.2f}")]


def grad_accum_fusion(on_cpu: bool) -> list:
    """The fused weight-gradient GEMM against an fp32 reference, and its time against the path
    without fusion (a bf16 product, cast to fp32 and added: DeepSpeed's per-micro-batch work)."""
    import torch
    from model.parallel.weight_grad import add_product_into, mixed_gemm_path
    device = torch.device("cpu" if on_cpu else "cuda")
    out, tokens, inner = (256, 512, 1024) if on_cpu else (11008, 8192, 4096)  # (out, N) @ (N, in)
    left = torch.randn(out, tokens, device=device).bfloat16()
    right = torch.randn(tokens, inner, device=device).bfloat16()
    main = torch.zeros(out, inner, device=device)
    want = left.float() @ right.float()
    add_product_into(main, left, right)
    error = ((main - want).abs().max() / want.abs().max()).item()

    def seconds(step) -> float:
        step()  # warm-up
        if not on_cpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            step()
        if not on_cpu:
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / 10
    fused = seconds(lambda: add_product_into(main, left, right))
    unfused = seconds(lambda: main.add_(torch.mm(left, right).float()))
    path = "fp32 operands (CPU)" if on_cpu else mixed_gemm_path(device)
    # fp32 accumulation: only the summation order differs; the last fallback rounds the product to bf16
    bar = 1e-2 if path == "mm-then-add" else 1e-4
    return [(f"grad-accum fusion GEMM ({path}), {out}x{tokens}x{inner}", f"max rel. err {error:.1e}",
             f"<= {bar:.0e}", ("ok" if error <= bar else "FAIL") + f", time x{fused / unfused:.2f} of unfused")]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="run the checks on CPU processes, at toy sizes")
    p.add_argument("--devices", type=int, help="devices to use (default: every GPU; with --cpu, 2 processes)")
    p.add_argument("--checks", default=",".join(CHECKS), help="comma-separated, of " + ", ".join(CHECKS))
    args = p.parse_args(argv)
    args.checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    unknown = [c for c in args.checks if c not in CHECKS]
    if unknown or not args.checks:
        p.error(f"--checks {','.join(unknown) or '(none)'}: choose from {','.join(CHECKS)}")
    if args.devices is not None and args.devices < 1:
        p.error(f"--devices {args.devices}: give 1 or more")
    return args


def device_count(args: argparse.Namespace) -> int:
    """The devices the checks use: --devices, else every GPU (2 CPU processes with --cpu)."""
    if args.cpu:
        return args.devices or 2
    import torch
    found = torch.cuda.device_count()
    if found == 0:
        raise SystemExit("no GPU found (torch.cuda.device_count() == 0); use --cpu to check the script")
    if args.devices is not None and args.devices > found:
        print(f"error: --devices {args.devices}: this machine has {found} GPU(s); give at most {found}",
              file=sys.stderr)
        raise SystemExit(2)
    return args.devices or found


def main(argv=None) -> int:
    args = parse_args(argv)
    devices = device_count(args)
    if args.cpu:
        device = f"{devices} CPU process(es)"
    else:
        import torch
        device = f"{devices} x {torch.cuda.get_device_name(0)}"
    start = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        workdir = Path(tmp)
        for check in args.checks:
            print(f"{check} ...", flush=True)
            if check == "parity":
                rows += parity(devices, workdir, args.cpu)
            elif check == "gpt2-mfu":
                rows += mfu_rows(GPT2, args.cpu, ["--steps", "3", "--warmup", "1"] if args.cpu else [])
            elif check == "llama-mfu":
                rows += mfu_rows(LLAMA, args.cpu, ["--steps", "3" if args.cpu else "15", "--warmup",
                                                   "1" if args.cpu else "5"])
            elif check == "document-mask":
                rows += document_mask(workdir, args.cpu)
            elif check == "zb-h1":
                rows += zero_bubble(devices, workdir, args.cpu)
            else:
                rows += grad_accum_fusion(args.cpu)
    print(f"\ngpu_check on {device}, {time.strftime('%Y-%m-%d')}, {time.perf_counter() - start:.0f} s")
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0 if all(not row[3].startswith("FAIL") for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
