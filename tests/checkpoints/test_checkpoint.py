"""Checkpoints: clear one-line errors for bad or damaged checkpoints and for a resume that
changes the model's shape (what else a resume may change: test_resume_changes.py), durable saves (fsync before `latest` moves), loads with
weights_only=True through DeepSpeed's own loader, `--keep-last` along the run's history and a
resume from an older tag; nothing outside the save directory is moved or deleted, and a save into
another run's checkpoints is refused. (Kills, signals and a dead rank: tests/e2e/test_checkpoint_crashes.py;
bitwise resume at every parity layout and at another layout: tests/e2e/test_resume.py.)"""
import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from helpers.file_tree import file_tree
from helpers.parity_runs import REFERENCE, SAVE_AT, STEPS
from helpers.distributed import run_distributed, uses_deepspeed
from helpers.launcher import TINY, launch_forked, read_metrics
from launch.checkpoints.manifest import CHECKPOINT_FORMAT, REQUIRED
from launch.train import main


def test_bad_checkpoints_are_one_line_errors(parity_runs, tmp_path, monkeypatch, capsys):
    ck = _copy_checkpoints(parity_runs, tmp_path)  # steps 3 and 5 (latest)
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("not a checkpoint")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    cases = [
        (["--load", str(tmp_path / "nope")], ["no such directory"]),
        (["--load", str(tmp_path / "empty")], ["is empty"]),
        (["--load", str(tmp_path / "other")], ["no complete checkpoint"]),
        (["--load", str(ck), "--set", "model.n_embd=32"], ["model.n_embd=64", "32"]),
        (["--load", str(ck), "--steps", str(STEPS)], [f"step {STEPS}", "nothing to train"]),
        (["--save-every", "2"], ["need --save"]),
        # The data's fingerprint (data/fingerprint.py), cached data here.
        (["--load", str(ck), "--seed", "7"], ["other data", "train.seed was", "now 7", "--restart-data",
                                              f"step {STEPS + 1}"]),
        (["--load", str(ck), "--set", "data.shuffle=false"], ["data.shuffle was True, now False"]),
        (["--restart-data"], ["--restart-data", "needs --load"]),
    ]
    for argv, words in cases:
        assert main(["--recipe", str(TINY), "--steps", str(STEPS + 2)] + argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and all(w in err for w in words), (argv, err)
    layer = next((ck / f"step{STEPS:08d}").glob("layer_02-*"))
    layer.write_bytes(layer.read_bytes()[:100])  # truncated, as by a full disk
    assert main(["--recipe", str(TINY), "--steps", str(STEPS + 2), "--load", str(ck)]) == 2
    err = capsys.readouterr().err
    assert "is damaged" in err and layer.name in err
    meta = json.loads((ck / f"step{STEPS:08d}" / "complete.json").read_text())
    assert meta["step"] == STEPS and meta["recipe"]["model"]["vocab_size"] == 4096
    # A real save writes format 2 and every key that format requires, and nothing the check leaves out;
    # its layout records one chunk per pipeline rank and no chunk boundaries.
    assert meta["format"] == 2 and set(meta) == set(REQUIRED), set(meta) ^ set(REQUIRED)
    assert meta["layout"]["virtual_stages"] == 1 and meta["layout"]["chunk_parts"] == [], meta["layout"]


def test_one_command_line_starts_a_run_and_resumes_it(parity_runs, tmp_path, capsys):
    """`--save DIR --load DIR`, as a scheduler reruns it after a preemption: DIR missing, empty or
    holding only a save cut short starts at step 1 with one line; with a checkpoint it resumes
    from DIR's latest; a --load of its own that holds nothing stays an error (a typo)."""
    from launch.checkpoints.locate import find_resume_point
    from launch.errors import ConfigError
    cut_short = tmp_path / "cut"
    (cut_short / "step00000002").mkdir(parents=True)  # the first run killed during its first save
    for fresh in (tmp_path / "missing", tmp_path / "empty", cut_short):
        if fresh.name == "empty":
            fresh.mkdir()
        assert find_resume_point(fresh, fresh, is_writer=True) is None
        assert capsys.readouterr().out == (f"--load {fresh}: no checkpoint there yet; starting at step 1 (rerun the "
                                           f"same command to resume from its checkpoints)\n")
    assert find_resume_point(tmp_path / "empty", tmp_path / "empty", is_writer=False) is None
    assert capsys.readouterr().out == ""  # one line for the job: the writer's
    ck = _copy_checkpoints(parity_runs, tmp_path)
    assert find_resume_point(ck, ck, is_writer=True).meta["step"] == STEPS
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("not a checkpoint")
    for load, save, words in ((tmp_path / "other", tmp_path / "other", "no complete checkpoint"),
                              (tmp_path / "missing", tmp_path / "elsewhere", "no such directory")):
        with pytest.raises(ConfigError, match=words):
            find_resume_point(load, save, is_writer=True)


def test_a_requeue_has_no_dead_ends(parity_runs, tmp_path, monkeypatch, capsys):
    """`--save DIR --load DIR` rerun (a requeued job) after a save killed between its complete.json and
    `latest` resumes the newest complete checkpoint when the manifests' parent chain holds every
    complete one (the first save has no parent at all), and stays an error when it does not; a
    rerun after the last step exits 0 with one line, where a --load of another directory is
    refused (exit 2: nothing to train)."""
    from launch.checkpoints.locate import find_resume_point
    from launch.errors import ConfigError
    ck = _copy_checkpoints(parity_runs, tmp_path)  # step 3 <- step 5, latest: step 5
    (ck / "latest").unlink()
    assert find_resume_point(ck, ck, is_writer=True).tag == "step00000005"
    assert capsys.readouterr().out == (f"--load {ck}: no latest file; resuming from step00000005, the newest "
                                       f"complete checkpoint, whose history holds every other one there\n")
    shutil.rmtree(ck / "step00000005")  # the first save, its `latest` never written
    assert find_resume_point(ck, ck, is_writer=False).tag == "step00000003"
    foreign = json.loads((ck / "step00000003" / "complete.json").read_text())
    shutil.copytree(ck / "step00000003", ck / "step00000004")  # a tag of another run: no parent link
    with pytest.raises(ConfigError, match="no latest file but complete checkpoints"):
        find_resume_point(ck, ck, is_writer=True)
    assert foreign["parent"] is None

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    done = _copy_checkpoints(parity_runs, tmp_path / "done")
    capsys.readouterr()
    assert main(["--recipe", str(TINY), "--steps", str(STEPS), "--save", str(done), "--load", str(done)]) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.splitlines()[-1] == (f"checkpoint {str(done / f'step{STEPS:08d}')!r} is at step {STEPS} of "
                                                  f"--steps {STEPS}: the run has finished, nothing to do"), out
    _one_line_error(["--load", str(done), "--steps", str(STEPS)], capsys, f"step {STEPS}", "nothing to train")


def _copy_checkpoints(parity_runs, tmp_path) -> Path:
    """A private copy of the (1,1,1) parity run's save directory: step 3 and step 5 (latest)."""
    ck = tmp_path / "ck"
    shutil.copytree(parity_runs[REFERENCE]["dir"] / "ck", ck)
    return ck


def _one_line_error(argv, capsys, *words):
    assert main(["--recipe", str(TINY), "--steps", str(STEPS + 2)] + argv) == 2, argv
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and all(w in err for w in words), (argv, err)


def test_a_save_into_another_runs_checkpoints_is_refused(parity_runs, tmp_path, monkeypatch, capsys):
    """`--save DIR` where DIR holds complete checkpoints this run does not resume from (no --load,
    or --load of another directory or of a tag there): one line naming DIR, its latest step and
    the ways on, exit 2, before the data is read, DIR byte for byte as it was (taken over, its `latest`
    would be removed and its steps moved aside). Resuming DIR itself saves there as before: --load DIR,
    and --load of an older tag of DIR, whose later tag moves aside; a fresh --save into a directory
    of only a save cut short starts."""
    import launch.trainer.startup as startup
    from launch.config.cli import parse_training_args
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    ck = _copy_checkpoints(parity_runs, tmp_path)  # steps 3 and 5 (latest)
    another = _copy_checkpoints(parity_runs, tmp_path / "another")
    before = file_tree(ck)
    read_data = startup.load_run_data

    def no_data(*args, **kwargs):
        raise AssertionError("the data was read before the save directory was refused")
    monkeypatch.setattr(startup, "load_run_data", no_data)
    for load in ([], ["--load", str(another)], ["--load", str(another / "step00000003")]):
        _one_line_error(["--save", str(ck)] + load, capsys, f"--save {str(ck)!r} holds the checkpoints of another run",
                        "(the latest: step00000005, step 5)", f"pass --load {str(ck)!r} to resume",
                        "--save another directory", "remove them")
        assert file_tree(ck) == before, load
    monkeypatch.setattr(startup, "load_run_data", read_data)

    def prepare(*argv):
        return startup.prepare_training_job(parse_training_args(["--recipe", str(TINY), "--steps", str(STEPS + 2),
                                                                 *argv], ""))
    assert prepare("--save", str(ck), "--load", str(ck)).resume_from.tag == "step00000005"  # a requeue
    assert file_tree(ck) == before
    assert prepare("--save", str(ck), "--load", str(ck / "step00000003")).resume_from.tag == "step00000003"
    aside, = ck.glob("abandoned-*")
    assert [p.name for p in aside.iterdir()] == ["step00000005"] and (ck / "latest").read_text() == "step00000003"
    cut_short = tmp_path / "cut"
    (cut_short / "step00000002").mkdir(parents=True)
    assert prepare("--save", str(cut_short)).resume_from is None
    assert [p.name[:len("abandoned-")] for p in cut_short.iterdir()] == ["abandoned-"]


def test_unreadable_manifest_or_latest_is_an_error_not_an_older_checkpoint(parity_runs, tmp_path, monkeypatch,
                                                                           capsys):
    """A complete.json that exists but cannot be read, a `latest` that names no complete
    checkpoint, or no `latest` at all: one-line errors, never a quiet resume from step 3. And a
    changed global batch is refused before the sampler's assert."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    ck = _copy_checkpoints(parity_runs, tmp_path)
    manifest = ck / "step00000005" / "complete.json"
    good = manifest.read_text()
    _one_line_error(["--load", str(ck), "--set", "train.global_batch_size=32"], capsys,
                    "train.global_batch_size=16", "this run 32", "--set train.global_batch_size=16")
    manifest.write_text(good[:len(good) // 2])  # cut short
    _one_line_error(["--load", str(ck)], capsys, "step00000005", "unreadable complete.json", "JSONDecodeError")
    _one_line_error(["--load", str(ck / "step00000005")], capsys, "unreadable complete.json")
    manifest.write_text(json.dumps({"format": CHECKPOINT_FORMAT, "step": 5}))  # parses, but is not a manifest
    _one_line_error(["--load", str(ck)], capsys, "unreadable complete.json", "no samples, layout, recipe, files")
    manifest.unlink()
    manifest.mkdir()  # reading it is an OSError
    _one_line_error(["--load", str(ck)], capsys, "unreadable complete.json", "IsADirectoryError")
    manifest.rmdir()
    _one_line_error(["--load", str(ck)], capsys, "latest names 'step00000005'", "not a complete checkpoint")
    (ck / "latest").unlink()
    _one_line_error(["--load", str(ck)], capsys, "no latest file", "step00000003", f"--load {ck / 'step00000003'}")


def _manifest(tag_dir: Path, parent):
    tag_dir.mkdir(parents=True)
    (tag_dir / "weights.pt").write_bytes(b"w")
    (tag_dir / "complete.json").write_text(json.dumps({"step": int(tag_dir.name[4:]), "parent": parent}))


def test_keep_last_follows_the_history_not_the_names(tmp_path):
    """--keep-last 2 after a save at step 5 whose history is 5 <- 4 <- 2: step 2 goes; step 1 (an
    earlier run: step 2 has no parent) and step 3 (not in the chain) stay, where sorting by name
    would delete steps 1-3. The tags a resume set aside (abandoned-*) go too."""
    from launch.checkpoints import store as checkpoint
    for step, parent in [(1, None), (2, None), (3, "step00000002"), (4, "step00000002"), (5, "step00000004")]:
        _manifest(tmp_path / f"step{step:08d}", parent)
    (tmp_path / "latest").write_text("step00000005")
    assert [p.name for p in checkpoint.history(tmp_path, "step00000005")] == \
        ["step00000005", "step00000004", "step00000002"]
    (tmp_path / "abandoned-20261202T000000Z" / "step00000009").mkdir(parents=True)  # an earlier run's, set aside
    checkpoint._prune_in_background(tmp_path, "step00000005", keep_last=2)
    checkpoint._pruning.join()
    assert sorted(p.name for p in tmp_path.iterdir()) == \
        ["latest", "step00000001", "step00000003", "step00000004", "step00000005"]


def test_pruning_never_leaves_the_save_directory(tmp_path):
    """--keep-last and the set-aside at start act only on the save directory's own entries. A
    complete.json whose parent names another run's checkpoint ("../other-run/step00000001", an
    absolute path, a path through a link, a tag that is a link) ends the history there; a link
    named like a tag or abandoned-* is neither moved nor pruned. The other run's directory stays
    byte for byte: its checkpoint is never moved into the save directory and deleted there."""
    from launch.checkpoints import store as checkpoint
    from launch.checkpoints.locate import CheckpointRef
    other = tmp_path / "other-run"
    for step in (1, 2):
        _manifest(other / f"step{step:08d}", None)
        (other / f"step{step:08d}" / "SENTINEL").write_text("another run's checkpoint")
    (other / "set-aside").mkdir()
    (other / "set-aside" / "SENTINEL").write_text("another run's files")
    before = file_tree(other)
    parents = {"relative": "../other-run/step00000001", "absolute": str(other / "step00000001"),
               "through-a-link": "into-other/step00000001", "a-linked-tag": "step00000002"}
    links = ["abandoned-20261202T000000Z", "into-other", "step00000002"]
    for case, parent in parents.items():
        root = tmp_path / case
        root.mkdir()
        (root / "into-other").symlink_to(other)
        (root / "step00000002").symlink_to(other / "step00000002")
        (root / "abandoned-20261202T000000Z").symlink_to(other / "set-aside")
        _manifest(root / "step00000005", parent)
        _manifest(root / "step00000006", "step00000005")
        assert [p.name for p in checkpoint.history(root, "step00000006")] == ["step00000006", "step00000005"], case
        checkpoint._prune_in_background(root, "step00000006", keep_last=1)  # as save() calls it
        checkpoint._pruning.join()
        assert file_tree(other) == before, case
        assert sorted(p.name for p in root.iterdir()) == sorted(links + ["step00000006"]), case
        assert all((root / link).is_symlink() for link in links), case
    root = tmp_path / "resumed"  # resumed at step 1: its step 3 moves aside, the linked step 9 stays
    for step in (1, 3):
        _manifest(root / f"step{step:08d}", None)
    (root / "step00000009").symlink_to(other / "step00000002")
    checkpoint.prepare_save_dir(root, CheckpointRef(root, "step00000001", {"step": 1}), is_writer=True)
    aside, = root.glob("abandoned-*")
    assert [p.name for p in aside.iterdir()] == ["step00000003"] and (root / "step00000009").is_symlink()
    assert file_tree(other) == before


def test_prepare_save_dir_moves_later_tags_aside(tmp_path, capsys):
    """Resumed at step 2 into a directory holding steps 1-5 (4 incomplete): 3, 4 and 5 move into
    one abandoned-<time> directory and `latest` names step 2. A fresh run into a directory of
    only a save cut short moves it aside and removes `latest` (one into complete checkpoints is
    refused before: test_a_save_into_another_runs_checkpoints_is_refused); a non-writer rank
    touches nothing."""
    from launch.checkpoints.locate import CheckpointRef
    from launch.checkpoints.store import prepare_save_dir
    for step in (1, 2, 3, 5):
        _manifest(tmp_path / f"step{step:08d}", None)
    (tmp_path / "step00000004").mkdir()  # a save cut short
    (tmp_path / "latest").write_text("step00000005")
    ref = CheckpointRef(tmp_path, "step00000002", {"step": 2})
    prepare_save_dir(tmp_path, ref, is_writer=False)
    assert (tmp_path / "step00000005").is_dir()
    prepare_save_dir(tmp_path, ref, is_writer=True)
    aside, = tmp_path.glob("abandoned-*")
    assert sorted(p.name for p in aside.iterdir()) == ["step00000003", "step00000004", "step00000005"]
    assert (aside / "step00000005" / "complete.json").exists()
    assert sorted(p.name for p in tmp_path.glob("step*")) == ["step00000001", "step00000002"]
    assert (tmp_path / "latest").read_text() == "step00000002"
    assert str(aside) in capsys.readouterr().out
    fresh = tmp_path / "fresh"
    (fresh / "step00000004").mkdir(parents=True)  # an earlier start killed during its first save
    (fresh / "latest").write_text("step00000002")  # naming nothing complete here
    prepare_save_dir(fresh, None, is_writer=True)
    aside, = fresh.glob("abandoned-*")
    assert [p.name for p in aside.iterdir()] == ["step00000004"]
    assert not list(fresh.glob("step*")) and not (fresh / "latest").exists()


@pytest.mark.slow
def test_resume_from_an_older_tag_keeps_this_runs_history(parity_runs, tmp_path):
    """Resume the (1,1,1) parity run from step 3 into its own save directory, which holds its
    step 5 (latest), with --save-every 1 --keep-last 2. The old step 5 moves aside (it is not in the
    new run's history, whatever the tags' names sort as), and --keep-last prunes what was
    set aside at the next save; the new run saves 4 and 5, prunes step 3 (its parent, the third
    newest of its history), and its steps 4-5 and final weights are the uninterrupted run's, bit
    for bit."""
    ck, metrics = _copy_checkpoints(parity_runs, tmp_path), tmp_path / "m.jsonl"
    proc = launch_forked(1, ["--recipe", str(TINY), "--steps", str(STEPS), "--load", str(ck / f"step{SAVE_AT:08d}"),
                      "--save", str(ck), "--save-every", "1", "--keep-last", "2", "--metrics-out", str(metrics)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"checkpoints after step {SAVE_AT} moved out of the way into {ck}/abandoned-" in proc.stdout
    assert not list(ck.glob("abandoned-*")), list(ck.iterdir())
    assert sorted(p.name for p in ck.glob("step*")) == ["step00000004", "step00000005"]
    assert (ck / "latest").read_text() == "step00000005"
    parents = {t: json.loads((ck / t / "complete.json").read_text())["parent"]
               for t in ("step00000004", "step00000005")}
    assert parents == {"step00000004": "step00000003", "step00000005": "step00000004"}
    full = parity_runs[REFERENCE]["metrics"]
    assert [(m["step"], m["loss"], m["grad_norm"]) for m in read_metrics(metrics)] == \
        [(m["step"], m["loss"], m["grad_norm"]) for m in full[SAVE_AT:]]
    for new in sorted((ck / "step00000005").glob("layer_*")):
        uninterrupted = parity_runs[REFERENCE]["dir"] / "ck" / "step00000005" / new.name
        a, b = torch.load(new, weights_only=True), torch.load(uninterrupted, weights_only=True)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), new.name


class _Exploit:
    """A pickled call: unpickling it with weights_only=False creates the file `marker`."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


