"""The learning-rate schedule (launch/optim/lr_schedule.py) against the formula written out here:
step s (1-based) of N with W warm-up steps uses peak * s / W while s <= W, then the cosine from
peak down to peak * min_lr_ratio over the steps after the warm-up, (1 + cos(pi * (s - W - 1) / (N - W))) / 2
of the way; the cosine would reach min_lr_ratio at step N + 1. Checked on the schedule function and
on the lr DeepSpeed's engine hands its optimizer at every step of a one-process run."""
import math

import pytest
import torch

from helpers.distributed import run_distributed, uses_deepspeed
from launch.optim.lr_schedule import lr_ratio, warmup_cosine
from helpers.launcher import TINY

PEAK, MIN_RATIO = 3e-3, 0.1


def expected_lr(step: int, warmup: int, steps: int, peak: float = PEAK, min_ratio: float = MIN_RATIO) -> float:
    """The lr of 1-based `step`, from the definition in the module docstring."""
    if step <= warmup:
        return peak * step / warmup
    floor = peak * min_ratio
    return floor + (peak - floor) * (1 + math.cos(math.pi * (step - warmup - 1) / (steps - warmup))) / 2


@pytest.mark.parametrize("warmup,steps", [(5, 21), (1, 5), (0, 4), (10, 10)])
def test_schedule_is_the_formula(warmup, steps):
    got = [PEAK * lr_ratio(step - 1, warmup, steps, MIN_RATIO) for step in range(1, steps + 1)]
    assert got == pytest.approx([expected_lr(step, warmup, steps) for step in range(1, steps + 1)], rel=1e-12)


def test_schedule_landmarks():
    """Step 1 is already peak / W (not 0, as DeepSpeed's WarmupCosineLR), step W the peak, the middle
    of the cosine halfway between peak and floor, and no step below the floor."""
    warmup, steps = 5, 21
    lr = {step: PEAK * lr_ratio(step - 1, warmup, steps, MIN_RATIO) for step in range(1, steps + 2)}
    assert lr[1] == pytest.approx(PEAK / 5, rel=1e-12)
    assert lr[warmup] == lr[warmup + 1] == pytest.approx(PEAK, rel=1e-12)
    assert lr[14] == pytest.approx((PEAK + PEAK * MIN_RATIO) / 2, rel=1e-12)  # (14 - 6) / 16 = 1/2
    assert lr[steps] > PEAK * MIN_RATIO and lr[steps + 1] == pytest.approx(PEAK * MIN_RATIO, rel=1e-12)
    assert all(a >= b for a, b in zip(list(lr.values())[warmup:], list(lr.values())[warmup + 1:]))


def test_factory_steps_a_torch_scheduler_through_the_formula():
    """What deepspeed.initialize is given: a factory of a torch scheduler over the optimizer's groups."""
    warmup, steps = 3, 9
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))]
    optimizer = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0}], lr=PEAK)
    scheduler = warmup_cosine(warmup, steps, MIN_RATIO)(optimizer)
    for step in range(1, steps + 1):
        assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([expected_lr(step, warmup, steps)] * 2, rel=1e-12)
        optimizer.step()
        scheduler.step()


WARMUP, STEPS = 3, 8


@uses_deepspeed
def _engine_lrs_follow_the_formula():
    """tiny.yaml in one process: the lr each AdamW step of DeepSpeed's engine reads from its
    parameter groups (both: decayed and not), and the lr the training loop logs before the step."""
    from launch.config.layout import check_and_derive_layout
    from launch.config.recipe import load_recipe
    from launch.engine.engine import build_engine
    from model.parallel.state import init_parallel_state

    recipe = load_recipe(TINY, [f"train.steps={STEPS}", f"train.warmup_steps={WARMUP}", f"train.lr={PEAK}",
                                f"train.min_lr_ratio={MIN_RATIO}", "train.global_batch_size=2",
                                "model.n_layer=1", "model.seq_len=8"])
    layout = check_and_derive_layout(recipe, 1, 1, 1, True)
    config = recipe.gpt_config(64)
    engine, _ = build_engine(recipe, layout, init_parallel_state(1, 1), config)
    calls = []  # ZeRO-1 steps AdamW once per parameter group, with that group alone
    engine.basic_optimizer.register_step_pre_hook(
        lambda optimizer, args, kwargs: calls.extend(g["lr"] for g in optimizer.param_groups))
    tokens = torch.randint(0, 64, (STEPS, 2, config.seq_len + 1), generator=torch.Generator().manual_seed(0))
    seen, logged = [], []
    for batch in tokens:
        logged.append(engine.get_lr()[0])  # what launch/trainer/loop.py logs as this step's lr
        engine.train_batch(iter([(batch[:, :-1], batch[:, 1:])]))
        seen.append(calls[:])
        calls.clear()
    expected = [expected_lr(step, WARMUP, STEPS) for step in range(1, STEPS + 1)]
    assert len(seen) == STEPS and all(len(lrs) == 2 for lrs in seen), seen
    for step, (lrs, log, want) in enumerate(zip(seen, logged, expected), 1):
        assert lrs == pytest.approx([want, want], rel=1e-12) and log == pytest.approx(want, rel=1e-12), (step, lrs, log)


def test_deepspeed_engine_steps_with_the_formulas_lr():
    run_distributed(_engine_lrs_follow_the_formula, 1)
