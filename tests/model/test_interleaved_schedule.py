"""Interleaved 1F1B (train.virtual_stages): its order (launch/analysis/interleaved_schedule.py) against
what a pipeline needs (every pass once, each after the passes it reads, simulated with every
dependency; the bubble (p-1)/(v m) of Narayanan et al. 2021, sec. 2.2.2; DeepSpeed's own 1F1B at
v = 1; messages that match in order), the start-up refusals, and real engines (launch/engine/
interleaved.py) at v = 2 against v = 1: the same losses, and weights within fp32 rounding."""
import pytest
from deepspeed.runtime.pipe import schedule

from helpers.distributed import run_distributed, uses_deepspeed
from launch.analysis import formulas
from launch.analysis.interleaved_schedule import (Pass, activations_in_flight, check_interleaving, idle_fraction,
                                                  interleaved_order, p2p_messages_per_step, peak_in_flight,
                                                  simulate_interleaved, stage_of, warmup_passes)
from launch.analysis.schedule_sim import instruction_streams
from launch.errors import ConfigError

SHAPES = [(2, 2, 2), (2, 2, 4), (2, 4, 6), (4, 2, 4), (4, 2, 8), (4, 4, 8), (3, 3, 6), (8, 2, 16), (4, 2, 16)]


@pytest.mark.parametrize("pp,v,m", SHAPES)
def test_every_pass_once_after_what_it_reads(pp, v, m):
    """Each rank runs the forward and the backward of each of its chunks for each micro-batch exactly
    once; played with every dependency (stage s's forward after stage s-1's, its backward after its
    own forward and stage s+1's backward) no rank waits forever, and each pass starts after the
    passes it reads have ended."""
    order = interleaved_order(pp, v, m)
    for rank, passes in enumerate(order):
        assert sorted(passes) == sorted(Pass(c, i, k) for c in range(v) for i in range(m) for k in "FB")
        for c in range(v):  # micro-batches go through each chunk in order, forwards and backwards alike
            for kind in "FB":
                assert [p.microbatch for p in passes if (p.chunk, p.kind) == (c, kind)] == list(range(m))
    events = simulate_interleaved(pp, v, m, 1.0, 2.0, t_p2p=0.25)
    end = {(kind, stage_of(rank, chunk, pp), mb): (start, stop) for rank, kind, chunk, mb, start, stop in events}
    assert len(end) == 2 * pp * v * m
    for (kind, stage, mb), (start, _) in end.items():
        reads = [("F", stage - 1, mb)] if kind == "F" and stage else []
        reads += [("F", stage, mb)] + ([("B", stage + 1, mb)] if stage < pp * v - 1 else []) if kind == "B" else []
        assert all(end[r][1] <= start for r in reads), (kind, stage, mb)


@pytest.mark.parametrize("pp,v,m", SHAPES)
@pytest.mark.parametrize("t_backward", [1.0, 2.0])
def test_bubble_is_p_minus_1_over_v_m(pp, v, m, t_backward):
    """Equal stages, each chunk 1/v of a stage's pass times: the step is the ideal m (T_F + T_B) plus
    (p-1)(T_F + T_B)/v, a bubble of (p-1)/(v m) of the ideal [Narayanan et al. 2021, sec. 2.2.2];
    at v = 1, 1F1B's (p-1)/(m+p-1) of the step (formulas.bubble_fraction)."""
    events = simulate_interleaved(pp, v, m, 1.0 / v, t_backward / v)
    span = max(e[5] for e in events)
    ideal = m * (1.0 + t_backward)
    assert (span - ideal) / ideal == pytest.approx((pp - 1) / (v * m))
    assert idle_fraction(events) == pytest.approx(formulas.interleaved_bubble_fraction(pp, m, v))
    assert formulas.interleaved_bubble_fraction(pp, m, 1) == formulas.bubble_fraction(pp, m)
    one_f_one_b = simulate_interleaved(pp, 1, m, 1.0, t_backward)
    assert idle_fraction(one_f_one_b) == pytest.approx(formulas.bubble_fraction(pp, m))


