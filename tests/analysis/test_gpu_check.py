"""bench/gpu_check.py: its bad input, the corpus its document-mask check rests on, and (slow) the
new checks at toy sizes on one CPU device, the case an H200 takes (issue 24, item 8).

The document-mask check compares data.document_mask against the SDPA causal path on one
document: the two are the same attention only if no window's input holds an EOS (each EOS
starts a document). That is checked here on the windows launch/train.py trains, at the CPU's
and the GPU's seq_len; the slow test runs the check and breaks it with a second document."""
import subprocess
import sys

import numpy as np
import pytest

from bench import gpu_check, gpu_check_runs
from data.builtin import load_tokenizer
from data.windows import prepare_streams, windows
from launch.config.recipe import load_recipe
from helpers.launcher import REPO

GPU_CHECK = REPO / "bench" / "gpu_check.py"


@pytest.mark.parametrize("flags, named", [(["--checks", "parity,mfu"], "--checks mfu"),
                                          (["--cpu", "--devices", "0"], "--devices 0")])
def test_bad_flags_are_one_line_and_exit_2(flags, named, capsys):
    """In process (a fast test starts no bench script): argparse's one error line, exit 2."""
    with pytest.raises(SystemExit) as stop:
        gpu_check.main(flags)
    out, err = capsys.readouterr()
    assert stop.value.code == 2 and out == "", (stop.value.code, out)
    assert named in err.strip().splitlines()[-1], err


def test_one_document_corpus_puts_no_eos_in_any_trained_window(tmp_path):
    """Through the data path a run takes (the cached token stream, its windows): exactly one EOS
    in the whole stream, in no window's input, and enough windows for the check's steps."""
    corpus = gpu_check_runs.one_document_corpus(tmp_path / "one.jsonl")
    recipe = load_recipe(gpu_check.LLAMA_TINY, [f"data.name={corpus}", "data.val_fraction=0.0"])
    tokenizer = load_tokenizer("builtin")
    stream = np.asarray(prepare_streams(recipe.data, tokenizer).train)
    assert (stream == tokenizer.eos_token_id).sum() == 1
    for seq_len, needed in ((32, 4 * 4), (2048, 8 * 4)):  # CPU: 4 steps of 4; GPU: 8 steps of 4
        cut = windows(stream, seq_len)
        assert len(cut) >= needed, (seq_len, len(cut))
        assert not (cut[:, :-1] == tokenizer.eos_token_id).any(), seq_len


@pytest.mark.slow  # two training runs through launch/train.py
def test_one_device_cpu_check_runs_the_document_mask_and_skips_zb_h1_with_its_reason():
    """--cpu --devices 1 (one device, as on an H200): the document-mask row agrees within its
    bar (its two runs launched), and zb-h1 is a row marked skipped, with the reason."""
    proc = subprocess.run([sys.executable, str(GPU_CHECK), "--cpu", "--devices", "1", "--checks",
                           "document-mask,zb-h1"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    header, mask_row, skipped_row = proc.stdout.split("\ngpu_check on ", 1)[1].strip().splitlines()
    assert header.startswith("1 CPU process(es), "), header
    assert mask_row.startswith("llama-tiny document mask vs SDPA causal, fp32  max rel. diff "), mask_row
    diff, bar, verdict = (cell.strip() for cell in mask_row.split("fp32", 1)[1].split("  ") if cell.strip())
    assert float(diff.split()[-1]) <= 1e-5 and bar == "<= 1e-05" and verdict.startswith("ok, step time x"), mask_row
    assert skipped_row.split() == "zb-h1 vs 1f1b at pp=2, fp32 skipped needs 2 devices, 1 here skipped".split()
