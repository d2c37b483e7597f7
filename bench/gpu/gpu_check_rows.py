"""What each of bench/gpu/gpu_check.py's checks measures: one function per check, returning its rows
of the summary table. bench/gpu/gpu_check.py runs each check in a process of its own:

    python -m bench.gpu.gpu_check_rows CHECK --devices N [--cpu] [--eager] [--standin] --workdir DIR --rows-out FILE

which writes the check's rows to FILE as JSON, each with the GEMM paths its runs took. A check
that raises is one row marked ERROR with its one-line cause (the traceback goes to stderr, the
check's log). What is measured, and why at these sizes: bench/gpu/gpu_check.py's docstring.
--standin replaces the check by a CPU stand-in of a second (standin()), for a dry run of the
device command (bench/gpu/device_command.sh) on a machine without a GPU."""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Set

from bench import REPO
from bench.gpu import gpu_check_runs as runs
from bench.gpu.gpu_check_train import gemm_paths_taken
from bench.gpu.gpu_mfu import OFFLINE, recipe_overrides, summarise

TINY, LLAMA_TINY = REPO / "recipes" / "tiny.yaml", REPO / "recipes" / "llama-tiny.yaml"
LLAMA, GPT2 = REPO / "recipes" / "llama3.2-1b.yaml", REPO / "recipes" / "gpt2-124m.yaml"
QWEN3_MOE = REPO / "recipes" / "qwen3-30b-a3b.yaml"
MOE_MAX_LAYERS = 6
"""moe-mfu's layers at most (its budget's steps); fewer where the planner says 6 do not fit."""
MOE_MEMORY_FRACTION = 0.85
"""Of the device's total memory, what moe-mfu's planned bytes may take: the rest is the CUDA
context, cuBLAS's workspaces and the caching allocator's fragmentation, which the planner leaves out."""
OK, FAIL, ERROR, SKIPPED, MEASURED = "ok", "FAIL", "ERROR", "skipped", "measured"
BF16_BAR = 5e-3
"""Losses and gradient norms of the two bf16 attention paths, relative. On the CPU toy one document
gives 2.6e-5 and 7.4e-4, and a corpus of many documents (where the masks differ) 2.1e-4 and
1.8e-2: the gradient norms see a wrong mask, the losses of a few steps barely. On a GPU the two
kernels round differently again: a first bar, which the first GPU run's figures should set."""


@dataclass
class Check:
    """Where a check runs and the GEMM paths its training runs took."""
    devices: int
    workdir: Path
    on_cpu: bool
    eager_reason: Optional[str] = None
    """Why the rows that would compile train eager instead (None: they compile on a GPU)."""
    gemm_paths: Dict[str, Set[str]] = field(default_factory=lambda: {"fusion": set(), "grouped": set()})

    @property
    def compiles(self) -> bool:
        """train.compile for the rows that time training: on a GPU where torch.compile can build
        kernels; on CPU eager, where the compilation would take most of the check's time
        (docs/configuration.md, "Compiled blocks")."""
        return not self.on_cpu and self.eager_reason is None

    def mode(self) -> str:
        """What a row that would compile says it ran as."""
        if self.eager_reason is not None:
            return f"eager ({self.eager_reason})"
        return "eager, --cpu toy" if self.on_cpu else "compiled"

    def train(self, recipe: Path, sets: Sequence[str], steps: int, name: str, tp: int = 1, pp: int = 1,
              on_cpu: Optional[bool] = None) -> List[dict]:
        """gpu_check_runs.train into this check's folder, on its device unless `on_cpu` says; its
        metrics records. Keeps the GEMM paths the run took."""
        cpu = self.on_cpu if on_cpu is None else on_cpu
        run = runs.train(recipe, sets, tp, pp, steps, self.workdir / f"{name}.jsonl", cpu)
        self.add_gemm_paths(run.gemm_paths)
        return run.records

    def add_gemm_paths(self, paths: Dict[str, List[str]]) -> None:
        for probe, chosen in paths.items():
            self.gemm_paths[probe].update(chosen)


def row(what: str, measured: str, bar: str, status: str, note: str = "") -> dict:
    return {"what": what, "measured": measured, "bar": bar, "status": status, "note": note}


def within(value: float, bar: float) -> str:
    return OK if value <= bar else FAIL


# ---------------------------------------------------------------- the checks

