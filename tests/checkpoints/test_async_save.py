"""train.async_save (launch/checkpoints/async_save.py): a save returns before its host snapshot is
filled, and the files its background writer leaves are byte for byte the synchronous save's of the
same state, although the next step ran meanwhile and changed every weight: its optimizer step waits
for the copies; `latest` moves once every rank's files are written. (A rank killed during the
background write: tests/e2e/test_checkpoint_crashes.py.)"""
import json
import threading
from pathlib import Path

from helpers.distributed import run_distributed, uses_deepspeed
from helpers.launcher import TINY


@uses_deepspeed
def _async_equals_sync_body(root: Path):
    import torch
    import torch.distributed as dist

    from launch.analysis.memory_formulas import checkpoint_snapshot_bytes
    from launch.checkpoints import async_save, store
    from launch.config.layout import check_and_derive_layout
    from launch.config.recipe import load_recipe
    from launch.engine.engine import build_engine
    from launch.feed.run_inputs import resolved_recipe_dict
    from model.parallel.state import init_parallel_state

    recipe = load_recipe(TINY, [])
    layout = check_and_derive_layout(recipe, 2, 1, 1, True)  # dp 2: ZeRO-1 partitions, views of flat buffers
    state = init_parallel_state(1, 1)
    config = recipe.gpt_config(4096)
    engine, _ = build_engine(recipe, layout, state, config)
    tokens = torch.randint(0, 4096, (32, 2, config.seq_len + 1),
                           generator=torch.Generator().manual_seed(dist.get_rank()))

    def batches(step):
        return iter([(t[:, :-1], t[:, 1:]) for t in tokens[(step - 1) * 8:step * 8]])
    engine.train_batch(batches(1))
    args = (1, 16, resolved_recipe_dict(recipe, 4096), vars(layout), 0)
    writer = dist.get_rank() == 0
    store.save(engine, root / "sync", *args, is_writer=writer)

    # The snapshot's copies wait (up to 3 s) for the next optimizer step to change every weight and
    # Adam moment: with the gate, that step waits for them instead, and the copies time out first.
    stepped, fill, inner = threading.Event(), async_save.HostSnapshot.fill, engine.optimizer.step
    engine.optimizer.step = lambda *a, **k: (inner(*a, **k), stepped.set())[0]
    async_save.HostSnapshot.fill = lambda self: (stepped.wait(3), fill(self))[1]
    saver = async_save.AsyncSaver()
    try:
        store.save(engine, root / "async", *args, is_writer=writer, saver=saver)
        assert saver.in_flight
        before = [p.detach().clone() for p in engine.module.parameters()]
        engine.train_batch(batches(2))
        assert not any(torch.equal(a, p) for a, p in zip(before, engine.module.parameters()))
        assert saver.gated_s > 0  # the step waited for the copies
        saver.wait()
    finally:
        async_save.HostSnapshot.fill = fill
    dist.barrier()
    assert (root / "async" / "latest").read_text() == "step00000001"
    # The host memory of the snapshot, against the planner's term on the rank that writes the most.
    local = sum(p.numel() for p in engine.module.parameters())
    measured = torch.tensor([saver.snapshot.bytes], dtype=torch.float64)
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)
    (root / f"snapshot{dist.get_rank()}.json").write_text(json.dumps(
        {"measured": measured.item(), "formula": checkpoint_snapshot_bytes(local, 2, 1, 4)}))


def test_async_save_writes_the_synchronous_files_after_training_moved_on(tmp_path):
    run_distributed(_async_equals_sync_body, 2, tmp_path)
    sync, background = tmp_path / "sync" / "step00000001", tmp_path / "async" / "step00000001"
    names = sorted(str(p.relative_to(sync)) for p in sync.rglob("*") if p.is_file())
    assert names == sorted(str(p.relative_to(background)) for p in background.rglob("*") if p.is_file())
    assert any(n.startswith("zero_pp_rank_1") for n in names) and "rng/rank_1.pt" in names, names
    for name in names:  # byte-identical files: the same resume, bit for bit
        assert (sync / name).read_bytes() == (background / name).read_bytes(), name
    snapshot = json.loads((tmp_path / "snapshot0.json").read_text())
    assert 0.95 * snapshot["formula"] <= snapshot["measured"] <= 1.05 * snapshot["formula"], snapshot
