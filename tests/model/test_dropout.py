"""Dropout masks per rank (model/gpt/pipe.py: seed_dropout_rngs), read from the masks themselves.

On CPU every dropout mask is drawn by one `aten.bernoulli_` (nn.Dropout, and the attention
probabilities inside scaled_dot_product_attention's math path); a dispatch mode records each
one with the module that drew it. One forward of the pipeline stages on 4 processes:
- tp=2 pp=2: the attention masks of blocks 0 and 2 (same shape, stages 0 and 1) differ, and
  those of the two TP ranks of one block (each its own heads) differ; the embedding and
  residual masks agree across the TP ranks of a stage (they hold the same activations);
- the same with sequence parallelism: every mask differs across TP ranks (own sequence chunks);
- tp=1 pp=2 dp=2: the DP ranks of a stage (different samples) draw different masks;
- streams restarted as a re-sharded resume restarts them draw new masks, still TP-consistent.
The second test: a pp=2 run with dropout resumes bit for bit (both streams of each rank come
back from the checkpoint), which the parity runs at dropout 0 cannot show.
"""
import dataclasses
from collections import defaultdict

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from helpers.parity_runs import REFERENCE
from helpers.distributed import run_distributed, uses_deepspeed
from helpers.launcher import TINY, launch_forked, read_metrics
from model.config import GPTConfig
from model.gpt.pipe import build_pipeline, seed_dropout_rngs
from model.parallel.state import init_parallel_state

P = 0.5
CONFIG = GPTConfig(n_layer=4, n_head=4, n_embd=32, seq_len=16, vocab_size=101, vocab_pad_multiple=4, seed=5,
                   dropout=P)
MICRO = 2


class MaskRecorder(TorchDispatchMode):
    """masks[name of the innermost module running] = the 0/1 tensors its `bernoulli_` drew."""

    def __init__(self, pipe: nn.Module):
        super().__init__()
        self.masks, self.running = defaultdict(list), []
        for name, module in pipe.named_modules():
            module.register_forward_pre_hook(lambda m, args, name=name: self._enter(name))
            module.register_forward_hook(lambda m, args, out: self._leave())

    def _enter(self, name: str) -> None:
        self.running.append(name)

    def _leave(self) -> None:  # a forward hook returning a value would replace the output
        self.running.pop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.bernoulli_.float:
            self.masks[self.running[-1]].append(out.detach().clone().bool())
        return out


def _stage_masks(tp: int, pp: int, sequence_parallel: bool, restart=()):
    """This rank's masks after one training-mode forward of its stage, and its coordinate;
    `restart`: the streams re-seeded as a re-sharded resume does (launch/checkpoints/store.py: load)."""
    state = init_parallel_state(tp, pp)
    config = dataclasses.replace(CONFIG, sequence_parallel=sequence_parallel)
    pipe = build_pipeline(config, state)
    if restart:
        seed_dropout_rngs(config.seed, state, *restart)
    pipe.train()
    g = torch.Generator().manual_seed(3)  # same input on every rank: masks must not depend on it
    if state.pp_rank == 0:
        x = torch.randint(0, config.vocab_size, (MICRO, config.seq_len), generator=g)
    else:
        x = torch.randn(MICRO, config.seq_len // (tp if sequence_parallel else 1), config.n_embd, generator=g)
    recorder = MaskRecorder(pipe)
    with recorder:
        pipe(x)
    masks = {name: torch.stack(drawn) for name, drawn in recorder.masks.items()}
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, ((state.pp_rank, state.dp_rank, state.tp_rank), masks))
    return dict(everything)


def _agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a == b).float().mean().item()