def parity(check: Check) -> List[dict]:
    """recipes/tiny.yaml, fp32, 5 steps: (1,2,1) and (2,1,1) against (1,1,1) with two devices or
    more, within 1e-5; with one, (1,1,1) on the device against the CPU (other kernels), 1e-4.
    Eager: a correctness check, which compiling would only make slower to start."""
    def tiny(tp: int, pp: int, cpu: bool) -> List[dict]:
        return check.train(TINY, [], 5, f"tiny-tp{tp}-pp{pp}-{'cpu' if cpu else 'device'}", tp, pp, on_cpu=cpu)

    def compared(what: str, reference: List[dict], other: List[dict], bar: float) -> dict:
        diff = runs.max_relative_difference(reference, other)
        return row(f"{what}, fp32, eager", f"max rel. diff {diff:.1e}", f"<= {bar:.0e}", within(diff, bar))
    on_device = tiny(1, 1, check.on_cpu)
    if check.devices >= 2:
        return [compared("tiny (1,2,1) vs (1,1,1)", on_device, tiny(1, 2, check.on_cpu), 1e-5),
                compared("tiny (2,1,1) vs (1,1,1)", on_device, tiny(2, 1, check.on_cpu), 1e-5)]
    # One device: that device against the CPU (with --cpu both are CPU runs: the branch is exercised).
    return [compared("tiny (1,1,1) device vs CPU", tiny(1, 1, True), on_device, 1e-4)]


def throughput_and_memory(check: Check, recipe_path: Path, steps: int, warmup: int, sets: Sequence[str],
                          label: str, compiled: bool) -> List[dict]:
    """One bf16 run of a recipe at bench/gpu/gpu_mfu.py's step sizes (its toy with --cpu): tokens/s,
    TFLOP/s and MFU of the median step after `warmup` (train.py's metrics: launch/analysis/formulas.py's
    FLOPs, an MoE's active ones), and its peak memory against launch/plan.py's prediction."""
    from launch.config.recipe import load_recipe
    as_written = load_recipe(recipe_path, [])
    wants_compile, compiled = compiled, compiled and check.compiles
    options = argparse.Namespace(accum=None, tiny=check.on_cpu,
                                 overrides=list(sets) + (["train.compile=true"] if compiled else []))
    run_sets = recipe_overrides(recipe_path.stem, options, as_written.train.micro_batch_size, as_written.model.arch)
    recipe = load_recipe(recipe_path, run_sets)
    run = summarise(check.train(recipe_path, run_sets, steps, f"{recipe_path.stem}-throughput"), warmup)
    planned = planned_memory(recipe_path, recipe)
    active = " of active FLOPs" if recipe.model.moe.enabled else ""  # the k routed experts' only
    mfu = "MFU n/a (no peak on CPU)" if run["mfu"] is None else f"MFU {run['mfu']:.1%}{active}"
    mode = check.mode() if wants_compile or check.on_cpu else "eager"
    return [row(f"{label} bf16 throughput, {mode}",
                f"{run['tokens_per_s']:,.0f} tok/s, {run['tflops_per_device']:.3g} TFLOP/s", "-", MEASURED,
                f"{mfu}; loss {run['loss_first']:.2f} -> {run['loss_last']:.2f}"),
            row(f"{label} peak memory", f"peak {run['peak_memory_bytes'] / 2 ** 30:.2f} GiB", "-", MEASURED,
                f"planned {planned / 2 ** 30:.2f} GiB, ratio {run['peak_memory_bytes'] / planned:.2f}")]


def planned_memory(recipe_path: Path, recipe) -> int:
    """launch/plan.py's bytes per device for the model, micro-batch, step, experts and recompute
    the run trained with (the recipe file's other settings: precision, ZeRO, fusion)."""
    m, t = recipe.model, recipe.train
    cmd = [sys.executable, str(REPO / "launch" / "plan.py"), "--gpus", "1", "--json", "--recipe", str(recipe_path),
           "--layers", str(m.n_layer), "--hidden", str(m.n_embd), "--heads", str(m.n_head),
           "--seq-len", str(recipe.seq_len), "--vocab", str(m.vocab_size),
           "--vocab-pad-multiple", str(m.vocab_pad_multiple), "--micro-batch", str(t.micro_batch_size),
           "--global-batch", str(t.global_batch_size), "--ep", str(t.ep), "--recompute", t.recompute]
    proc = subprocess_run(cmd)
    return json.loads(proc.stdout.strip().splitlines()[-1])["memory_per_device_bytes"]


