"""Checkpoints of mixture-of-experts runs (docs/checkpoints.md, "Mixture of experts").

Every expert is saved once per TP rank, by the first EP group, into `experts/` files named by the
global expert ids they hold (launch/checkpoints/expert_files.py); the layer files hold the rest. In
process (fast): a save at (tp,pp,dp,ep) = (1,1,2,2) holds every expert, and resumes bit for bit
at its layout, at ZeRO-1 and ZeRO-0; loaded at (2,1,1), each rank's weights, fp32 masters and
Adam moments are the saved ones re-split, experts moved with their moments. Launched
(slow): moe-tiny resumed at its own layout continues bit for bit; at another (tp, dp, ep), from
(1,1,2,ep2) to (1,1,1) and from there to (2,1,2,ep2), within fp32 rounding; launch/evaluate.py
gives the run's validation loss at another layout.
"""
import json
from pathlib import Path

import pytest
import torch

from helpers.distributed import run_distributed, uses_deepspeed
from helpers.launcher import REPO, launch_forked, read_metrics
from helpers.multiple_choice_task import write_task

MOE_TINY = REPO / "recipes" / "moe-tiny.yaml"
VOCAB = 4096
MOMENTS = ("exp_avg", "exp_avg_sq")
RTOL = 1e-5


# ------------------------------------------------------------------ in process

def _moe_engine(tp: int, ep: int, zero_stage: int = 1):
    """The training run's engine for moe-tiny at (tp, pp=1, dp = world / tp, ep) on this process group."""
    import torch.distributed as dist

    from launch.config.layout import check_and_derive_layout
    from launch.config.recipe import load_recipe
    from launch.engine.engine import build_engine
    from model.parallel.state import init_parallel_state
    recipe = load_recipe(MOE_TINY, [f"train.ep={ep}", f"train.zero_stage={zero_stage}"])
    layout = check_and_derive_layout(recipe, dist.get_world_size(), tp, 1, True)
    state = init_parallel_state(tp, 1, 1, ep, experts=True)
    config = recipe.gpt_config(VOCAB)
    engine, _ = build_engine(recipe, layout, state, config)
    return recipe, layout, state, config, engine


def _train_step(engine, layout, state, config, step: int) -> float:
    """One optimizer step on random tokens of (step, dp rank): the TP ranks of a replica see the same."""
    from launch.engine.experts import set_router_loss_scale
    generator = torch.Generator().manual_seed(1000 * step + state.dp_rank)
    tokens = torch.randint(0, VOCAB, (layout.grad_accum_steps, layout.micro_batch_size, config.seq_len + 1),
                           generator=generator)
    set_router_loss_scale(engine, layout)
    return engine.train_batch(iter([(t[:, :-1], t[:, 1:]) for t in tokens])).item()


def _training_state(engine) -> dict:
    """{pipeline name: {fp32, exp_avg, exp_avg_sq}} of this rank's parameters (ZeRO-1; collective)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    # DeepSpeed 0.19.8 links the parameters to their moments after the first param group's first
    # step, when only that group has moments: link them again, now that every group has them.
    engine.optimizer._hp_optimizer_states_linked = False
    engine.optimizer._lazy_init_hp_params_optimizer_state()
    return {name: {"fp32": safe_get_full_fp32_param(p).clone(),
                   **{key: safe_get_full_optimizer_state(p, key).clone() for key in MOMENTS}}
            for name, p in engine.module.named_parameters()}


@uses_deepspeed
def _save_and_resume_body(root: Path, zero_stage: int):
    """(1,1,2,ep2): one step, save, a second step; load, the second step again: the same loss and
    weights, bit for bit. ZeRO-1 also records each rank's fp32 masters and moments at the save."""
    import torch.distributed as dist

    from launch.checkpoints import expert_files, store
    from launch.checkpoints.locate import find_checkpoint
    from launch.feed.run_inputs import resolved_recipe_dict
    recipe, layout, state, config, engine = _moe_engine(1, 2, zero_stage)
    _train_step(engine, layout, state, config, 1)
    store.save(engine, root, 1, 16, resolved_recipe_dict(recipe, VOCAB), vars(layout), 0,
               is_writer=dist.get_rank() == 0)
    if zero_stage == 1:
        torch.save(_training_state(engine), root.parent / f"state{dist.get_rank()}.pt")
    dist.barrier()  # the writer has committed
    loss = _train_step(engine, layout, state, config, 2)
    after = [p.detach().clone() for p in engine.module.parameters()]
    assert store.load(engine, find_checkpoint(root), vars(layout), state, config)["step"] == 1
    assert _train_step(engine, layout, state, config, 2) == loss
    assert all(torch.equal(a, p) for a, p in zip(after, engine.module.parameters()))  # Adam's state too