@uses_deepspeed
def _durable_and_safe_body(root: Path):
    """Save a real 2-stage engine while recording every fsync and rename; resume from it through
    DeepSpeed's loader (same step again: same loss, bit for bit); then load a copy whose
    model-state files carry a pickled call: refused on every rank, and nothing ran."""
    import torch.distributed as dist

    from launch.checkpoints import store as checkpoint
    from launch.checkpoints.locate import CheckpointRef, find_checkpoint
    from launch.checkpoints.safe_io import UnsafeCheckpoint
    from launch.config.layout import check_and_derive_layout
    from launch.config.recipe import load_recipe
    from launch.engine.engine import build_engine
    from launch.feed.run_inputs import resolved_recipe_dict
    from model.parallel.state import init_parallel_state

    recipe = load_recipe(TINY, [])
    layout = check_and_derive_layout(recipe, 2, 1, 2, True)
    state = init_parallel_state(1, 2)
    config = recipe.gpt_config(4096)
    engine, _ = build_engine(recipe, layout, state, config)
    tokens = torch.randint(0, 4096, (64, 2, config.seq_len + 1), generator=torch.Generator().manual_seed(0))

    def batches(step):
        return iter([(t[:, :-1], t[:, 1:]) for t in tokens[(step - 1) * 8:step * 8]])
    engine.train_batch(batches(1))

    events, fsync, replace = [], os.fsync, os.replace
    os.fsync = lambda fd: (events.append((time.monotonic_ns(), "fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                           fsync(fd))[1]
    os.replace = lambda a, b: (events.append((time.monotonic_ns(), "replace", str(b))), replace(a, b))[1]
    try:
        checkpoint.save(engine, root, 1, 16, resolved_recipe_dict(recipe, 4096), vars(layout), 0,
                        is_writer=dist.get_rank() == 0)
    finally:
        os.fsync, os.replace = fsync, replace
    (root.parent / f"events{dist.get_rank()}.json").write_text(json.dumps(events))
    dist.barrier()  # the writer has committed

    loss = engine.train_batch(batches(2)).item()
    after = [p.detach().clone() for p in engine.module.parameters()]
    ref = find_checkpoint(root)
    assert checkpoint.load(engine, ref, vars(layout), state, config)["step"] == 1
    assert engine.train_batch(batches(2)).item() == loss  # the weights of step 1
    assert all(torch.equal(a, p) for a, p in zip(after, engine.module.parameters()))  # Adam's state too

    poisoned = root.parent / "poisoned"
    if dist.get_rank() == 0:
        shutil.copytree(root, poisoned)
        for model_states in sorted((poisoned / ref.tag).glob("mp_rank_*_model_states.pt")):
            torch.save(dict(torch.load(model_states, weights_only=False), note=_Exploit(str(root.parent / "ran"))),
                       model_states)
    dist.barrier()
    with pytest.raises(UnsafeCheckpoint, match="refused to load checkpoint file .*mp_rank_0.*Unsupported global"):
        checkpoint.load(engine, CheckpointRef(poisoned, ref.tag, ref.meta), vars(layout), state, config)
    assert not (root.parent / "ran").exists()


@pytest.mark.slow  # two ranks save, resume and load a poisoned file (10 CPU-s)
def test_save_is_durable_and_every_load_is_weights_only(tmp_path):
    """Every file of the checkpoint is fsynced (by the rank that wrote it) before the writer
    renames complete.json into place; the directories are fsynced and `latest` moves last.
    Loading goes through DeepSpeed's own loader with weights_only=True: a normal resume is
    bitwise, a file with a pickled call is refused, and the same file run through torch's
    default unpickler (weights_only=False) does run the call."""
    root = tmp_path / "ck"
    run_distributed(_durable_and_safe_body, 2, root)
    writer = json.loads((tmp_path / "events0.json").read_text())
    other = json.loads((tmp_path / "events1.json").read_text())
    tag = root / "step00000001"
    manifest = json.loads((tag / "complete.json").read_text())
    fsynced = {path for _, kind, path in writer + other if kind == "fsync"}
    assert {str(tag / name) for name in manifest["files"]} <= fsynced, fsynced
    assert any("rank_1.pt" in path for _, kind, path in other if kind == "fsync")
    commit = next(t for t, kind, path in writer if kind == "replace" and path == str(tag / "complete.json"))
    latest = next(t for t, kind, path in writer if kind == "replace" and path == str(root / "latest"))
    files = {str(tag / name) for name in manifest["files"]}
    assert all(t < commit for t, kind, path in writer + other if kind == "fsync" and path in files)
    assert any(kind == "fsync" and path == str(tag) and t < commit for t, kind, path in writer)
    assert any(kind == "fsync" and path == str(root) and commit < t < latest for t, kind, path in writer)
    assert writer[-1][1:] == ["fsync", str(root)] and writer[-2][1:] == ["replace", str(root / "latest")]
    # The payload is live: torch's default unpickler runs it.
    torch.load(next((tmp_path / "poisoned" / "step00000001").glob("mp_rank_00_*")), weights_only=False)
    assert (tmp_path / "ran").exists()
