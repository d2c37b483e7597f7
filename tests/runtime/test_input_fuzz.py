"""A fixed-seed fuzz of everything a user hands the start-up (tests/helpers/input_fuzz.py): each
case through launch/train.py's own `main`, in process, with the training loop replaced by a check
that the job is trainable. The property: a clean one-line `error: ...` and exit code 2, or an
accepted job that torch can build and step; never another exception, never a long wait."""
import json
import os
import signal
import time
from collections import Counter

import pytest
import torch

from data.builtin import builtin_tokenizer_dir
from helpers.input_fuzz import InputFuzz
from launch.checkpoints.manifest import CHECKPOINT_FORMAT, ENGINE_ZERO_STAGE
from launch.train import main

SEED = 20261206
CASE_BOUND_S = 20
"""A hang guard, not a timing: the slowest accepted case builds the data in about a second."""


class CaseTimedOut(Exception):
    pass


def _on_alarm(signum, frame):
    raise CaseTimedOut()


def trainable(job) -> None:
    """Raise unless the accepted job's model builds, gives a finite loss and takes an AdamW step with
    the recipe's settings (torch's own checks: init std, betas, eps...). One process only; a model
    of over 20M parameters is built on the meta device alone."""
    from model.gpt.model import GPT
    from model.parallel.cross_entropy import vocab_parallel_cross_entropy
    config = job.recipe.gpt_config(job.vocab_size, job.data.tokenizer.eos_token_id)
    with torch.device("meta"):
        size = sum(p.numel() for p in GPT(config).parameters())
    if size > 20_000_000 or job.layout.world_size > 1:
        return
    torch.manual_seed(0)
    model, train = GPT(config), job.recipe.train
    optimizer = torch.optim.AdamW(model.parameters(), lr=train.lr, betas=(train.beta1, train.beta2), eps=train.eps,
                                  weight_decay=train.weight_decay)
    ids = torch.randint(0, job.vocab_size, (1, job.recipe.seq_len))
    loss = vocab_parallel_cross_entropy(model(ids), ids.roll(-1, 1), None).mean()
    assert torch.isfinite(loss), f"an accepted recipe gives a loss of {loss}"
    loss.backward()
    optimizer.step()


def valid_meta():
    """complete.json as a real save writes it for tiny.yaml at (1,1,1), with no files to check."""
    from launch.config.cli import parse_training_args
    from launch.feed.run_inputs import resolved_recipe_dict
    from launch.trainer.startup import prepare_training_job
    job = prepare_training_job(parse_training_args(["--recipe", "recipes/tiny.yaml", "--steps", "2"]))
    return {"format": CHECKPOINT_FORMAT, "step": 1, "samples": job.recipe.train.global_batch_size,
            "layout": vars(job.layout), "recipe": resolved_recipe_dict(job.recipe, job.vocab_size),
            ENGINE_ZERO_STAGE: 0, "world_size": 1, "wandb_run_id": None, "data_state": None, "parent": None,
            "layout_auto": None,
            "data_fingerprint": job.data_fingerprint, "data_origin_samples": 0, "files": {}}


# 100 cases in the fast tier, 200 more (another seed) in the whole suite: about 40 ms a case.
@pytest.mark.parametrize("seed, n_cases", [(SEED, 100), pytest.param(SEED + 1, 200, marks=pytest.mark.slow)],
                         ids=["100", "200-more"])
def test_fuzzed_start_up_input_is_one_line_or_a_trainable_job(seed, n_cases, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")  # a fuzzed hub name fails here, never downloads
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    accepted_jobs = []
    monkeypatch.setattr("launch.trainer.loop.run_training", lambda job: accepted_jobs.append(job))
    fuzz = InputFuzz(seed, tmp_path, builtin_tokenizer_dir(), valid_meta())
    capsys.readouterr()
    outcomes, failures, slowest = Counter(), [], (0.0, None)
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    try:
        for case in fuzz.cases(n_cases):
            monkeypatch.setenv("WORLD_SIZE", str(case.world_size))
            accepted_jobs.clear()
            start = time.monotonic()
            signal.alarm(CASE_BOUND_S)
            try:
                code = main(case.argv)
                if accepted_jobs:
                    trainable(accepted_jobs[0])
            except CaseTimedOut:
                code = "hang"
            except BaseException as e:  # noqa: B036 (SystemExit included: the property is about every exit)
                code = f"{type(e).__name__}: {str(e)[:200]}"
            finally:
                signal.alarm(0)
            seconds = time.monotonic() - start
            slowest = max(slowest, (seconds, case.what))
            printed = capsys.readouterr()
            err = printed.err
            if code == 2 and err.startswith("error: ") and err.endswith("\n") and err[:-1].isprintable():
                outcomes["refused"] += 1
            elif code == 0 and (accepted_jobs or "nothing to do" in printed.out):
                outcomes["accepted"] += 1
            else:
                failures.append((case.what, case.world_size, [a[:120] for a in case.argv], code, err[-600:]))
    finally:
        signal.signal(signal.SIGALRM, previous)
    print(f"{n_cases} cases: {dict(outcomes)}; slowest {slowest[0]:.1f} s ({slowest[1]})")
    assert not failures, json.dumps(failures[:8], indent=1, ensure_ascii=True) + f"\n{len(failures)} failures"
    assert outcomes["refused"] > n_cases / 2 and outcomes["accepted"] >= n_cases / 25, outcomes  # the generator reaches both


@pytest.mark.slow
def test_fuzzed_bad_input_through_deepspeed_is_the_same_one_line(tmp_path, monkeypatch, capsys):
    """A refused checkpoint through `deepspeed --num_gpus 2` as a user starts it, and a refused recipe
    file on 2 ranks forked with the launcher's environment: exit code 2, the in-process error line
    once on stderr, no traceback, no rank started training. One launch: what the launcher adds (its
    exit code, its killing the waiting rank once rank 0 has printed) is the same for every refusal,
    which all leave through report_bad_input; the recipe file's line and exit code are the ranks' own,
    which the forked ranks show without another launcher and its ranks importing torch again."""
    from helpers.launcher import REPO, launch, launch_forked
    monkeypatch.chdir(REPO)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "RANK", "WORLD_SIZE"):
        monkeypatch.setenv(name, "1" if "OFFLINE" in name else "0" if name == "RANK" else "2")
    fuzz = InputFuzz(SEED + 1, tmp_path, builtin_tokenizer_dir(), valid_meta())
    capsys.readouterr()
    for make, start in ((fuzz.recipe_file, launch_forked), (fuzz.checkpoint, launch)):
        for _ in range(20):  # the first case of this kind refused in process
            case = make()
            if main(case.argv) == 2:
                break
        line = capsys.readouterr().err
        assert line.startswith("error: "), (case.what, line)
        proc = start(2, case.argv, env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}, timeout=300)
        assert proc.returncode == 2, (case.what, proc.stderr[-2000:])
        assert proc.stderr.count(line) == 1 and "Traceback" not in proc.stderr + proc.stdout, (case.what, line,
                                                                                             proc.stderr[-3000:])
