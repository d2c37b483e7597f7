"""bench/gpu/gpu_check.py: its bad input, the corpus its document-mask check rests on, and (slow) that a
check which fails, or runs past its budget, is one row while the table and the JSON keep every
check, on one CPU device: the case an H200 takes.

The document-mask check compares data.document_mask against the causal path on one document: the
two are the same attention only if no window's input holds an EOS (each EOS starts a document).
That is checked here on the windows launch/train.py trains, at the CPU's and the GPU's seq_len."""
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from bench.gpu import gpu_check, gpu_check_rows, gpu_check_runs
from data.builtin import load_tokenizer
from data.windows import prepare_streams, windows
from launch.config.recipe import load_recipe
from helpers.launcher import REPO

GPU_CHECK = REPO / "bench" / "gpu" / "gpu_check.py"


@pytest.mark.parametrize("flags, named", [(["--checks", "parity,mfu"], "--checks mfu"),
                                          (["--cpu", "--devices", "0"], "--devices 0"),
                                          (["--cpu", "--budget-scale", "0"], "--budget-scale 0"),
                                          (["--cpu", "--fail-row", "grad-accum-fusion"], "--fail-row"),
                                          (["--cpu", "--deadline-s", "0"], "--deadline-s 0"),
                                          (["--standin"], "--standin")])
def test_bad_flags_are_one_line_and_exit_2(flags, named, capsys):
    """In process (a fast test starts no bench script): argparse's one error line, exit 2. Only a
    check that trains can be forced to fail (its runs' fault hook is the failure)."""
    with pytest.raises(SystemExit) as stop:
        gpu_check.main(flags)
    out, err = capsys.readouterr()
    assert stop.value.code == 2 and out == "", (stop.value.code, out)
    assert named in err.strip().splitlines()[-1], err


def test_one_document_corpus_puts_no_eos_in_any_trained_window(tmp_path):
    """Through the data path a run takes (the cached token stream, its windows): exactly one EOS
    in the whole stream, in no window's input, and enough windows for the check's steps."""
    corpus = gpu_check_runs.one_document_corpus(tmp_path / "one.jsonl")
    recipe = load_recipe(gpu_check_rows.LLAMA_TINY, [f"data.name={corpus}", "data.val_fraction=0.0"])
    tokenizer = load_tokenizer("builtin")
    stream = np.asarray(prepare_streams(recipe.data, tokenizer).train)
    assert (stream == tokenizer.eos_token_id).sum() == 1
    for seq_len, needed in ((32, 4 * 4), (8192, 6 * 2)):  # CPU: 4 steps of 4 samples; GPU: 6 steps of 2
        cut = windows(stream, seq_len)
        assert len(cut) >= needed, (seq_len, len(cut))
        assert not (cut[:, :-1] == tokenizer.eos_token_id).any(), seq_len


def run_gpu_check(tmp_path, *flags):
    """`gpu_check.py --cpu --devices 1 FLAGS`: its exit code, the table's lines (header, columns,
    rows) as printed, and the JSON it wrote."""
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(GPU_CHECK), "--cpu", "--devices", "1", "--json-out", str(out), *flags],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert "\ngpu_check on 1 CPU process(es), " in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = proc.stdout.split("\ngpu_check on ", 1)[1].split("\n\n", 1)[0].splitlines()
    return proc.returncode, table, json.loads(out.read_text())


def printed_cells(line: str) -> list:
    """A table line's cells: the columns are set apart by two spaces or more."""
    return re.split(r" {2,}", line.strip())


def assert_table_is_the_json(table, report):
    """Every JSON row printed, in order, cell for cell (what the first GPU run pastes is what it saved)."""
    assert printed_cells(table[1]) == ["check", "row", "measured", "bar", "status", "note", "GEMM paths",
                                       "time / budget"]
    assert len(table) == 2 + len(report["rows"]), table
    for line, row in zip(table[2:], report["rows"]):
        paths = gpu_check.gemm_paths_text(row["gemm_paths"])
        assert printed_cells(line) == [row["check"], row["what"], row["measured"], row["bar"], row["status"],
                                       row["note"], paths, f"{row['wall_s']:.0f} / {row['budget_s']:.0f} s"], line


