"""The training runs that tests compare (docs/testing.md, "Parity runs once per session"): the
layouts of the acceptance test and the other parity layouts, and ParityRuns, which launches each
run once per test session and shares it between the tests, and between pytest-xdist's workers
(a file lock per layout: the first worker to ask runs it, the others wait and read its result)."""
import fcntl
import json
import os
import shutil
from pathlib import Path

from helpers.launcher import LLAMA_TINY, MOE_TINY, TINY, launch_forked, read_metrics, refuse_in_fast_tier

# The layouts of the acceptance test (docs/design.md, The acceptance test): every one trains the same model.
REFERENCE = (1, 1, 1)
LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2), (4, 4, 1)]
# Sequence parallelism on: with pipeline stages (its chunks cross stage boundaries whole) and at
# tp=4. The Llama family runs the same layouts (tests/e2e/test_llama_parity.py).
SP_LAYOUTS = [(2, 2, 2, "sp"), (4, 1, 1, "sp")]
# Context parallelism, tag "cp<N>": as (tp, cp, pp, dp) = (1,2,1,1), (2,2,1,1), (1,2,2,1),
# (1,2,1,2) and (2,2,2,1) with SP; the Llama family adds the document mask (tests/e2e/test_llama_parity.py).
CP_LAYOUTS = [(1, 1, 1, "cp2"), (2, 1, 1, "cp2"), (1, 2, 1, "cp2"), (1, 1, 2, "cp2"), (2, 2, 1, "sp", "cp2")]
# The fast tier's only launches (docs/testing.md, The fast tier): (2,2,2) has every kind of
# parallelism; (1,1,1) is its reference, and its checkpoints serve the fast checkpoint tests.
ACCEPTANCE_RUNS = (REFERENCE, (2, 2, 2))
STEPS = 5
SAVE_AT = 3  # each parity run also saves a checkpoint here, for the resume tests
# A precision tag in a layout (e.g. (2, 2, 2, "bf16")) runs it in that precision. fp16: DeepSpeed's
# dynamic loss scale grows after every 2 steps without overflow, so its changes show in 5 steps.
PRECISIONS = ("bf16", "fp16")
FP16_SETTINGS = ["--set", "deepspeed.fp16.loss_scale_window=2"]
# DeepSpeed's CPU accelerator declares fp16 unsupported unless oneDNN has fp16 kernels (AVX512-FP16
# or AMX-FP16 CPUs), and the engine refuses to start. torch's own CPU kernels compute fp16 (slowly),
# so the fp16 runs lift only that capability check, in every rank, through this sitecustomize.
FP16_ON_CPU = Path(__file__).resolve().parent / "fp16_on_cpu"
RECOMPUTE_MODES = ("selective", "full")
# Measured (docs/performance.md, "Layout parity in bf16 and fp16"; deterministic on one machine):
# the losses of (2,2,2) within 7.2e-5 of a bf16 (1,1,1), of (1,2,1) within 1.8e-5; gradient norms
# within 1.7e-4 except step 2 of (2,2,2), 5.2e-3 (step 1: 1.1e-4; likely Adam, which divides each
# element's update by its own gradient's magnitude, so elements whose gradient is at bf16's rounding
# noise move by a full lr in a layout-dependent direction, and the next gradient norm shows it). The
# loss tolerance leaves 14x headroom and is 5x below the smallest change one step makes to the loss
# here (a layout a step ahead or behind fails); 4x for the norm.
BF16_RTOL = {"loss": 1e-3, "val_loss": 1e-3, "grad_norm": 2e-2}
# MoE balancing other than the recipe's per-micro-batch load-balancing loss (model.moe.balance, balance_scope).
# The bias moves 0.01 per step (DeepSeek-V3's 0.001 would barely change 5 steps' choices).
BALANCE_TAGS = {"bias": ("model.moe.balance=bias", "model.moe.bias_update_rate=0.01"),
                "global": ("model.moe.balance_scope=global_batch",)}
# Muon's options, on a Muon run ("muon"): "keller", Keller Jordan's lr rule at his lr 0.02 with an
# AdamW group of its own rate, betas and weight decay (each unlike the recipe's, so one ignored at a
# layout shows). Newton-Schulz in bf16 is checked in process (tests/runtime/test_muon.py), not launched.
MUON_TAGS = {"keller": ("train.muon_lr_rule=keller", "train.lr=0.02", "train.muon_adamw_lr=8.0e-3",
                        "train.muon_adamw_beta1=0.8", "train.muon_adamw_beta2=0.99",
                        "train.muon_adamw_weight_decay=0.01")}


def layout_id(layout) -> str:
    return "-".join([f"tp{layout[0]}", f"pp{layout[1]}", f"dp{layout[2]}"] + list(layout[3:]))


def context_parallel_size(layout) -> int:
    """N of a "cp<N>" tag, else 1."""
    return next((int(tag[2:]) for tag in layout[3:] if tag.startswith("cp") and tag[2:].isdigit()), 1)


def expert_parallel_size(layout) -> int:
    """N of an "ep<N>" tag, else 1."""
    return next((int(tag[2:]) for tag in layout[3:] if tag.startswith("ep") and tag[2:].isdigit()), 1)


def run_precision(layout) -> str:
    return next((tag for tag in layout[3:] if tag in PRECISIONS), "fp32")


