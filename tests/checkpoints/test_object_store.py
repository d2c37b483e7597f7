"""Checkpoints on object storage (launch/checkpoints/object_store.py), against a real S3 protocol
server started here (tests/helpers/s3_server.py: moto's server mode over HTTP), not a mock of boto.

In process: an upload cut short before its commit leaves a tag without complete.json and `latest`
naming the previous checkpoint, and no load takes it; with train.async_save (2 ranks, each its own
node), the background writer's upload leaves the synchronous save's objects, and one node's upload
cut short vetoes the commit. Launched (slow): a 2-rank run saves to
s3://.../run with --keep-last 2 over three saves; an export from the bucket equals the export of
the run's own local files; an upload cut short at the last save, resumed by one process (another
layout: ZeRO-1's partitions re-sharded) from the bucket with an empty cache (no shared disk),
continues the uninterrupted run's losses, and --keep-last 1 leaves one checkpoint in the bucket."""
import json
from pathlib import Path

import pytest

from helpers.builtin_cache import cache_with_builtin
from helpers.distributed import run_distributed, uses_deepspeed
from helpers.launcher import TINY, launch_forked, read_metrics
from helpers.s3_server import s3_server
from launch.errors import ConfigError

BUCKET = "ckpt"
RTOL = 1e-5  # tests/e2e/test_resume.py: a re-sharded resume matches within fp32 rounding


@pytest.fixture(scope="module")
def s3():
    with s3_server(BUCKET) as env:
        yield env


def _bucket(prefix: str):
    """{name under s3://BUCKET/prefix/: size} as the server lists it."""
    import fsspec
    fs = fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False)
    root = f"{BUCKET}/{prefix}"
    return fs, {p[len(root) + 1:]: info["size"] for p, info in fs.find(root, detail=True).items()}