def _messages(pp: int, v: int, m: int):
    """Per (sender, receiver) pair of ranks: the messages in the order the sender sends them and in
    the order the receiver receives them, from the engine's instruction streams (forward or
    interleaved evaluation order alike)."""
    from launch.engine.interleaved import InterleavedSchedule
    sent, received = {}, {}
    peers = {schedule.SendActivation: 1, schedule.SendGrad: -1, schedule.RecvActivation: -1, schedule.RecvGrad: 1}
    for train in (True, False):
        for rank in range(pp):
            for cmd in (c for step in InterleavedSchedule(m, pp, rank, v, train=train) for c in step):
                if type(cmd) not in peers:
                    continue
                peer = (rank + peers[type(cmd)]) % pp
                kind = "A" if type(cmd) in (schedule.SendActivation, schedule.RecvActivation) else "G"
                if type(cmd) in (schedule.SendActivation, schedule.SendGrad):
                    sent.setdefault((train, rank, peer), []).append(kind)
                else:
                    received.setdefault((train, peer, rank), []).append(kind)
    return sent, received


@pytest.mark.parametrize("pp,v,m", SHAPES)
def test_messages_match_in_order_and_sends_must_not_block(pp, v, m):
    """What the engine's point-to-point needs (launch/engine/interleaved.py):
    - on each pair of ranks and direction, the sender's messages come in the order the receiver
      takes them, activations and gradients alike (at pp = 2 both share the pair): untagged
      messages match in order, on gloo and on NCCL, which ignores tags;
    - sends must not wait for their receive: played with sends that do (DeepSpeed's p2p.send),
      the streams deadlock; with sends that do not, `simulate_interleaved` finishes (above);
    - the last rank runs each last-chunk backward right after that micro-batch's forward, so
      DeepSpeed's one `loss` of the last stage is that micro-batch's."""
    from launch.engine.interleaved import InterleavedSchedule
    sent, received = _messages(pp, v, m)
    assert sent.keys() == received.keys() and all(sent[k] == received[k] for k in sent)
    streams = []
    for rank in range(pp):
        ops = []
        for cmd in (c for step in InterleavedSchedule(m, pp, rank, v) for c in step):
            if isinstance(cmd, (schedule.SendActivation, schedule.RecvGrad)):
                ops.append(("send" if isinstance(cmd, schedule.SendActivation) else "recv", (rank + 1) % pp))
            elif isinstance(cmd, (schedule.SendGrad, schedule.RecvActivation)):
                ops.append(("send" if isinstance(cmd, schedule.SendGrad) else "recv", (rank - 1) % pp))
        streams.append(ops)
    position = [0] * pp
    while True:  # rendezvous: a send and its receive complete together
        moved = False
        for rank in range(pp):
            if position[rank] < len(streams[rank]):
                op, peer = streams[rank][position[rank]]
                if position[peer] < len(streams[peer]) and streams[peer][position[peer]] == (
                        "recv" if op == "send" else "send", rank):
                    position[rank] += 1
                    position[peer] += 1
                    moved = True
        if not moved:
            break
    assert any(position[r] < len(streams[r]) for r in range(pp)), "blocking sends would not deadlock"
    last = interleaved_order(pp, v, m)[-1]
    for i, step in enumerate(last):
        if step.kind == "B" and step.chunk == v - 1:
            assert last[i - 1] == Pass(v - 1, step.microbatch, "F"), (i, step)


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 4), (4, 8), (3, 5)])
def test_one_chunk_is_deepspeeds_1f1b(pp, m):
    """At v = 1 the order is DeepSpeed's TrainSchedule's: per stage, the same forwards and backwards
    in the same order (its micro-batches run in order, so the k-th forward and backward are micro-batch k)."""
    for passes, stream in zip(interleaved_order(pp, 1, m), instruction_streams("1f1b", pp, m)):
        kinds = ["F" if isinstance(c, schedule.ForwardPass) else "B" for c in stream
                 if isinstance(c, (schedule.ForwardPass, schedule.BackwardPass))]
        assert [p.kind for p in passes] == kinds


def test_simulation_catches_a_wrong_order():
    """The check has teeth: backwards taken in the forwards' chunk order, or a warm-up as short as
    1F1B's, deadlock (a rank waits for a gradient that needs its own later pass)."""
    pp, v, m = 4, 2, 8
    good = interleaved_order(pp, v, m)
    same_chunks = [[Pass(v - 1 - p.chunk, p.microbatch, "B") if p.kind == "B" else p for p in passes]
                   for passes in good]
    with pytest.raises(AssertionError, match="deadlocks"):
        simulate_interleaved(pp, v, m, 1.0, 1.0, order=same_chunks)
    short = []
    for rank, passes in enumerate(good):
        forwards, backwards = [p for p in passes if p.kind == "F"], [p for p in passes if p.kind == "B"]
        w = pp - rank - 1
        short.append(forwards[:w] + [x for k in range(len(forwards) - w) for x in (forwards[w + k], backwards[k])]
                     + backwards[len(forwards) - w:])
    with pytest.raises(AssertionError, match="deadlocks"):
        simulate_interleaved(pp, v, m, 1.0, 1.0, order=short)