def subprocess_run(cmd: List[str]) -> subprocess.CompletedProcess:
    """`cmd` in the repository; a RuntimeError naming its cause where it fails."""
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"{' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}", file=sys.stderr)
        cause = runs.error_line(proc.stderr + proc.stdout)
        raise RuntimeError(f"{Path(cmd[1]).name} exited {proc.returncode}: {cause}")
    return proc


def gpt2_mfu(check: Check) -> List[dict]:
    """GPT-2 124M, bench/gpu/gpu_mfu.py's 16 x 4 samples of 1024 tokens, 20 steps (5 left out)."""
    steps, warmup = (3, 1) if check.on_cpu else (20, 5)
    return throughput_and_memory(check, GPT2, steps, warmup, [], "gpt2-124m", True)


def llama_mfu(check: Check) -> List[dict]:
    """Llama 3.2 1B, selective recompute, 8 x 4 samples of 2048 tokens, 12 steps (4 left out)."""
    steps, warmup = (3, 1) if check.on_cpu else (12, 4)
    return throughput_and_memory(check, LLAMA, steps, warmup, [], "llama3.2-1b", True)


def moe_mfu(check: Check) -> List[dict]:
    """Qwen3-30B-A3B's blocks (128 experts of width 768, top 8 renormalised, hidden 2048, 32 query
    heads of 128 sharing 4 key/value heads) cut to as many of its 48 layers as fit this device by
    the planner's count (moe_layers_that_fit: 6 at most, planned at 77 GiB, on an H200; fewer on
    an 80 GB H100), the experts on this one device (ep 1), no recompute: at 6 layers 4.4B
    parameters, 0.96B active per token. 4 x 1 sample of 4096 tokens a step, 12 steps (4 left
    out). MFU of the active FLOPs: the k routed experts a token passes through, not all 128.
    Eager: an MoE block breaks the compiled graph at its host sync (.tolist() of the experts'
    counts) and recompiles per block (its layer index)."""
    if check.on_cpu:  # bench/gpu/gpu_mfu.py's toy: 2 blocks of 64, still 128 experts of width 768
        return throughput_and_memory(check, QWEN3_MOE, 3, 1, ["train.ep=1"], "qwen3-30b-a3b", compiled=False)
    sets = ["train.ep=1", "train.recompute=none"]
    total = device_total_memory()
    def planned_at(layers: int) -> int:
        return planned_memory(QWEN3_MOE, moe_recipe(sets + [f"model.n_layer={layers}"]))
    layers, planned = moe_layers_that_fit(planned_at, MOE_MEMORY_FRACTION * total)
    rows = throughput_and_memory(check, QWEN3_MOE, 12, 4, sets + [f"model.n_layer={layers}"],
                                 f"qwen3-30b-a3b {layers} layers", compiled=False)
    rows[0]["note"] += (f"; {layers} layers: planned {planned / 2 ** 30:.1f} GiB <= {MOE_MEMORY_FRACTION:.0%} "
                        f"of the device's {total / 2 ** 30:.1f} GiB")
    return rows


def moe_recipe(sets: Sequence[str]):
    """The recipe moe-mfu's run trains with these sets (bench/gpu/gpu_mfu.py's step and data)."""
    from launch.config.recipe import load_recipe
    as_written = load_recipe(QWEN3_MOE, [])
    options = argparse.Namespace(accum=None, tiny=False, overrides=list(sets))
    return load_recipe(QWEN3_MOE, recipe_overrides(QWEN3_MOE.stem, options, as_written.train.micro_batch_size,
                                                   as_written.model.arch))