def precision_args(precision: str) -> list:
    if precision == "fp32":
        return []
    return ["--set", f"train.precision={precision}"] + (FP16_SETTINGS if precision == "fp16" else [])


def precision_env(precision: str) -> dict:
    if precision != "fp16":
        return {}
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(FP16_ON_CPU), os.environ.get("PYTHONPATH")]))}


class ParityRuns:
    """recipes/tiny.yaml for STEPS steps at a layout, launched when a test first asks for it and
    kept for the session (so `-k sp` launches only the reference and the SP layouts); each run
    saves a checkpoint after step SAVE_AT. runs[layout] = {metrics, dir (checkpoints under
    dir/ck), stdout, stderr}. (1,1,2) also writes a wandb offline run. Tags after (tp, pp, dp): "sp"
    (sequence parallelism), a precision of PRECISIONS (fp32 without one), "llama" (recipes/llama-tiny.yaml
    instead of recipes/tiny.yaml), "moe" (recipes/moe-tiny.yaml), "docmask" (data.document_mask), "cp<N>" (--cp N: N times the ranks), "ep<N>" (--ep N), "zb-h1" (train.schedule), "muon" (train.optimizer: Muon), "keller" (MUON_TAGS), "bias" and "global" (BALANCE_TAGS), a mode of RECOMPUTE_MODES (train.recompute: the
    same losses, other code paths), "compile" (train.compile: each block compiled)."""

    def __init__(self, tmp_path_factory):
        # One folder for the session: under pytest-xdist each worker's basetemp is a child of it.
        base = tmp_path_factory.getbasetemp()
        self.root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "parity-runs"
        self.root.mkdir(exist_ok=True)
        self.done = {}

    def __getitem__(self, layout):
        if layout not in ACCEPTANCE_RUNS:  # before any lookup: the same answer whatever ran before
            refuse_in_fast_tier(f"the parity run {layout}")
        if layout not in self.done:
            self.done[layout] = self._shared(layout)
        return self.done[layout]

    def _shared(self, layout) -> dict:
        """The run of `layout`: read if another worker (or an earlier test) made it, else launched
        here while holding its lock, so no two workers launch the same layout."""
        tmp = self.root / layout_id(layout)
        result = tmp.with_suffix(".json")
        with open(tmp.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if not result.exists():
                shutil.rmtree(tmp, ignore_errors=True)  # what a failed attempt left
                tmp.mkdir()
                run = self._launch(layout, tmp)
                result.write_text(json.dumps(dict(run, dir=str(tmp))))
        run = json.loads(result.read_text())
        return dict(run, dir=Path(run["dir"]))

    def _launch(self, layout, tmp: Path) -> dict:
        tp, pp, dp = layout[:3]
        sp = ["--set", "model.sequence_parallel=true"] if "sp" in layout else []
        docmask = ["--set", "data.document_mask=true"] if "docmask" in layout else []
        compiled = ["--set", "train.compile=true"] if "compile" in layout else []
        schedule = ["--set", "train.schedule=zb-h1"] if "zb-h1" in layout else []
        muon = ["--set", "train.optimizer=muon"] if "muon" in layout else []
        balance = [arg for tag in layout[3:] if tag in BALANCE_TAGS for setting in BALANCE_TAGS[tag]
                   for arg in ("--set", setting)]
        muon += [arg for tag in layout[3:] if tag in MUON_TAGS for setting in MUON_TAGS[tag]
                 for arg in ("--set", setting)]
        recompute = [arg for tag in layout[3:] if tag in RECOMPUTE_MODES
                     for arg in ("--set", f"train.recompute={tag}")]
        precision = run_precision(layout)
        wandb = ["--wandb", "offline"] if layout == (1, 1, 2) else []
        # Expert-parallel MoE runs also count their collectives (tests/e2e/test_moe_comm.py reads them);
        # not those with other tags (balancing, precision, context parallelism), which no test counts.
        counted = "moe" in layout and expert_parallel_size(layout) > 1 and \
            all(tag == "moe" or tag.startswith("ep") or tag in ("sp", "zb-h1") for tag in layout[3:])
        comm = ["--comm-counts", str(tmp / "comm")] if counted else []
        recipe = LLAMA_TINY if "llama" in layout else MOE_TINY if "moe" in layout else TINY
        cp, ep = context_parallel_size(layout), expert_parallel_size(layout)
        context = (["--cp", str(cp)] if cp > 1 else []) + (["--ep", str(ep)] if ep > 1 else [])
        proc = launch_forked(tp * cp * pp * dp, ["--recipe", str(recipe), "--tp", str(tp), "--pp", str(pp),
                                     "--steps", str(STEPS), "--metrics-out", str(tmp / "metrics.jsonl"),
                                     "--save", str(tmp / "ck"), "--save-every", str(SAVE_AT)]
                      + context + sp + docmask + compiled + schedule + muon + balance + recompute + precision_args(precision) + wandb
                      + comm,
                             env=dict(precision_env(precision), WANDB_DIR=str(tmp)), acceptance=True)
        assert proc.returncode == 0, f"layout {layout} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return {"metrics": read_metrics(tmp / "metrics.jsonl"), "stdout": proc.stdout, "stderr": proc.stderr}