@pytest.mark.slow  # three checks' processes, one training run through launch/train.py
def test_a_failing_check_is_one_row_and_the_table_and_json_keep_every_check(tmp_path):
    """parity's runs fail at their first step (the training loop's own fault hook, as a crashing
    GPU run would): that check is one ERROR row with train.py's one-line cause, and its log keeps
    the traceback; the zb-h1 and fusion checks after it still run (zb-h1 skipped, with the reason),
    and every row is printed as the JSON holds it; exit 1. (The throughput and document-mask rows
    train for tens of seconds each on CPU: they are left to `python bench/gpu/gpu_check.py --cpu
    --devices 1`; what the document-mask row compares, flex against causal attention on one
    document, is tests/model/test_document_mask.py's subject.)"""
    checks = ["parity", "zb-h1", "grad-accum-fusion"]
    code, table, report = run_gpu_check(tmp_path, "--checks", ",".join(checks), "--fail-row", "parity")
    rows = report["rows"]
    assert code == 1 and report["exit_code"] == 1 and report["complete"], (code, report)
    assert [r["check"] for r in rows] == checks
    assert [r["status"] for r in rows] == ["ERROR", "skipped", "ok"]
    failed = rows[0]
    assert failed["note"].startswith("RunFailed: tiny at tp=1 pp=1 exited 1: error: rank 0: RuntimeError: fault "
                                     "injected by GPT3D_FAULT_INJECT=0:1 before step 1"), failed
    assert "Traceback" in (tmp_path / "gpu_check-logs" / "parity.log").read_text()
    assert rows[1]["note"] == "needs 2 devices, 1 here", rows[1]
    # On CPU no bf16 product is added into an fp32 gradient by a GPU kernel: neither probe ran.
    assert all(r["gemm_paths"] == {"fusion": [], "grouped": []} for r in rows), rows
    assert all(r["wall_s"] <= r["budget_s"] == gpu_check.CPU_BUDGET_S for r in rows), rows
    assert_table_is_the_json(table, report)


@pytest.mark.slow  # starts a check's process (and kills it within a second)
def test_a_check_past_its_budget_is_stopped_and_is_one_row(tmp_path):
    """A budget of 0.3 s (300 s scaled by 1e-3): the check's process is killed, the row says so,
    and the table and JSON still come; exit 1."""
    code, table, report = run_gpu_check(tmp_path, "--checks", "grad-accum-fusion", "--budget-scale", "0.001")
    [row] = report["rows"]
    assert code == 1 and row["status"] == "ERROR" and row["gemm_paths"] is None, (code, row)
    assert row["note"] == ("stopped: over its budget of 0.3 s (--budget-scale gives more); kept 0 step(s) of "
                           "metrics in 0 file(s)"), row
    assert row["wall_s"] < 10, row
    assert_table_is_the_json(table, report)


# ---------------------------------------------------------------- the device command, dry run

DEVICE_COMMAND = "bash bench/gpu/device_command.sh"
"""What the GPU machine runs (docs/gpu-check.md), word for word: the dry run below runs it too."""