@pytest.fixture(scope="module")
def ep2_checkpoint(tmp_path_factory) -> Path:
    """The save directory of `_save_and_resume_body` at ZeRO-1 (checkpoint step00000001), with
    each rank's fp32 masters and moments at the save beside it (state0.pt, state1.pt)."""
    root = tmp_path_factory.mktemp("moe-ck") / "ck"
    run_distributed(_save_and_resume_body, 2, root, 1)
    return root


def _check_files(root: Path, zero_stage: int) -> None:
    tag = root / "step00000001"
    manifest = json.loads((tag / "complete.json").read_text())
    experts = sorted(p.name for p in (tag / "experts").iterdir())
    layers = [f"layer_{i:02d}-model_00-experts_{first}-{first + 3}.pt" for i in range(1, 5) for first in (0, 4)]
    assert experts == sorted(layers + (["optimizer-mp_rank_00-ep_rank_1.pt"] if zero_stage == 0 else []))
    assert {f"experts/{name}" for name in experts} <= set(manifest["files"])
    for layer in sorted(tag.glob("layer_0[1-4]-model_00-model_states.pt")):
        keys = torch.load(layer, weights_only=True).keys()
        assert "mlp.router.weight" in keys and not any("mlp.experts." in k for k in keys), keys


def test_every_expert_is_saved_and_resumes_bitwise(ep2_checkpoint):
    """Saved at (1,1,2,ep2): each MoE layer's 8 experts in two files (EP rank 0's and 1's, both
    written: the first EP group), none in the layer files, all in the manifest; resumed at the same
    layout bit for bit (in `_save_and_resume_body`)."""
    _check_files(ep2_checkpoint, 1)


def test_zero0_keeps_every_ep_ranks_optimizer_state(tmp_path):
    """ZeRO-0, whose optimizer state DeepSpeed saves from data index 0 only (EP rank 0's experts'
    moments), also keeps EP rank 1's: the resume at (1,1,2,ep2) is bitwise."""
    run_distributed(_save_and_resume_body, 2, tmp_path / "ck", 0)
    _check_files(tmp_path / "ck", 0)


@uses_deepspeed
def _reshard_body(root: Path, tp: int):
    """Load the (1,1,2,ep2) checkpoint at (tp,1,1,ep1): every parameter's weight, fp32 master and
    moments are the saved ones (EP rank 0's experts, then EP rank 1's), cut for this TP rank."""
    from launch.checkpoints import expert_files, store
    from launch.checkpoints.locate import find_checkpoint
    from model.hf.convert import dense_name, merge, merge_experts, rule_for, split
    recipe, layout, state, config, engine = _moe_engine(tp, 1)
    ref = find_checkpoint(root)
    assert store.load(engine, ref, vars(layout), state, config)["step"] == 1
    saved = [torch.load(root.parent / f"state{rank}.pt", weights_only=True) for rank in range(2)]
    got = _training_state(engine)
    params = dict(engine.module.named_parameters())
    for name, keys in got.items():
        dense = dense_name(name, config)
        for key, tensor in keys.items():
            if rule_for(dense, config).experts:  # EP ranks 0 and 1 of the save, each at tp 1
                full = merge_experts(dense, [merge(dense, [s[name][key]], VOCAB, config) for s in saved])
            else:
                full = merge(dense, [saved[0][name][key]], VOCAB, config)
            want = split(dense, full, state.tp_rank, tp, config.padded_vocab_size(tp), config)
            assert torch.equal(tensor, want), (name, key)
            if key == "fp32":
                assert torch.equal(params[name].detach(), want), name  # the model's weight too
    # The checkpoint's one reader (export, evaluation) gives every expert, at tp 1 as saved.
    layer = expert_files.read_layer_files([ref.path / "layer_03-model_00-model_states.pt"])[0]
    experts = torch.cat([s["3.mlp.experts.gate_up_proj"]["fp32"] for s in saved])
    assert torch.equal(layer["mlp.experts.gate_up_proj"], experts) and "mlp.router.weight" in layer


def test_experts_and_their_moments_reshard_to_another_ep_and_tp(ep2_checkpoint):
    """Saved at (1,1,2,ep2), loaded at (2,1,1,ep1): experts 0-3 from EP rank 0's ZeRO-1 partitions,
    4-7 from EP rank 1's, each with its own Adam moments, then split over TP."""
    run_distributed(_reshard_body, 2, ep2_checkpoint, 2)


# ------------------------------------------------------------------ launched runs

