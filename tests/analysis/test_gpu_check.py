"""bench/gpu/gpu_check.py: its bad input, the corpus its document-mask check rests on, and (slow) that a
check which fails, or runs past its budget, is one row while the table and the JSON keep every
check, on one CPU device: the case an H200 takes.

The document-mask check compares data.document_mask against the causal path on one document: the
two are the same attention only if no window's input holds an EOS (each EOS starts a document).
That is checked here on the windows launch/train.py trains, at the CPU's and the GPU's seq_len."""
import json
import re
import subprocess
import sys

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
                                          (["--cpu", "--fail-row", "grad-accum-fusion"], "--fail-row")])
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
    assert row["note"] == "stopped: over its budget of 0.3 s (--budget-scale gives more)", row
    assert row["wall_s"] < 10, row
    assert_table_is_the_json(table, report)