@pytest.mark.parametrize("pp,v,m", SHAPES + [(4, 1, 8)])
def test_activations_and_traffic(pp, v, m):
    """The counts the planner uses equal the order's own: the most chunk-micro-batches each rank holds
    (p - r stages' worth under 1F1B; rank 0 holds p + (p-1)/v once the step is long enough), and each
    micro-batch crossing v p - 1 boundaries."""
    for rank, passes in enumerate(interleaved_order(pp, v, m)):
        assert peak_in_flight(passes) / v == activations_in_flight(rank, pp, v, m)
        assert peak_in_flight(passes) == min(warmup_passes(rank, pp, v, m) + 1, v * m)
    if v == 1:
        assert [activations_in_flight(r, pp, v, m) for r in range(pp)] == [min(pp - r, m) for r in range(pp)]
    elif v * m > 2 * (pp - 1) + (v - 1) * pp:
        assert activations_in_flight(0, pp, v, m) == pytest.approx(pp + (pp - 1) / v)
    crossings = sum(1 for rank, kind, chunk, mb, _, _ in simulate_interleaved(pp, v, m, 1, 1)
                    if kind == "F" and stage_of(rank, chunk, pp) < pp * v - 1)
    assert crossings == p2p_messages_per_step(pp, v, m) == m * (v * pp - 1)