def _train(n: int, args, metrics: Path) -> str:
    proc = launch_forked(n, ["--recipe", str(MOE_TINY), "--metrics-out", str(metrics)] + [str(a) for a in args])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def ep2_run(tmp_path_factory):
    """moe-tiny at (tp,pp,dp,ep) = (1,1,2,2) for 4 steps, saved after steps 2 and 4, scoring a
    multiple-choice task after step 4 (eval.tasks)."""
    tmp = tmp_path_factory.mktemp("moe-ep2")
    task = write_task(tmp / "hellaswag.jsonl")
    _train(2, ["--ep", "2", "--steps", "4", "--save", tmp / "ck", "--save-every", "2",
               "--set", f"eval.tasks=[hellaswag={task}]"], tmp / "metrics.jsonl")
    return {"dir": tmp, "metrics": read_metrics(tmp / "metrics.jsonl")}


def _close(got, want, keys=("loss", "grad_norm", "val_loss")):
    for x, y in zip(got, want, strict=True):
        assert x["step"] == y["step"] and x["lr"] == y["lr"], (x, y)
        for key in keys:
            if key in y:
                assert abs(x[key] - y[key]) <= RTOL * abs(y[key]), (x["step"], key, x[key], y[key])


@pytest.mark.slow
def test_resume_at_the_saved_layout_is_bitwise(ep2_run, tmp_path):
    metrics = tmp_path / "resumed.jsonl"
    out = _train(2, ["--ep", "2", "--steps", "4", "--load", ep2_run["dir"] / "ck" / "step00000002"], metrics)
    assert "at step 2 (32 samples consumed)" in out and "re-sharded" not in out
    assert [(m["step"], m["loss"], m["grad_norm"], m["lr"], m.get("val_loss")) for m in read_metrics(metrics)] == \
        [(m["step"], m["loss"], m["grad_norm"], m["lr"], m.get("val_loss")) for m in ep2_run["metrics"][2:]]


@pytest.mark.slow
def test_resume_at_another_tp_dp_and_ep_matches(ep2_run, tmp_path):
    """(1,1,2,ep2) -> (1,1,1): EP ranks' experts merged; that run's step-3 checkpoint -> (2,1,2,ep2):
    each rank reads half of the saved experts and its TP shard of them. Both continue within fp32
    rounding of the uninterrupted run."""
    ck = tmp_path / "ck"
    out = _train(1, ["--steps", "4", "--load", ep2_run["dir"] / "ck" / "step00000002", "--save", ck,
                     "--save-every", "3"], tmp_path / "one.jsonl")
    assert "re-sharded from tp=1 pp=1 dp=2" in out, out[-2000:]
    _close(read_metrics(tmp_path / "one.jsonl"), ep2_run["metrics"][2:])
    out = _train(4, ["--tp", "2", "--ep", "2", "--steps", "4", "--load", ck / "step00000003"], tmp_path / "four.jsonl")
    assert "re-sharded from tp=1 pp=1 dp=1" in out, out[-2000:]
    _close(read_metrics(tmp_path / "four.jsonl"), ep2_run["metrics"][3:])


@pytest.mark.slow
def test_evaluate_an_ep2_checkpoint_at_ep1(ep2_run, tmp_path):
    """launch/evaluate.py on the (1,1,2,ep2) run's last checkpoint in one process: its validation
    loss; and the task the run scored after that step at ep 2 (the gold choices' mean
    log-likelihood within 1e-5, the same acc and acc_norm) scored again at ep 1."""
    out, scores = tmp_path / "eval.json", tmp_path / "tasks.jsonl"
    proc = launch_forked(1, ["--load", ep2_run["dir"] / "ck", "--batches", "1", "--set", "train.ep=1",
                             "--json-out", out, "--tasks", f"hellaswag={ep2_run['dir'] / 'hellaswag.jsonl'}",
                             "--metrics-out", scores], script="evaluate.py")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result, val_loss = json.loads(out.read_text()), ep2_run["metrics"][-1]["val_loss"]
    assert result["layout"]["ep"] == 1 and abs(result["loss"] - val_loss) <= RTOL * val_loss, (result, val_loss)
    (at_ep1,) = read_metrics(scores)
    at_ep2 = ep2_run["metrics"][-1]["tasks"]["hellaswag"]
    assert (at_ep1["acc"], at_ep1["acc_norm"], at_ep1["n"]) == (at_ep2["acc"], at_ep2["acc_norm"], at_ep2["n"])
    assert abs(at_ep1["gold_loglikelihood"] - at_ep2["gold_loglikelihood"]) <= RTOL * abs(at_ep2["gold_loglikelihood"])