def moe_layers_that_fit(planned: Callable[[int], int], limit: float, most: int = MOE_MAX_LAYERS):
    """(layers, planned bytes): the most layers, up to `most`, whose planned bytes are within
    `limit`. The planner's bytes are a fixed part (embedding, head, logits) plus the same bytes per
    layer (its weights, gradients, optimizer state and activations): one and two layers give both,
    and the count they predict is checked (and stepped down) against the planner itself, so a
    plan.py process runs three or four times, not once per layer. A RuntimeError where not even
    one layer fits."""
    one = planned(1)
    if one > limit:
        raise RuntimeError(f"one layer is planned at {one / 2 ** 30:.1f} GiB, over the "
                           f"{limit / 2 ** 30:.1f} GiB this device allows")
    per_layer = max(planned(2) - one, 1) if most > 1 else 1
    layers = max(1, min(most, 1 + int((limit - one) // per_layer)))
    size = planned(layers) if layers > 1 else one
    while size > limit and layers > 1:
        layers -= 1
        size = planned(layers)
    return layers, size


def device_total_memory() -> int:
    """The first GPU's total bytes, from nvidia-smi (no CUDA context in this process, which would
    hold memory while the training run it starts measures its own), else from torch in a process
    of its own."""
    if shutil.which("nvidia-smi"):
        proc = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
                              capture_output=True, text=True)
        if proc.returncode == 0 and proc.stdout.strip():
            return int(float(proc.stdout.split()[0]) * 2 ** 20)  # MiB
    proc = subprocess_run([sys.executable, "-c",
                           "import torch; print(torch.cuda.get_device_properties(0).total_memory)"])
    return int(proc.stdout.split()[-1])


def document_mask(check: Check) -> List[dict]:
    """data.document_mask against the causal path, bf16, on a corpus of one document, where the two
    masks are the same: the losses and gradient norms, and the step times. On a GPU the masked path
    is flex_attention and the causal one SDPA's flash kernel (is_causal on the same bf16 tensors):
    the speed floor.
    Llama 3.2 1B cut to 4 blocks, 2 x 1 sample of 8192 tokens a step (attention's share of the
    FLOPs grows with the sequence), 6 steps (2 left out), compiled, no recompute. With --cpu the
    masked path is SDPA with a boolean mask (flex_attention has no CPU backward), llama-tiny."""
    corpus = runs.one_document_corpus(check.workdir / "one-document.jsonl")
    sets = ["data.name=" + str(corpus), "data.config=null", "data.revision=null", "data.tokenizer=builtin", "data.streaming=false",
            "data.val_fraction=0.0", "train.eval_every=0", "wandb.mode=disabled", "train.precision=bf16",
            "model.dropout=0.0"]
    if check.on_cpu:
        recipe, steps, warmup, kernels = LLAMA_TINY, 4, 1, "SDPA boolean mask vs SDPA causal"
        sets += ["train.micro_batch_size=2", "train.global_batch_size=4"]
    else:
        recipe, steps, warmup, kernels = LLAMA, 6, 2, "flex_attention vs flash SDPA causal"
        sets += ["model.n_layer=4", "model.seq_len=8192", "train.micro_batch_size=1", "train.global_batch_size=2",
                 "train.recompute=none"]
    if check.compiles:
        sets.append("train.compile=true")
    trained = {mask: check.train(recipe, sets + [f"data.document_mask={mask}"], steps, f"document-mask-{mask}")
               for mask in ("true", "false")}
    loss, grad_norm = (runs.max_relative_difference(trained["false"], trained["true"], keys=(key,))
                       for key in ("loss", "grad_norm"))
    masked, causal = (runs.median_step_time(trained[mask], warmup) for mask in ("true", "false"))
    return [row(f"{recipe.stem} document mask, {kernels}, bf16, {check.mode()}",
                f"max rel. diff loss {loss:.1e}, grad norm {grad_norm:.1e}", f"<= {BF16_BAR:.0e}",
                within(max(loss, grad_norm), BF16_BAR),
                f"step time x{masked / causal:.2f} ({masked * 1e3:.1f} ms vs {causal * 1e3:.1f} ms)")]


def zero_bubble(check: Check) -> List[dict]:
    """ZB-H1 against 1F1B at pp = 2: the same arithmetic in another order, so the same bits. The
    GPT-2 124M recipe in fp32, 8 micro-batches of 4. Eager: compiled, ZB-H1's blocks break their
    graph at each linear and 1F1B's do not, so the two would no longer round alike."""
    what = "zb-h1 vs 1f1b at pp=2, fp32, eager"
    if check.devices < 2:
        return [row(what, "-", "bit-identical", SKIPPED, f"needs 2 devices, {check.devices} here")]
    if check.on_cpu:
        recipe, sets, steps, warmup = TINY, ["train.eval_every=0"], 4, 1  # steps timed alike
    else:
        recipe, steps, warmup = GPT2, 8, 3
        sets = OFFLINE + ["train.precision=fp32", "train.micro_batch_size=4", "train.global_batch_size=32"]
    trained = {schedule: check.train(recipe, sets + [f"train.schedule={schedule}"], steps, f"schedule-{schedule}", pp=2)
               for schedule in ("1f1b", "zb-h1")}
    same = runs.identical(trained["1f1b"], trained["zb-h1"])
    ratio = runs.step_time_ratio(trained["zb-h1"], trained["1f1b"], warmup)
    measured = "losses, grad norms identical" if same else \
        f"max rel. diff {runs.max_relative_difference(trained['1f1b'], trained['zb-h1']):.1e}"
    return [row(f"{recipe.stem} {what}", measured, "bit-identical", OK if same else FAIL, f"step time x{ratio:.2f}")]


def grad_accum_fusion(check: Check) -> List[dict]:
    """The fused weight-gradient GEMM (model/parallel/weight_grad.py add_product_into) at
    Llama-2-7B's MLP shape against an fp32 GEMM of the same bf16 operands, and its time against
    the path without fusion (a bf16 product, cast to fp32 and added: DeepSpeed's per-micro-batch
    work). In this process: its row's fusion path is the one this GEMM took."""
    import torch
    from model.parallel.weight_grad import add_product_into, mixed_gemm_path
    device = torch.device("cpu" if check.on_cpu else "cuda")
    out, tokens, inner = (256, 512, 1024) if check.on_cpu else (11008, 8192, 4096)  # (out, N) @ (N, in)
    left = torch.randn(out, tokens, device=device).bfloat16()
    right = torch.randn(tokens, inner, device=device).bfloat16()
    main = torch.zeros(out, inner, device=device)
    want = left.float() @ right.float()
    add_product_into(main, left, right)
    error = ((main - want).abs().max() / want.abs().max()).item()

    def seconds(step: Callable[[], object]) -> float:
        step()  # warm-up
        if not check.on_cpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            step()
        if not check.on_cpu:
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / 10
    fused = seconds(lambda: add_product_into(main, left, right))
    unfused = seconds(lambda: main.add_(torch.mm(left, right).float()))
    path = "fp32 operands (CPU)" if check.on_cpu else mixed_gemm_path(device)
    # fp32 accumulation: only the summation order differs; the last fallback rounds the product to bf16
    bar = 1e-2 if path == "mm-then-add" else 1e-4
    return [row(f"grad-accum fusion GEMM ({path}), {out}x{tokens}x{inner}", f"max rel. err {error:.1e}",
                f"<= {bar:.0e}", within(error, bar), f"time x{fused / unfused:.2f} of unfused")]


def step_prediction(check: Check) -> List[dict]:
    """The planner's step time against the measured one: launch/plan.py
    --calibrate measures this device (its GEMMs at the candidates' shapes, memory, optimizer; on
    CPU the model's blocks too) into the cache the runs read, then GPT-2 124M (tiny with --cpu)
    trains eager, offline (the embedded corpus and tokenizer, GPT-2's vocabulary kept), 16 samples
    a step: on a GPU micro-batch 4 without recompute and 8 with full recompute (the two ends; two
    runs' start-up is what fits the device command's wall), on CPU micro-batch 2 and 4, each
    without and with full recompute; each run's own prediction against its median step time
    after the warm-up."""
    import statistics
    if check.on_cpu:
        recipe, steps, warmup, sets = TINY, 6, 2, []
        runs_of = [(recompute, b) for recompute in ("none", "full") for b in (2, 4)]
    else:
        recipe, steps, warmup, sets = GPT2, 8, 3, list(OFFLINE)
        runs_of = [("none", 4), ("full", 8)]
    subprocess_run([sys.executable, str(REPO / "launch" / "plan.py"), "--recipe", str(recipe), "--gpus", "1",
                    "--global-batch", "16", "--search", "--calibrate"])
    rows = []
    for recompute, b in runs_of:
        records = check.train(recipe, sets + [f"train.micro_batch_size={b}", "train.global_batch_size=16",
                                              f"train.recompute={recompute}", "train.eval_every=0",
                                              "train.compile=false"], steps, f"predicted-b{b}-{recompute}")
        predicted = records[0].get("predicted_step_time_s")
        measured = statistics.median(r["step_time_s"] for r in records[warmup:])
        if predicted is None:
            rows.append(row(f"{recipe.stem} micro-batch {b}, recompute {recompute}: step time", f"{measured:.3g} s",
                            "-", FAIL, "no prediction: the calibration did not reach the run"))
            continue
        rows.append(row(f"{recipe.stem} micro-batch {b}, recompute {recompute}: predicted step time",
                        f"predicted {predicted:.3g} s, measured {measured:.3g} s", "-", MEASURED,
                        f"error {abs(measured - predicted) / measured:.0%} (measured / predicted "
                        f"{measured / predicted:.2f})"))
    return rows


CHECKS: Dict[str, Callable[[Check], List[dict]]] = {
    "parity": parity, "gpt2-mfu": gpt2_mfu, "llama-mfu": llama_mfu, "moe-mfu": moe_mfu,
    "document-mask": document_mask, "zb-h1": zero_bubble, "grad-accum-fusion": grad_accum_fusion,
    "step-prediction": step_prediction}
TRAINING_CHECKS = tuple(name for name in CHECKS if name != "grad-accum-fusion")
"""The checks whose runs go through launch/train.py (gpu_check.py's --fail-row picks among them)."""


# ---------------------------------------------------------------- the dry run's stand-in

STANDIN_STEPS = 4
FAULT_ENV = "GPT3D_FAULT_INJECT"  # launch/resilience/failure.py's (importing it imports torch: a second a check)


def standin(name: str, check: Check) -> List[dict]:
    """A CPU stand-in for check `name`, for a dry run of the device command: no torch, a second.
    Like a training run it writes a metrics record per step, flushed, into the check's folder, and
    honours launch/train.py's fault hook (GPT3D_FAULT_INJECT=0:STEP raises before STEP,
    0:STEP:hang sleeps there for ever), so the harness's failure, time-out and archive paths run
    as they would around the real check."""
    fault = os.environ.get(FAULT_ENV, "").split(":")
    metrics = check.workdir / f"{name}-standin.jsonl"
    with open(metrics, "w") as out:
        for step in range(1, STANDIN_STEPS + 1):
            if fault[:2] == ["0", str(step)]:
                if fault[2:] == ["hang"]:
                    while True:
                        time.sleep(3600)
                raise RuntimeError(f"fault injected by {FAULT_ENV}={':'.join(fault)} before step {step}")
            out.write(json.dumps({"step": step, "loss": 10.0 / step, "step_time_s": 0.01}) + "\n")
            out.flush()
            time.sleep(0.01)
    return [row(f"{name} CPU stand-in, {check.mode()}", f"{STANDIN_STEPS} steps", "-", MEASURED,
                f"metrics: {metrics.name}")]


# ---------------------------------------------------------------- one check in this process

def compile_unavailable() -> Optional[str]:
    """Why torch.compile cannot build GPU kernels here, or None: TorchInductor's GPU kernels are
    Triton's, and Triton builds each kernel's launcher with the host's C compiler."""
    try:
        from torch.utils._triton import has_triton
    except ImportError as error:
        return f"compilation not available: {error}"
    if not has_triton():
        return "compilation not available: no working Triton"
    if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")):
        return "compilation not available: no C compiler for Triton's launchers"
    return None


def error_row(what: str, error: str) -> dict:
    return row(what, "-", "-", ERROR, error)


def run_check(name: str, check: Check, stand_in: bool = False) -> List[dict]:
    """The check's rows (its stand-in's with `stand_in`), each with the GEMM paths its runs and
    this process took; one ERROR row with the cause's one line if it raised."""
    try:
        rows = standin(name, check) if stand_in else CHECKS[name](check)
    except Exception as error:  # the table must show every check: the cause is its row
        traceback.print_exc()
        first_line = (str(error).strip().splitlines() or [""])[0]
        rows = [error_row(name, f"{type(error).__name__}: {first_line}"[:300])]
    if not stand_in:  # (the probes' module imports torch)
        check.add_gemm_paths(gemm_paths_taken())  # grad-accum-fusion's GEMM ran here
    paths = {probe: sorted(chosen) for probe, chosen in check.gemm_paths.items()}
    return [dict(r, gemm_paths=paths) for r in rows]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Run one of bench/gpu/gpu_check.py's checks (it starts this).")
    p.add_argument("check", choices=list(CHECKS))
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--eager", action="store_true", help="no row compiles (as where compilation is not available)")
    p.add_argument("--standin", action="store_true", help="the check's CPU stand-in (a dry run)")
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--rows-out", type=Path, required=True)
    args = p.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.eager:
        eager = "compilation not available: --eager"
    else:  # probed on a GPU only: on CPU the rows are eager toys anyway
        eager = None if args.cpu or args.standin else compile_unavailable()
    rows = run_check(args.check, Check(args.devices, args.workdir, args.cpu, eager), args.standin)
    args.rows_out.write_text(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