@pytest.mark.parametrize("pp,v,m,words", [(4, 2, 6, "multiple of 4"), (1, 2, 4, "--pp >= 2"), (4, 0, 4, ">= 1")])
def test_refused_in_one_line(pp, v, m, words):
    with pytest.raises(ConfigError, match=words) as error:
        check_interleaving(pp, v, m)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("world_size,argv,words", [
    (2, ["--pp", "2", "--set", "train.virtual_stages=2", "--set", "train.schedule=zb-h1"],
     ["train.virtual_stages=2", "train.schedule=zb-h1", "ZB-V", "train.virtual_stages=1"]),
    (2, ["--pp", "2", "--set", "model.n_layer=8", "--set", "train.virtual_stages=2", "--set", "train.partition=[1,7]"],
     ["train.partition=[1, 7]", "at least 2 blocks", "train.partition=balanced"]),
    (2, ["--pp", "2", "--set", "model.n_layer=8", "--set", "train.virtual_stages=2", "--set", "train.compile=true"],
     ["train.virtual_stages=2 with train.compile", "train.compile=false"]),
    (4, ["--pp", "4", "--set", "train.virtual_stages=2", "--set", "train.global_batch_size=6"],
     ["3 micro-batches", "multiple of 4"]),
    (2, ["--pp", "2", "--set", "train.virtual_stages=4"], ["n_layer=4", "pp x v = 8"]),
    (1, ["--set", "train.virtual_stages=0"], ["train.virtual_stages=0", ">= 1"]),
])
def test_train_refuses_virtual_stages_at_start_up(world_size, argv, words, monkeypatch, capsys):
    """What interleaving does not run (ZB-H1, a train.partition list with an empty chunk), and what it has
    no parity test with (compiled blocks), stops the run before any process group starts: one line, exit 2 (never
    another schedule or cut under the recipe's name)."""
    from helpers.launcher import TINY
    from launch.train import main
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    assert main(["--recipe", str(TINY)] + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert all(word in err for word in words), err


def test_the_runs_prediction_plans_its_own_virtual_stages(tmp_path, monkeypatch, capsys):
    """The start-up prediction of a run at v = 2 (launch/autotune/step_prediction.py) is what
    launch/plan.py --virtual-stages 2 prints for its recipe, layout and calibration, and not v = 1's."""
    import json

    from data.builtin import BUILTIN_VOCAB_SIZE
    from helpers.launcher import TINY
    from launch.analysis.device_profile import DeviceProfile, gemm_key
    from launch.analysis.partition import with_stage_boundaries
    from launch.autotune.calibrate import cache_path, device_name
    from launch.autotune.step_prediction import predict_step_time
    from launch.config.layout import check_and_derive_layout
    from launch.config.recipe import load_recipe
    from launch.plan import main
    monkeypatch.setenv("GPT3D_CALIBRATION", str(tmp_path))
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    profile = cache_path(device_name(2), "fp32")
    DeviceProfile(device=device_name(2), source="calibrated", dtype="fp32", memory_bw=5e9, link_bw=1e9,
                  link_latency_s=1e-4, gemm={gemm_key(64, 64, 256): 1e11}).save(profile)
    predicted, planned = {}, {}
    for v in (1, 2):
        recipe = load_recipe(TINY, ["model.n_layer=8", f"train.virtual_stages={v}"])
        layout = with_stage_boundaries(check_and_derive_layout(recipe, 2, 1, 2, on_cpu=True), recipe,
                                       BUILTIN_VOCAB_SIZE)
        predicted[v] = predict_step_time(recipe, layout, BUILTIN_VOCAB_SIZE).seconds
        assert main(["--recipe", str(TINY), "--layers", "8", "--gpus", "2", "--pp", "2", "--virtual-stages", str(v),
                     "--profile", str(profile), "--json"]) == 0
        planned[v] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step_time_s"]
    assert predicted == pytest.approx(planned, rel=1e-12) and predicted[2] != pytest.approx(predicted[1]), predicted


def test_an_auto_sweep_trial_runs_its_candidates_virtual_stages():
    """--auto-sweep's trial of a candidate the planner costed at v = 2 trains at v = 2 (its command line
    as launch/train.py reads it), whatever the recipe's --set says."""
    import argparse

    from helpers.launcher import TINY
    from launch.autotune.auto_sweep import describe, trial_command
    from launch.config.cli import parse_training_args, training_recipe
    candidate = dict(tp=1, pp=2, cp=1, dp=1, ep=1, micro_batch=2, recompute="none", schedule="1f1b",
                     virtual_stages=2, step_time_s=1.0)
    args = argparse.Namespace(recipe=TINY, overrides=["model.n_layer=8", "train.virtual_stages=1"], seed=None)
    command = trial_command(args, candidate, TINY.parent / "unused.jsonl")
    assert command[1].endswith("train.py")
    assert training_recipe(parse_training_args(command[2:], "")).train.virtual_stages == 2
    assert describe(candidate).endswith("schedule 1f1b, virtual stages 2")


def test_a_checkpoint_at_another_v_or_cut_of_the_chunks_re_shards():
    """DeepSpeed's own loader restores a checkpoint only where each rank holds the same parameters: the
    same v and, at v > 1, the same chunks (launch/checkpoints/locate.py: same_layout), not only the same
    pp-stage boundaries. 8 blocks at pp = 2, balanced: v = 1 and v = 2 record the same stage boundaries;
    full recompute (free to change on resume) moves a chunk boundary of v = 2 and none of v = 1. (The
    losses of such resumes: tests/e2e/test_interleaved_resume.py.)"""
    from data.builtin import BUILTIN_VOCAB_SIZE
    from helpers.launcher import TINY
    from launch.analysis.partition import with_stage_boundaries
    from launch.checkpoints.locate import same_layout
    from launch.config.layout import check_and_derive_layout
    from launch.config.recipe import load_recipe

    def layout(v: int, recompute: str) -> dict:
        recipe = load_recipe(TINY, ["model.n_layer=8", f"train.virtual_stages={v}", f"train.recompute={recompute}"])
        return vars(with_stage_boundaries(check_and_derive_layout(recipe, 2, 1, 2, on_cpu=True), recipe,
                                          BUILTIN_VOCAB_SIZE))
    one, two, two_full = layout(1, "none"), layout(2, "none"), layout(2, "full")
    assert one["parts"] == two["parts"] == two_full["parts"] and same_layout(one, layout(1, "full"))
    assert not same_layout(one, two) and not same_layout(two, one)
    assert len(two["chunk_parts"]) == 5 and two_full["chunk_parts"] != two["chunk_parts"]
    assert not same_layout(two_full, two)
    assert same_layout(dict(two, chunk_parts=list(two["chunk_parts"])), two)  # as complete.json reads back


# ---------------------------------------------------------------- real engines, v = 1 against v = 2

EOS = 7  # the documents' first token under data.document_mask (any id of the 4096: the tokens are random)


def _train_at(virtual_stages: int, tp: int, pp: int, overrides: list, steps: int, recipe_name: str = "tiny.yaml"):
    """(losses, grad norms, every parameter of the model after `steps` steps, gathered by name) of a
    tiny run of recipes/`recipe_name` on this process group, with `virtual_stages` chunks per rank.
    Under data.document_mask its tokens hold documents (EOS at about 1 token in 5), so that the mask is not
    the causal one."""
    import torch
    import torch.distributed as dist

    from helpers.launcher import TINY
    from launch.analysis.partition import with_stage_boundaries
    from launch.config.layout import check_and_derive_layout
    from launch.config.recipe import load_recipe
    from launch.engine.engine import build_engine
    from launch.engine.experts import set_router_loss_scale
    from launch.optim.grad_norm import last_grad_norm
    from model.parallel.state import init_parallel_state
    from model.transformer.moe_losses import stage_statistics

    sets = ["model.n_layer=8", "train.eval_every=0", f"train.virtual_stages={virtual_stages}"]
    recipe = load_recipe(TINY.parent / recipe_name, sets + overrides)
    # The stage boundaries as the trainer sets them (launch/trainer/startup.py): the engine reads the chunks' cut there
    layout = with_stage_boundaries(check_and_derive_layout(recipe, dist.get_world_size(), tp, pp, True), recipe, 4096)
    state = init_parallel_state(tp, pp, layout.cp, layout.ep, experts=recipe.model.moe.enabled)  # as the trainer's
    config = recipe.gpt_config(4096, eos_token_id=EOS)
    engine, own_norm = build_engine(recipe, layout, state, config)
    generator = torch.Generator().manual_seed(dist.get_rank() // (tp * pp))
    shape = (steps * layout.grad_accum_steps, layout.micro_batch_size, config.seq_len + 1)
    tokens = torch.randint(0, 4096, shape, generator=generator)
    if recipe.data.document_mask:
        tokens[torch.rand(shape, generator=generator) < 0.2] = EOS
        assert (tokens[..., :-1] == EOS).sum(-1).float().mean() > 4  # documents a sequence: no causal mask
    losses, norms = [], []
    for step in range(steps):
        chunk = tokens[step * layout.grad_accum_steps:(step + 1) * layout.grad_accum_steps]
        set_router_loss_scale(engine, layout)  # the router losses' backward scaled as the run's (no-op without experts)
        losses.append(engine.train_batch(iter([(t[:, :-1], t[:, 1:]) for t in chunk])).item())
        norms.append(float(last_grad_norm(engine, own_norm)))
    # Evaluation through the same engine: a step's batch again, and 3 micro-batches (not a multiple of pp).
    losses.append(engine.eval_batch(iter([(t[:, :-1], t[:, 1:]) for t in chunk])).item())
    losses.append(engine.eval_batch(iter([(t[:, :-1], t[:, 1:]) for t in chunk[:3]]), num_micro_batches=3).item())
    mine = {(name, state.tp_rank): param.detach().clone() for name, param in engine.module.named_parameters()}
    statistics = stage_statistics(engine.module)
    if statistics is not None:  # every block's router records (losses, assignments) summed over the steps and ranks
        records = statistics.take()
        dist.all_reduce(records)
        mine[("router records", None)] = records
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    params = {key: value for part in every for key, value in part.items()}
    return losses, norms, params, engine


@uses_deepspeed
def _interleaved_matches_1f1b(tp: int, pp: int, overrides: list, steps: int, recipe_name: str = "tiny.yaml"):
    from launch.engine.interleaved import InterleavedSchedule
    if "train.precision=fp16" in overrides:  # a loss scale that overflows: two steps skip, the third trains
        from launch.engine import ds_config
        built = ds_config.deepspeed_config

        def overflowing(*args, **kwargs):
            config = built(*args, **kwargs)
            config["fp16"]["initial_scale_power"] = 20
            return config
        ds_config.deepspeed_config, steps = overflowing, 3
    losses, norms, params, one = _train_at(1, tp, pp, overrides, steps, recipe_name)
    v_losses, v_norms, v_params, engine = _train_at(2, tp, pp, overrides, steps, recipe_name)
    assert isinstance(engine._train_schedule(), InterleavedSchedule)
    if "train.optimizer=muon" in overrides:  # Muon's step, not AdamW's, under the recipe's name
        assert any(group.get("muon") for group in engine.optimizer.param_groups)
    if "train.precision=fp16" in overrides:  # the same steps skipped on overflow, the same loss scale after
        assert engine.fp16_enabled() and engine.skipped_steps == one.skipped_steps == 2, (engine.skipped_steps,
                                                                                       one.skipped_steps)
        assert engine.optimizer.cur_scale == one.optimizer.cur_scale, (engine.optimizer.cur_scale,
                                                                      one.optimizer.cur_scale)
    module = engine.module
    assert len(module.chunk_ranges) == 2  # two chunks on every rank, not one range
    if "train.partition=[5,3]" in overrides:  # blocks per rank at any v: rank 0 holds 5, rank 1 3, split over
        from model.transformer.block import Block  # its chunks, the earlier ones taking the remainder
        chunks = [sum(isinstance(f, Block) for f in module.forward_funcs[a:b]) for a, b in module.chunk_ranges]
        assert chunks == [[3, 2], [2, 1]][module.stage_id], (module.stage_id, chunks)
        assert sum(isinstance(f, Block) for f in one.module.forward_funcs) == [5, 3][module.stage_id]
    # Layer files are named by the layer's index in the table, as DeepSpeed names the module itself.
    for local, layer in enumerate(module.forward_funcs):
        name = next((n for n, m in module.named_children() if m is layer), None)
        if name is not None:
            assert module.ckpt_layer_path("ck", local).startswith(f"ck/layer_{int(name):02d}"), (local, name)
    # The same sums in the same order (each micro-batch's passes are the same, and each weight gets
    # its micro-batches' gradients in order): the losses came out equal to the bit. The gradient
    # norm sums each rank's squares over other parameters, so its last bit, and through clipping
    # the weights' last bits, may differ.
    # In bf16 a weight whose fp32 master differs in its last bit can round to the next bf16 value
    # (7.8e-3 apart at 1), and the next losses move by as much as that moves them: as between layouts.
    bf16 = "train.precision=bf16" in overrides
    assert v_losses == pytest.approx(losses, rel=1e-5 if bf16 else 1e-6, abs=0), (v_losses, losses)
    assert v_norms == pytest.approx(norms, rel=1e-4 if bf16 else 1e-6), (v_norms, norms)
    assert v_params.keys() == params.keys()
    worst = max(float((v_params[k] - params[k]).abs().max()) for k in params)
    assert worst <= (8e-3 if bf16 else 1e-5), worst


# The experts' recipe (qwen3_moe: RoPE, GQA, routed and shared experts, router losses) with the document
# mask and Muon: one run for what interleaving carries per micro-batch (segment ids across chunks, the
# router losses' backward in each chunk) and the optimizer over both chunks' matrices, experts' included.
MOE_DOCUMENTS_MUON = ["data.document_mask=true", "train.optimizer=muon", "train.partition=[5,3]"]


@pytest.mark.parametrize("tp,pp,dp,overrides", [
    (1, 2, 1, ["train.recompute=full"]),
    pytest.param(1, 2, 2, ["recipe=moe-tiny.yaml", "train.ep=2"] + MOE_DOCUMENTS_MUON, marks=pytest.mark.slow),
    pytest.param(1, 4, 1, [], marks=pytest.mark.slow),
    pytest.param(2, 2, 1, ["model.sequence_parallel=true", "train.recompute=selective"], marks=pytest.mark.slow),
    pytest.param(1, 2, 2, ["train.cp=2", "model.arch=llama", "model.n_kv_head=2"], marks=pytest.mark.slow),
    # tp 2 without SP: DeepSpeed partitions each stage's output over TP, reading is_first/last_stage.
    pytest.param(2, 2, 1, ["train.precision=bf16"], marks=pytest.mark.slow),
    # fp16: DeepSpeed's loss-scaled optimizer over both chunks of a rank, its overflow check over the pipeline.
    pytest.param(1, 2, 1, ["train.precision=fp16"], marks=pytest.mark.slow),
], ids=["1-2-1-full-recompute", "1-2-2-ep2-documents-muon", "1-4-1", "2-2-1-sp-selective",
        "1-2-1-cp2-llama", "2-2-1-bf16", "1-2-1-fp16"])
def test_interleaved_trains_the_same_model_as_1f1b(tp, pp, dp, overrides):
    """v = 2 against v = 1 on the same processes: the same training losses, gradient norms and weights
    after two steps (AdamW, or Muon), the same router records with experts, and the same validation
    losses (one with 3 micro-batches, not a multiple of pp), within fp32 rounding."""
    recipe = [o.split("=", 1)[1] for o in overrides if o.startswith("recipe=")] or ["tiny.yaml"]
    overrides = [o for o in overrides if not o.startswith("recipe=")]
    run_distributed(_interleaved_matches_1f1b, tp * pp * dp, tp, pp, overrides, 2, recipe[0])