def test_device_command_dry_run_packs_one_archive_with_every_row_its_traceback_and_kept_metrics(tmp_path):
    """The device command on this CPU machine, GPU_CHECK_DRY_RUN=1: a CPU stand-in for each row
    (a second's work, metrics written per step like a training run's), the wheelhouse's install
    skipped because deepspeed and datasets are importable here (the log says so). parity is forced
    to fail (launch/train.py's fault hook) and moe-mfu to hang before its third step, past its
    budget (a stand-in's 30 s, x 0.1: 3 s). The one archive in
    $OUT holds the table (text and JSON) with a row per check in order, every check's log, the
    failed row's traceback tail (in its log and in the JSON), and the stopped row's two metrics
    records."""
    from launch.resilience.failure import FAULT_ENV
    assert gpu_check_rows.FAULT_ENV == FAULT_ENV  # the stand-ins honour train.py's own hook
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, GPU_CHECK_DRY_RUN="1",
               GPU_CHECK_ARGS="--fail-row parity --hang-row moe-mfu --budget-scale 0.1")
    proc = subprocess.run(DEVICE_COMMAND, shell=True, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # a row is ERROR
    assert [p.name for p in out.iterdir()] == ["gpu_check.tar.gz"]
    with tarfile.open(out / "gpu_check.tar.gz") as archive:
        files = {m.name: archive.extractfile(m).read().decode() for m in archive.getmembers() if m.isfile()}
    report = json.loads(files["gpu_check/gpu_check.json"])
    rows = report["rows"]
    assert [r["check"] for r in rows] == list(gpu_check_rows.CHECKS) and report["complete"], rows
    table = files["gpu_check/gpu_check.txt"].splitlines()
    assert table[0].startswith("gpu_check on 1 CPU process(es), ")
    assert_table_is_the_json(table, report)
    assert "wheelhouse: not installed (deepspeed and datasets already importable)" in files["gpu_check/device.log"]
    assert all(f"gpu_check/gpu_check-logs/{check}.log" in files for check in gpu_check_rows.CHECKS), sorted(files)

    by_check = {r["check"]: r for r in rows}
    failed, stopped = by_check.pop("parity"), by_check.pop("moe-mfu")
    assert failed["status"] == "ERROR", failed
    assert failed["note"] == "RuntimeError: fault injected by GPT3D_FAULT_INJECT=0:1 before step 1", failed
    tail = "\n".join(failed["log_tail"])
    assert "Traceback (most recent call last)" in tail and tail.endswith(failed["note"]), tail
    assert tail in files["gpu_check/gpu_check-logs/parity.log"]

    assert stopped["status"] == "ERROR" and stopped["note"].startswith("stopped: over its budget of 3 s"), stopped
    assert stopped["metrics"] == {"moe-mfu/moe-mfu-standin.jsonl": 2}, stopped
    kept = [json.loads(line) for line in files["gpu_check/gpu_check-logs/moe-mfu/moe-mfu-standin.jsonl"].splitlines()]
    assert [r["step"] for r in kept] == [1, 2], kept

    assert all(r["status"] == "measured" and "eager" in r["what"] for r in by_check.values()), by_check
    assert all(r["metrics"] == {f"{r['check']}/{r['check']}-standin.jsonl": gpu_check_rows.STANDIN_STEPS}
               for r in by_check.values()), by_check


def test_a_row_says_eager_where_compilation_is_not_available(monkeypatch):
    """No Triton (torch.utils._triton.has_triton false, as on a build without it): the probe names
    the cause, and a GPU check built with it neither compiles nor calls itself compiled."""
    import torch.utils._triton
    monkeypatch.setattr(torch.utils._triton, "has_triton", lambda: False)
    reason = gpu_check_rows.compile_unavailable()
    assert reason == "compilation not available: no working Triton"
    check = gpu_check_rows.Check(1, REPO, on_cpu=False, eager_reason=reason)
    assert not check.compiles and check.mode() == "eager (compilation not available: no working Triton)"
    assert gpu_check_rows.Check(1, REPO, on_cpu=False).mode() == "compiled"


@pytest.mark.parametrize("per_layer, limit", [(10, 75), (10, 1000), (10, 25), (10, 15)])
def test_moe_layers_that_fit_is_the_largest_count_within_the_limit(per_layer, limit):
    """Against a count by brute force, on a planner whose bytes are affine in the layers (as
    launch/plan.py's are) and on one that bends upward past three layers (the estimate from one
    and two layers then overshoots and must step down); at most MOE_MAX_LAYERS."""
    for bend in (0, 7):
        def planned(n):
            return 12 + per_layer * (n - 1) + bend * max(0, n - 3) ** 2
        want = max(n for n in range(1, gpu_check_rows.MOE_MAX_LAYERS + 1) if planned(n) <= limit)
        assert gpu_check_rows.moe_layers_that_fit(planned, limit) == (want, planned(want)), (bend, limit)
    with pytest.raises(RuntimeError, match="one layer is planned at"):
        gpu_check_rows.moe_layers_that_fit(lambda n: 100 * n, 50)


def test_every_gpu_row_trains_offline(monkeypatch, tmp_path):
    """Each training run a check starts on a GPU (2 devices: zb-h1 too), captured instead of run,
    resolved by the recipe loader train.py uses: its corpus is the embedded one or a local file,
    its tokenizer the embedded one, wandb disabled. The GPU machine has no network; a hub name
    here would be a row that fails (or waits) there. (grad-accum-fusion trains nothing.)"""
    from data.builtin import BUILTIN
    started = []

    def train(recipe, sets, tp, pp, steps, out, on_cpu):
        started.append((recipe, list(sets), on_cpu))
        records = [{"step": s, "loss": 1.0, "grad_norm": 1.0, "step_time_s": 1.0, "tokens_per_s": 1.0,
                    "tflops_per_device": 1.0, "mfu": 0.5, "peak_memory_bytes": 1, "predicted_step_time_s": 1.0}
                   for s in range(1, steps + 1)]
        return gpu_check_runs.Run(records, {"fusion": [], "grouped": []})
    monkeypatch.setattr(gpu_check_runs, "train", train)
    monkeypatch.setattr(gpu_check_rows, "subprocess_run", lambda cmd: None)  # the planner's calibration
    monkeypatch.setattr(gpu_check_rows, "planned_memory", lambda path, recipe: 2 ** 30 * recipe.model.n_layer)
    monkeypatch.setattr(gpu_check_rows, "device_total_memory", lambda: 80 * 2 ** 30)
    for name in gpu_check_rows.TRAINING_CHECKS:
        gpu_check_rows.CHECKS[name](gpu_check_rows.Check(2, tmp_path, on_cpu=False))
    assert len(started) == 3 + 3 + 2 + 2 + 2, started  # parity, the 3 MFU rows, masks, zb-h1, step-prediction
    for recipe_path, sets, _ in started:
        recipe = load_recipe(recipe_path, sets)
        assert recipe.data.name == BUILTIN or Path(recipe.data.name).is_file(), (recipe_path, recipe.data.name)
        assert recipe.data.tokenizer == BUILTIN and recipe.wandb.mode == "disabled", (recipe_path, sets)


def test_checks_with_no_time_left_before_the_deadline_are_skipped_rows(tmp_path, capsys):
    """In process: --deadline-s 5.5 leaves under a second after the reserve for the table, so no
    check starts (no process is spawned) and each is a skipped row saying why; exit 0."""
    out = tmp_path / "gpu_check.json"
    code = gpu_check.main(["--cpu", "--standin", "--devices", "1", "--deadline-s", "5.5", "--json-out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert code == 0 and [r["check"] for r in rows] == list(gpu_check_rows.CHECKS), rows
    assert all(r["status"] == "skipped" and r["note"] == "not run: no time left of --deadline-s 5.5" for r in rows), rows