def _assert_independent(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    # Two independent masks of p = 0.5 agree on about half their elements; a shared stream on all.
    assert _agreement(a, b) < 0.75, (what, _agreement(a, b))


# Pipeline layer i + 2 is block i (model/gpt/pipe.py: layer_specs); layer 1 adds wpe and drops out.
EMBED, ATTN = "1.drop", "{}.attn"
RESIDUAL = ("{}.attn.resid_dropout", "{}.mlp.dropout")


@uses_deepspeed
def _masks_body():
    # tp=2 pp=2 dp=1, activations replicated over TP between the TP linears.
    m = _stage_masks(2, 2, sequence_parallel=False)
    for coord, masks in m.items():  # each is a real dropout mask of rate P
        for name, mask in masks.items():
            assert 0.35 < 1 - mask.float().mean().item() < 0.65, (coord, name)
    assert set(m[(0, 0, 0)]) == {EMBED} | {k.format(i) for i in (2, 3) for k in (ATTN,) + RESIDUAL}
    for tp_rank in (0, 1):
        for first, second in ((2, 4), (3, 5)):  # blocks 0 and 2, 1 and 3: one per stage
            for kind in (ATTN,) + RESIDUAL:
                _assert_independent(m[(0, 0, tp_rank)][kind.format(first)], m[(1, 0, tp_rank)][kind.format(second)],
                                    f"stages, {kind.format(first)}")
    for stage, layers in ((0, (2, 3)), (1, (4, 5))):
        for layer in layers:
            _assert_independent(m[(stage, 0, 0)][ATTN.format(layer)], m[(stage, 0, 1)][ATTN.format(layer)],
                                f"TP ranks, attention of layer {layer}")
            for kind in RESIDUAL:  # replicated activations: the same mask on both TP ranks
                assert torch.equal(m[(stage, 0, 0)][kind.format(layer)], m[(stage, 0, 1)][kind.format(layer)])
    assert torch.equal(m[(0, 0, 0)][EMBED], m[(0, 0, 1)][EMBED])

    # A resume at another layout restarts the streams: new masks, not step 1's again, and the
    # TP ranks of a stage still agree where they hold the same activations.
    again = _stage_masks(2, 2, sequence_parallel=False, restart=("resumed", 3))
    for coord, masks in again.items():
        for name, mask in masks.items():
            _assert_independent(mask, m[coord][name], f"restarted stream, {coord} {name}")
    for stage, layers in ((0, (2, 3)), (1, (4, 5))):
        for kind in RESIDUAL:
            for layer in layers:
                assert torch.equal(again[(stage, 0, 0)][kind.format(layer)], again[(stage, 0, 1)][kind.format(layer)])

    # Sequence parallelism: each TP rank holds its own chunk, so every mask differs across TP.
    m = _stage_masks(2, 2, sequence_parallel=True)
    for stage, layers in ((0, (2, 3)), (1, (4, 5))):
        for name in [EMBED] * (stage == 0) + [k.format(layer) for layer in layers for k in (ATTN,) + RESIDUAL]:
            _assert_independent(m[(stage, 0, 0)][name], m[(stage, 0, 1)][name], f"SP TP ranks, {name}")

    # tp=1 pp=2 dp=2: the replicas of a stage hold different samples.
    m = _stage_masks(1, 2, sequence_parallel=False)
    for stage in (0, 1):
        for name in m[(stage, 0, 0)]:
            _assert_independent(m[(stage, 0, 0)][name], m[(stage, 1, 0)][name], f"DP ranks, {name}")


def test_dropout_masks_differ_where_activations_differ():
    run_distributed(_masks_body, 4)


@pytest.mark.slow
def test_resume_with_dropout_is_bitwise(parity_runs, tmp_path):
    """Both dropout streams of every rank come back from the checkpoint: steps 3-4 of the resumed
    run equal the uninterrupted run's bit for bit."""
    common = ["--recipe", str(TINY), "--pp", "2", "--steps", "4", "--set", "model.dropout=0.1"]
    full, resumed = tmp_path / "full.jsonl", tmp_path / "resumed.jsonl"
    proc = launch_forked(2, common + ["--save", str(tmp_path / "ck"), "--save-every", "2", "--metrics-out", str(full)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    proc = launch_forked(2, common + ["--load", str(tmp_path / "ck" / "step00000002"), "--metrics-out", str(resumed)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    full_metrics, again = read_metrics(full), read_metrics(resumed)
    assert [m["step"] for m in again] == [3, 4]
    for x, y in zip(full_metrics[2:], again):
        assert (x["loss"], x["grad_norm"], x.get("val_loss")) == (y["loss"], y["grad_norm"], y.get("val_loss")), (x, y)
    # Dropout reached the model: step 1 (same weights and batch) differs from the reference at
    # dropout 0, so the bitwise equality above covered the RNG states.
    assert full_metrics[0]["loss"] != parity_runs[REFERENCE]["metrics"][0]["loss"]
