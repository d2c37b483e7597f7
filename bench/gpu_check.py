"""The first run on a GPU machine, in one command and under 10 minutes: is it right, how fast, how big.

    python bench/gpu_check.py            # NVIDIA GPU(s), no network
    python bench/gpu_check.py --cpu      # the same checks on CPU processes (what the tests run)

1. Layout parity on the device: recipes/tiny.yaml, fp32, 5 steps, through `deepspeed
   launch/train.py` at (tp, pp, dp) = (1,1,1) and, where there are 2 devices or more,
   (1,2,1) and (2,1,1). Losses and gradient norms against (1,1,1), within 1e-5 relative (the
   CPU tests' bar). With one GPU, (1,1,1) on the GPU against (1,1,1) on the CPU instead:
   different kernels (cuBLAS, flash attention), so the bar is 1e-4.
2. Throughput and MFU: `bench/gpu_mfu.py` on the GPT-2 124M recipe (bf16, one device).
3. Peak memory: that run's measured per-step peak against `launch/plan.py`'s prediction for
   the same recipe, micro-batch and gradient accumulation on one device.
It ends with one summary table. Paste it into docs with the date and the device.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launch.runtime.distributed import launcher_command

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "recipes" / "tiny.yaml"
STEPS = 5
MFU_RECIPE = "gpt2-124m"


def train_tiny(tp: int, pp: int, workdir: Path, on_cpu: bool) -> list:
    """The metrics records of tiny.yaml at (tp, pp, 1) on tp*pp devices (or CPU processes)."""
    out = workdir / f"tiny-tp{tp}-pp{pp}-{'cpu' if on_cpu else 'gpu'}.jsonl"
    env = dict(os.environ)
    if on_cpu:
        env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    cmd = launcher_command(tp * pp, REPO / "launch" / "train.py") + [
        "--recipe", str(TINY), "--tp", str(tp), "--pp", str(pp), "--steps", str(STEPS), "--metrics-out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"tiny at tp={tp} pp={pp} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return [json.loads(line) for line in out.read_text().splitlines()]


def max_relative_difference(reference: list, other: list) -> float:
    return max(abs(o[k] - r[k]) / abs(r[k]) for r, o in zip(reference, other) for k in ("loss", "grad_norm"))


def parity(devices: int, workdir: Path, on_cpu: bool) -> list:
    """[(what, max relative difference, bar)] of the parity runs this machine allows."""
    reference = train_tiny(1, 1, workdir, on_cpu)
    if devices >= 2:
        return [("tiny (1,2,1) vs (1,1,1)", max_relative_difference(reference, train_tiny(1, 2, workdir, on_cpu)), 1e-5),
                ("tiny (2,1,1) vs (1,1,1)", max_relative_difference(reference, train_tiny(2, 1, workdir, on_cpu)), 1e-5)]
    cpu = train_tiny(1, 1, workdir, on_cpu=True)  # one GPU: the device against the CPU
    return [("tiny (1,1,1) GPU vs CPU", max_relative_difference(cpu, reference), 1e-4)]


def mfu_run(on_cpu: bool) -> dict:
    cmd = [sys.executable, str(REPO / "bench" / "gpu_mfu.py"), "--recipes", MFU_RECIPE, "--json"]
    if on_cpu:
        cmd.append("--tiny")
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"bench/gpu_mfu.py failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1])["results"][0]


def planned_memory(run: dict) -> int:
    """launch/plan.py's bytes per device for the run's model, micro-batch and step size."""
    cmd = [sys.executable, str(REPO / "launch" / "plan.py"), "--gpus", "1", "--json",
           "--layers", str(run["n_layer"]), "--hidden", str(run["n_embd"]), "--heads", str(run["n_head"]),
           "--seq-len", str(run["seq_len"]), "--vocab", str(run["vocab_size"]), "--vocab-pad-multiple", "128",
           "--micro-batch", str(run["micro_batch_size"]), "--global-batch", str(run["global_batch_size"])]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise SystemExit(f"launch/plan.py failed: {proc.stdout[-1000:]}{proc.stderr[-1000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["memory_per_device_bytes"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="run the checks on CPU processes (toy MFU run)")
    args = p.parse_args(argv)
    import torch
    devices = 2 if args.cpu else torch.cuda.device_count()
    if devices == 0:
        raise SystemExit("no GPU found (torch.cuda.device_count() == 0); use --cpu to check the script")
    device = "CPU processes" if args.cpu else f"{devices} x {torch.cuda.get_device_name(0)}"
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        rows = [(what, f"max rel. diff {diff:.1e}", f"<= {bar:.0e}", "ok" if diff <= bar else "FAIL")
                for what, diff, bar in parity(devices, Path(tmp), args.cpu)]
    run = mfu_run(args.cpu)
    mfu = "n/a (no peak on CPU)" if run["mfu"] is None else f"MFU {run['mfu']:.1%}"
    rows.append((f"{MFU_RECIPE} bf16 throughput", f"{run['tokens_per_s']:,.0f} tok/s",
                 f"{run['tflops_per_device']:.3g} TFLOP/s", mfu))
    planned = planned_memory(run)
    rows.append((f"{MFU_RECIPE} peak memory", f"measured {run['peak_memory_bytes'] / 2 ** 30:.2f} GiB",
                 f"planned {planned / 2 ** 30:.2f} GiB", f"ratio {run['peak_memory_bytes'] / planned:.2f}"))
    print(f"\ngpu_check on {device}, {time.strftime('%Y-%m-%d')}, {time.perf_counter() - start:.0f} s")
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
    return 0 if all(row[3] != "FAIL" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