# DeepSpeed's names at dp=2 (and ours): complete.json sorts before them, so an upload that sent it
# with the other files would have sent it in the first half.
FILES = ["layer_00-model_00-model_states.pt", "mp_rank_00_model_states.pt", "rng/rank_0.pt", "rng/rank_1.pt",
         "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]


def _local_checkpoint(root: Path, step: int) -> Path:
    tag = root / f"step{step:08d}"
    for name in FILES:
        (tag / name).parent.mkdir(parents=True, exist_ok=True)
        (tag / name).write_bytes(bytes([step]) * (len(name) + step))
    (tag / "complete.json").write_text(json.dumps({"step": step}))  # the local commit's
    return tag


def test_an_upload_cut_short_is_never_a_checkpoint(s3, tmp_path, monkeypatch):
    from launch.checkpoints.object_store import RemoteDir, stage
    monkeypatch.setenv("GPT3D_CACHE", str(tmp_path / "cache"))
    remote = RemoteDir(f"s3://{BUCKET}/cut")
    first = _local_checkpoint(tmp_path / "written", 1)
    remote.upload(first)
    remote.commit(first.name, {"step": 1, "parent": None}, keep_last=0)

    second = _local_checkpoint(tmp_path / "written", 2)
    put = remote.fs.put

    def killed_half_way(lpaths, rpaths, **kwargs):  # the process dies after half of the files
        put(lpaths[:len(lpaths) // 2], rpaths[:len(rpaths) // 2], **kwargs)
        raise KeyboardInterrupt
    monkeypatch.setattr(remote.fs, "put", killed_half_way)
    with pytest.raises(KeyboardInterrupt):
        remote.upload(second)
    monkeypatch.setattr(remote.fs, "put", put)

    fs, listed = _bucket("cut")
    assert "step00000001/complete.json" in listed and "step00000002/complete.json" not in listed, listed
    assert any(name.startswith("step00000002/") for name in listed)  # half of its files are there
    assert fs.cat_file(f"{BUCKET}/cut/latest") == b"step00000001"
    # The save directory loads the previous checkpoint, complete.json (the store's sizes) last.
    loaded = remote.fetch(None)
    assert (loaded / "latest").read_text() == "step00000001"
    assert sorted(p.name for p in loaded.iterdir() if p.name.startswith("step")) == ["step00000001"]
    manifest = json.loads((loaded / "step00000001" / "complete.json").read_text())
    assert manifest["files"] == {name: len(name) + 1 for name in sorted(FILES)}, manifest
    # A node other than rank 0's drops what it uploaded before (rank 0's --keep-last prunes its own
    # staging directory), unless it shares rank 0's staging directory.
    monkeypatch.setenv("MASTER_ADDR", "node0")
    monkeypatch.setenv("MASTER_PORT", "29500")
    remote.mark_writer()
    uploaded = _local_checkpoint(loaded, 2)
    remote.drop_uploaded(uploaded)
    assert (loaded / "step00000001").is_dir()
    monkeypatch.setenv("MASTER_PORT", "29501")  # another job's rank 0 shared it
    remote.drop_uploaded(uploaded)
    assert sorted(p.name for p in loaded.iterdir() if p.name.startswith("step")) == ["step00000002"]
    # The cut tag, named: one line, no download.
    with pytest.raises(ConfigError, match=r"step00000002 has no complete\.json .*cut short") as e:
        remote.fetch("step00000002")
    assert "\n" not in str(e.value)
    # A `latest` naming a tag without complete.json (removed by hand): refused, not an older one taken.
    fs.pipe_file(f"{BUCKET}/cut/latest", b"step00000002")

    def args(save, load):
        return type("Args", (), {"save": save, "load": load})()
    with pytest.raises(ConfigError, match="no complete.json"):
        stage(args(None, f"s3://{BUCKET}/cut"))
    # Another run saving into it (not resuming it): one line.
    with pytest.raises(ConfigError, match="holds the checkpoints of another run"):
        stage(args(f"s3://{BUCKET}/cut", None))


@uses_deepspeed
def _async_upload_body(tmp: Path, env: dict):
    """Two ranks, each its own node (LOCAL_RANK is the rank, and each has its own staging disk)."""
    import os
    import threading
    import torch
    import torch.distributed as dist
    from launch.checkpoints import store
    from launch.checkpoints.async_save import AsyncSaver
    from launch.checkpoints.object_store import RemoteDir
    from launch.config.layout import check_and_derive_layout
    from launch.config.recipe import load_recipe
    from launch.engine.engine import build_engine
    from launch.feed.run_inputs import resolved_recipe_dict
    from model.parallel.state import init_parallel_state

    rank = dist.get_rank()
    os.environ.update(env, GPT3D_CACHE=str(tmp / f"cache{rank}"), LOCAL_RANK="0")
    recipe = load_recipe(TINY, [])
    layout = check_and_derive_layout(recipe, 2, 1, 1, True)
    config = recipe.gpt_config(4096)
    engine, _ = build_engine(recipe, layout, init_parallel_state(1, 1), config)
    tokens = torch.randint(0, 4096, (16, 2, config.seq_len + 1), generator=torch.Generator().manual_seed(rank))

    def batches(step):
        return iter([(t[:, :-1], t[:, 1:]) for t in tokens[(step - 1) * 8:step * 8]])
    engine.train_batch(batches(1))
    recipe_dict = resolved_recipe_dict(recipe, 4096)
    sync, background = RemoteDir(f"s3://{BUCKET}/sync"), RemoteDir(f"s3://{BUCKET}/async")
    for remote in (sync, background):
        remote.local.mkdir(parents=True, exist_ok=True)
    store.save(engine, sync.local, 1, 16, recipe_dict, vars(layout), 0, is_writer=rank == 0, remote=sync)

    def main_thread_only(collective):  # the default group is the training thread's
        def checked(*args, group=None, **kwargs):
            assert group is not None or threading.current_thread() is threading.main_thread(), \
                f"{collective.__name__} on the default group from the background writer"
            return collective(*args, group=group, **kwargs)
        return checked
    dist.barrier, dist.all_reduce = main_thread_only(dist.barrier), main_thread_only(dist.all_reduce)
    saver = AsyncSaver()
    store.save(engine, background.local, 1, 16, recipe_dict, vars(layout), 0, is_writer=rank == 0,
               saver=saver, remote=background)
    engine.train_batch(batches(2))  # the training thread's collectives meanwhile, on the default group
    saver.wait()

    # Step 2: rank 1's node uploads 2 of its files, then its upload raises: no rank commits it.
    if rank == 1:
        put = background.fs.put

        def cut(lpaths, rpaths, **kwargs):
            put(lpaths[:2], rpaths[:2], **kwargs)
            raise OSError("connection reset")
        background.fs.put = cut
    store.save(engine, background.local, 2, 32, recipe_dict, vars(layout), 0, is_writer=rank == 0,
               saver=saver, remote=background)
    try:
        saver.wait()
        raise AssertionError("a cut upload was committed")
    except RuntimeError as e:
        assert ("connection reset" if rank == 1 else "another node's upload") in str(e), e


@pytest.mark.slow  # two gloo ranks, two saves and a step each: ~8 CPU-s (the cut upload above stays fast)
def test_an_async_save_uploads_in_the_background_as_a_synchronous_one(s3, tmp_path):
    """train.async_save with --save s3://: the background writer's upload leaves the objects (names
    and bytes) that a synchronous save of the same state leaves, while the next step trains (no
    collective of the writer's on the default group); a
    node's upload cut after 2 files vetoes the commit on every rank, and `latest` stays on the
    previous checkpoint."""
    run_distributed(_async_upload_body, 2, tmp_path, s3)
    fs, sync = _bucket("sync")
    _, background = _bucket("async")
    assert "step00000001/zero_pp_rank_1_mp_rank_00_optim_states.pt" in sync, sync  # rank 1's node's own file
    assert {name: size for name, size in background.items() if not name.startswith("step00000002/")} == sync
    for name in sync:
        assert fs.cat_file(f"{BUCKET}/async/{name}") == fs.cat_file(f"{BUCKET}/sync/{name}"), name
    assert fs.cat_file(f"{BUCKET}/async/latest") == b"step00000001"
    cut = [name for name in background if name.startswith("step00000002/")]
    assert cut and "step00000002/complete.json" not in cut, background  # the cut save's files, no commit


def _run(nprocs: int, args, env) -> str:
    proc = launch_forked(nprocs, ["--recipe", str(TINY), "--tp", "1", "--pp", "1", "--steps", "5"] + args, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow  # two training launches (2 ranks, then 1)
def test_save_prune_export_and_resume_at_another_layout_on_s3(s3, tmp_path, monkeypatch):
    from launch import export_hf
    from launch.checkpoints.object_store import staging_dir
    url = f"s3://{BUCKET}/run"
    full = tmp_path / "full.jsonl"
    _run(2, ["--save", url, "--save-every", "2", "--keep-last", "2", "--metrics-out", str(full)],
         dict(s3, GPT3D_CACHE=str(cache_with_builtin(tmp_path / "cache-a"))))
    fs, listed = _bucket("run")
    assert sorted({name.split("/")[0] for name in listed}) == ["latest", "step00000004", "step00000005"], listed
    assert fs.cat_file(f"{BUCKET}/run/latest") == b"step00000005"
    saved = json.loads(fs.cat_file(f"{BUCKET}/run/step00000005/complete.json"))
    assert saved["parent"] == "step00000004" and saved["layout"]["dp"] == 2
    # complete.json names every file the ranks wrote, at the size the store holds.
    assert saved["files"] == {name[len("step00000005/"):]: size for name, size in listed.items()
                              if name.startswith("step00000005/") and not name.endswith("/complete.json")}
    assert {"rng/rank_0.pt", "rng/rank_1.pt"} <= set(saved["files"]), saved["files"]

    # Export from the bucket: the weights of the run's own files (its staging directory), bit for bit.
    monkeypatch.setenv("GPT3D_CACHE", str(tmp_path / "cache-a"))
    written = staging_dir(url) / "step00000005"
    monkeypatch.setenv("GPT3D_CACHE", str(tmp_path / "cache-export"))
    assert export_hf.main(["--load", str(written), "--out", str(tmp_path / "hf-local")]) == 0
    assert export_hf.main(["--load", url, "--out", str(tmp_path / "hf-s3")]) == 0
    assert (tmp_path / "hf-s3" / "model.safetensors").read_bytes() == \
        (tmp_path / "hf-local" / "model.safetensors").read_bytes()

    # The last save's upload cut short before its commit: its complete.json is not there and
    # `latest` names the previous checkpoint (what object_store.publish leaves when killed there).
    fs.rm_file(f"{BUCKET}/run/step00000005/complete.json")
    fs.pipe_file(f"{BUCKET}/run/latest", b"step00000004")
    resumed = tmp_path / "resumed.jsonl"
    out = _run(1, ["--save", url, "--load", url, "--keep-last", "1", "--metrics-out", str(resumed)],
               dict(s3, GPT3D_CACHE=str(cache_with_builtin(tmp_path / "cache-b"))))  # another node: no checkpoint files
    assert "deleted from s3://ckpt/run: step00000005" in out, out[-2000:]
    assert "at step 4 (64 samples consumed)" in out and "re-sharded from tp=1 pp=1 dp=2" in out, out[-2000:]
    [again] = read_metrics(resumed)
    want = read_metrics(full)[4]
    assert again["step"] == want["step"] == 5
    for key in ("loss", "grad_norm"):
        assert abs(again[key] - want[key]) <= RTOL * abs(want[key]), (key, again, want)
    fs, listed = _bucket("run")
    assert sorted({name.split("/")[0] for name in listed}) == ["latest", "step00000005"], listed
    assert fs.cat_file(f"{BUCKET}/run/latest") == b"step00000005"
    saved = json.loads(fs.cat_file(f"{BUCKET}/run/step00000005/complete.json"))
    assert saved["layout"]["dp"] == 1 and saved["parent"] == "step00000004"
    assert not any("zero_pp_rank_1" in name for name in listed), listed  # the cut save's files went first
