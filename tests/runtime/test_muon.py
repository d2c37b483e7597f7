"""Muon (launch/optim/muon.py), in process.

- Newton-Schulz (launch/optim/newton_schulz.py) against an SVD: the result is U p(S) V^T with
  p Keller Jordan's quintic applied 5 times, to fp32 rounding, and its singular values lie in the
  documented [0.68, 1.14] on random matrices (whose singular values are >= 3e-3 of the norm).
- The sharded update equals the one-device update: on four gloo ranks (tp 2 x dp 2), matrices laid
  out as the model lays them (fused [Q; K; V] of GPT-2 by stride and of Llama with grouped-query
  sections, a row-parallel projection, stacks of experts' fused gate-up and down), sharded with the
  model's own `split_rows`, two Muon steps, both as fp32 ZeRO-0 hands them (the TP shards) and as
  DeepSpeed's ZeRO-1 / BF16 optimizers do (a dp partition of a flat buffer, with gaps between the
  parameters, a matrix straddling the two pieces), against Moonlight's update written here from the
  paper, per logical matrix, on the whole matrices; and each logical matrix is orthogonalised by
  one rank of its TP group (ZeRO-0) or of its TP x DP ranks (ZeRO-1's owner ranks, then a finisher
  among the owner's TP peers), the ranks sharing the work. Then the same with Keller Jordan's lr rule
  and Newton-Schulz in bf16, against our own one-device update with them (as a (1,1,1) run computes
  it): equal bit for bit (measured); with fp32 Newton-Schulz on the finishers instead, up to 1.2e-3
  off (at least 5e-4 per matrix), and with the rule on a shard's shape, 4.8e-3 (o_proj) and 1.2e-2
  (the experts' down_proj). bf16 is checked here, not launched: there a layout's fp32 rounding
  flips some bf16 roundings of Newton-Schulz's input, which leaves the bf16 runs as far apart as
  bf16 from fp32 (tests/e2e/test_muon_parity.py). The launched runs at every layout:
  tests/e2e/test_muon_parity.py (slow).
- The recipe snippets of docs/design.md (Moonlight's and Keller Jordan's settings) load and validate.
"""
import math
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from helpers.distributed import run_distributed
from helpers.plain_muon import PlainMuon
from launch.optim.newton_schulz import NS_COEFFICIENTS, orthogonalise

TP, DP = 2, 2
LR, WEIGHT_DECAY, MOMENTUM = 0.02, 0.1, 0.95
# name: (full shape, partition dim, full sizes of the logical parts along it); experts stack on dim 0
MATRICES = {
    "c_attn": ((48, 16), 0, (16, 16, 16)),  # GPT-2's [Q; K; V], stride 3
    "qkv_proj": ((24, 16), 0, (16, 4, 4)),  # Llama's [Q; K; V] with 4 query and 1 key/value heads of 4
    "o_proj": ((12, 16), 1, (16,)),  # row-parallel: columns split
    "experts.gate_up_proj": ((2, 20, 12), 1, (10, 10)),  # (E, [G; U], h)
    "experts.down_proj": ((2, 12, 10), 2, (10,)),  # (E, h, f)
}
GAP = 2  # elements between parameters in the flat buffer, as ZeRO-1's alignment padding leaves
# Muon's options, each against our own one-device update with them (what a (1,1,1) run computes):
# Keller Jordan's lr rule must take the whole matrix's shape (a shard's scales the row-parallel o_proj's
# update by sqrt(12 / 8) at tp 2), and Newton-Schulz in bf16 must stay bf16 on the finishers.
OPTIONS = dict(lr_rule="keller", ns_dtype="bf16")


def test_newton_schulz_is_an_odd_polynomial_of_the_singular_values():
    torch.manual_seed(0)
    a, b, c = NS_COEFFICIENTS
    for shape in [(32, 64), (96, 48), (3, 40, 24)]:
        g = torch.randn(*shape)
        u, s, vh = torch.linalg.svd(g.double(), full_matrices=False)
        x = orthogonalise(g).double()
        assert x.shape == g.shape
        d = u.mT @ x @ vh.mT  # U^T X V: diagonal if X = U p(S) V^T
        diagonal = torch.diagonal(d, dim1=-2, dim2=-1)
        assert (d - torch.diag_embed(diagonal)).abs().max() < 1e-5
        p = s / torch.linalg.matrix_norm(g.double()).unsqueeze(-1)
        assert p.min() > 3e-3
        for _ in range(5):
            p = a * p + b * p ** 3 + c * p ** 5
        assert (diagonal - p).abs().max() < 1e-5
        assert 0.68 <= diagonal.min() and diagonal.max() <= 1.14, (diagonal.min(), diagonal.max())
        polar = u @ vh  # the exact orthogonalisation; NS is within the documented spread of it
        assert torch.linalg.matrix_norm(x - polar).max() / math.sqrt(min(shape[-2:])) < 0.32


def _moonlight_steps(weight: torch.Tensor, grads, dim: int, parts) -> torch.Tensor:
    """Moonlight's Algorithm 1 on each logical matrix of a whole weight (tests/helpers/plain_muon.py)."""
    weight, muon = weight.clone(), PlainMuon(MOMENTUM)
    for grad in grads:
        muon.step(weight, grad, LR, WEIGHT_DECAY, dim, parts)
    return weight


def _shard(full: torch.Tensor, dim: int, parts, tp_rank: int) -> torch.Tensor:
    """This TP rank's shard, as the model's layers cut it (model/parallel/layers.py: split_rows)."""
    from model.parallel.layers import split_rows
    return split_rows(full.movedim(dim, 0), tp_rank, TP, sections=parts).movedim(0, dim).contiguous()


def _sharded_update_is_the_dense_update():
    from launch.optim.muon import Muon
    rank = dist.get_rank()
    tp_groups = [dist.new_group(r) for r in ([0, 1], [2, 3])]
    dp_groups = [dist.new_group(r) for r in ([0, 2], [1, 3])]
    tp_group, dp_group = tp_groups[rank // TP], dp_groups[rank % TP]
    tp_rank, dp_rank = rank % TP, rank // TP
    generator = torch.Generator().manual_seed(7)
    full = {name: torch.randn(*shape, generator=generator) for name, (shape, _, _) in MATRICES.items()}
    grads = [{name: torch.randn(*shape, generator=generator) for name, (shape, _, _) in MATRICES.items()}
             for _ in range(2)]
    expected = {name: _shard(_moonlight_steps(full[name], [g[name] for g in grads], dim, parts), dim, parts, tp_rank)
                for name, (_, dim, parts) in MATRICES.items()}

    def shards():
        params = []
        for name, (_, dim, parts) in MATRICES.items():
            p = torch.nn.Parameter(_shard(full[name], dim, parts, tp_rank))
            p.partition_dim, p.partition_stride = dim, 1
            if name == "c_attn":  # GPT-2's layer marks equal blocks by stride (model/parallel/layers.py)
                p.partition_stride = len(parts)
            else:
                p.partition_sections = parts
            params.append(p)
        return params

    def muon(params, group=tp_group, **options):
        return Muon([{"params": params, "muon": True}], lr=LR, weight_decay=WEIGHT_DECAY, betas=(0.9, 0.95),
                    eps=1e-8, momentum=MOMENTUM, tp_group=group, **options)

    every_part = sorted(shape[:dim] + (part,) + shape[dim + 1:]  # the logical matrices, whole, once a step
                        for shape, dim, parts in MATRICES.values() for part in parts for _ in grads)

    def each_once(orthogonalised, group, ranks, busy):
        """Every logical matrix orthogonalised whole exactly once in `group`, `busy` of its ranks doing some."""
        by_rank = [None] * ranks
        dist.all_gather_object(by_rank, sorted(orthogonalised), group=group)
        assert sorted(shape for done in by_rank for shape in done) == every_part, by_rank
        assert sum(map(bool, by_rank)) >= busy, by_rank

    def recording(orthogonalised):  # counts the (rows, cols) of every Newton-Schulz this rank runs
        return mock.patch("launch.optim.muon.orthogonalise", side_effect=lambda x, steps, **kw: (
            orthogonalised.append(tuple(x.shape)), orthogonalise(x, steps, **kw))[1])

    for options in ({}, OPTIONS):
        if options:  # the one-device update with the same options: ours on the whole weights, as (1,1,1) runs it
            tp_shards = shards()
            whole = [torch.nn.Parameter(full[name].clone()) for name in MATRICES]
            for p, marked in zip(whole, tp_shards):
                p.partition_dim, p.partition_stride = marked.partition_dim, marked.partition_stride
                if hasattr(marked, "partition_sections"):
                    p.partition_sections = marked.partition_sections
            one_device = muon(whole, group=None, **options)
            for g in grads:
                for p, name in zip(whole, MATRICES):
                    p.grad = g[name]
                one_device.step()
            expected = {name: _shard(p.detach(), dim, parts, tp_rank)
                        for p, (name, (_, dim, parts)) in zip(whole, MATRICES.items())}
        _check_layouts(options, expected, shards, muon, grads, tp_rank, dp_rank, dp_group, tp_group, each_once,
                       recording)


def _check_layouts(options, expected, shards, muon, grads, tp_rank, dp_rank, dp_group, tp_group, each_once, recording):
    """Two steps of Muon (with `options`) at tp 2 x dp 2 as ZeRO-0 and as ZeRO-1 hand it its
    parameters, against `expected` (this rank's shard of each matrix after them)."""
    from launch.optim.muon import FlatPartition
    # fp32 ZeRO-0: the optimizer holds the TP shards themselves; the TP peers split the matrices
    params = shards()
    optimizer = muon(params, **options)
    orthogonalised = []
    with recording(orthogonalised):
        for g in grads:
            for p, name in zip(params, MATRICES):
                p.grad = _shard(g[name], MATRICES[name][1], MATRICES[name][2], tp_rank)
            optimizer.step()
    for p, name in zip(params, MATRICES):
        torch.testing.assert_close(p.detach(), expected[name], rtol=1e-5, atol=1e-6, msg=f"ZeRO-0 {name} {options}")
    each_once(orthogonalised, tp_group, TP, busy=TP)

    # ZeRO-1 / BF16: this dp rank's piece of the shards laid end to end with gaps, padded to dp pieces
    params = shards()
    offsets = [sum(p.numel() + GAP for p in params[:i]) for i in range(len(params))]
    numel = offsets[-1] + params[-1].numel()
    numel += -numel % DP
    size = numel // DP

    def flat(tensors):
        buffer = torch.zeros(numel)
        for tensor, offset in zip(tensors, offsets):
            buffer[offset:offset + tensor.numel()] = tensor.reshape(-1)
        return buffer

    piece = torch.nn.Parameter(flat([p.detach() for p in params])[dp_rank * size:(dp_rank + 1) * size].clone())
    assert any(offset < size < offset + p.numel() for p, offset in zip(params, offsets))  # a matrix straddles the pieces
    optimizer = muon(params, **options)
    optimizer.param_groups[0]["params"] = [piece]  # what DeepSpeed's wrappers do
    optimizer.bind(piece, FlatPartition(params=params, offsets=offsets, dp_group=dp_group, dp_size=DP, dp_rank=dp_rank))
    orthogonalised = []
    with recording(orthogonalised):
        for g in grads:
            piece.grad = flat([_shard(g[name], dim, parts, tp_rank) for name, (_, dim, parts) in MATRICES.items()]
                              )[dp_rank * size:(dp_rank + 1) * size]
            optimizer.step()
    torch.testing.assert_close(piece.detach(), flat([expected[name] for name in MATRICES])[dp_rank * size:(dp_rank + 1) * size],
                               rtol=1e-5, atol=1e-6, msg=f"ZeRO-1 flat partition {options}")
    # Owner ranks over dp, then finishers over tp: once in the world. A parameter is the unit, so
    # the owner of c_attn alone (3 of the 11 parts, the costliest) leaves one of its TP peers idle.
    each_once(orthogonalised, None, TP * DP, busy=TP * DP - 1)


def test_sharded_and_partitioned_update_is_the_dense_update():
    run_distributed(_sharded_update_is_the_dense_update, TP * DP)


def test_a_checkpoint_resumes_only_with_its_optimizer(tmp_path):
    """Muon's state is a momentum per Muon matrix, AdamW's two moments: a checkpoint of one optimizer
    resumed with the other is one line that names both (launch/checkpoints/locate.py)."""
    from helpers.manifest import complete_json
    from launch.checkpoints.locate import CheckpointRef, check_compatible
    from launch.config.recipe import Recipe
    from launch.errors import ConfigError
    layout = {"tp": 1, "pp": 1, "dp": 1, "cp": 1, "ep": 1, "virtual_stages": 1, "parts": [], "chunk_parts": []}
    ref = CheckpointRef(tmp_path, "step00000005", complete_json(Recipe().to_dict(), layout))  # AdamW's
    now = Recipe()
    check_compatible(ref, now.to_dict(), layout)
    now.train.optimizer = "muon"
    with pytest.raises(ConfigError, match="train.optimizer=adamw, this run muon.*--set train.optimizer=adamw"):
        check_compatible(ref, now.to_dict(), layout)


def _llama(seed: int):
    """A tiny transformers Llama: separate nn.Linear q, k, v (grouped-query), o, gate, up, down
    ((out, in), non-square) as torch.optim.Muon takes them, an untied head."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=80, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))


def _hidden(model):
    """(Muon's matrices, the others): the blocks' 2-D weights, and the embeddings, head and norms."""
    matrices = [p for name, p in model.named_parameters() if ".layers." in name and p.dim() == 2]
    return matrices, [p for p in model.parameters() if all(p is not m for m in matrices)]


TORCH_STEPS, WARMUP = 6, 2
MOVED_RTOL, MOMENTUM_RTOL = 5e-3, 2e-3  # measured 6.3e-4, 2.2e-4 (keller)


@pytest.mark.parametrize("rule,adjust_lr_fn", [("moonlight", "match_rms_adamw"), ("keller", "original")])
def test_muon_trains_as_torch_muon_with_its_own_adamw(rule, adjust_lr_fn):
    """Ours (built from a recipe by muon_factory, on the warmup-cosine schedule) against torch.optim.Muon
    (torch/optim/_muon.py) for the blocks' matrices and torch.optim.AdamW for the rest, with its own lr,
    betas and weight decay, both groups scheduled by the same LambdaLR ratio: from the same weights on
    the same batches, the losses agree within 1e-5 at every step and after the last. torch runs
    Newton-Schulz in bf16 on every device; here its one cast (`grad.bfloat16()`) gives an fp32 copy,
    against ours at train.muon_ns_dtype=fp32. The two Newton-Schulz group the same polynomial apart
    (fp32 rounding, 1e-6 of the result on random matrices), which the iteration amplifies on the small
    singular values of a gradient (up to 3.4445^5): the weights agree within 5e-3 of how far they
    moved, torch's `momentum_buffer` within 2e-3 of its largest element (a sum of gradients, 1/(1 - mu)
    = 20x the average, is far outside); with torch's Newton-Schulz put in ours, all bit for bit."""
    from launch.config.recipe import TrainSection
    from launch.optim.lr_schedule import lr_ratio, warmup_cosine
    from launch.optim.muon import MOMENTUM_KEY, muon_factory
    train_cfg = TrainSection(optimizer="muon", lr=0.02 if rule == "keller" else 3e-3, weight_decay=0.1, beta1=0.9,
                             beta2=0.95, muon_lr_rule=rule, muon_ns_dtype="fp32", muon_adamw_lr=8e-3,
                             muon_adamw_beta1=0.8, muon_adamw_beta2=0.99, muon_adamw_weight_decay=0.05,
                             steps=TORCH_STEPS, warmup_steps=WARMUP, min_lr_ratio=0.1)
    ours, theirs = _llama(0), _llama(0)
    start = [p.detach().clone() for p in theirs.parameters()]
    matrices, others = _hidden(ours)
    for p in matrices:  # the marks a TP linear carries (model/parallel/layers.py), at tp 1
        p.partition_dim, p.partition_stride = 0, 1
    optimizer = muon_factory(train_cfg, None)([{"params": matrices, "muon": True}, {"params": others}])
    schedule = warmup_cosine(WARMUP, TORCH_STEPS, 0.1)(optimizer)

    their_matrices, their_others = _hidden(theirs)
    muon = torch.optim.Muon(their_matrices, lr=train_cfg.lr, weight_decay=0.1, momentum=0.95, nesterov=True,
                            adjust_lr_fn=adjust_lr_fn)
    adamw = torch.optim.AdamW([{"params": [p for p in their_others if p.dim() >= 2]},  # decay: embeddings, head
                               {"params": [p for p in their_others if p.dim() < 2], "weight_decay": 0.0}],
                              lr=8e-3, betas=(0.8, 0.99), eps=1e-8, weight_decay=0.05)
    their_schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda i: lr_ratio(i, WARMUP, TORCH_STEPS, 0.1))
                       for o in (muon, adamw)]

    def fp32_copy(self):  # torch's Newton-Schulz, in fp32: its `grad.bfloat16()` is a copy it divides in place
        return self.float().clone()

    generator = torch.Generator().manual_seed(1)
    for _ in range(TORCH_STEPS):
        tokens = torch.randint(0, 64, (4, 16), generator=generator)
        losses = []
        for model in (ours, theirs):
            model.zero_grad()
            loss = model(tokens, labels=tokens).loss
            loss.backward()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[1]), losses
        optimizer.step()
        schedule.step()
        with mock.patch.object(torch.Tensor, "bfloat16", fp32_copy):
            muon.step()
        adamw.step()
        for s in their_schedules:
            s.step()
    with torch.no_grad():
        losses = [model(tokens, labels=tokens).loss.item() for model in (ours, theirs)]
    assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[1]), losses
    for (name, p), q, q0 in zip(ours.named_parameters(), theirs.parameters(), start):
        assert (p - q).abs().max() <= MOVED_RTOL * (q - q0).abs().max(), (name, (p - q).abs().max(), (q - q0).abs().max())
    for p, q in zip(matrices, their_matrices):  # the same numbers under the same key
        buffer = muon.state[q][MOMENTUM_KEY]
        assert (optimizer.state[p][MOMENTUM_KEY] - buffer).abs().max() <= MOMENTUM_RTOL * buffer.abs().max()


def test_newton_schulz_in_bf16_is_torch_muons_precision():
    """train.muon_ns_dtype: null is bf16 on a GPU (torch.optim.Muon's and Keller Jordan's), fp32 on a CPU;
    at bf16 a step of ours departs from the fp32 step by bf16 rounding, as torch's (on CPU, relative
    Frobenius distance: ours 3.9e-2, torch's 1.6e-2, ours from torch's 4.3e-2; torch's addmm rounds
    b A + c A^2 once, ours twice)."""
    from launch.optim.muon import Muon
    from launch.optim.newton_schulz import ns_dtype
    assert ns_dtype(None, torch.device("cpu")) == torch.float32
    assert ns_dtype(None, torch.device("cuda")) == torch.bfloat16
    assert ns_dtype("fp32", torch.device("cuda")) == torch.float32
    torch.manual_seed(0)
    start, grad = torch.randn(80, 32), torch.randn(80, 32)

    def step(make):
        p = torch.nn.Parameter(start.clone())
        p.grad = grad.clone()
        make(p).step()
        return p.detach() - start

    def ours(dtype):
        def make(p):
            p.partition_dim, p.partition_stride = 0, 1
            return Muon([{"params": [p], "muon": True}], lr=0.02, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8,
                        lr_rule="keller", ns_dtype=dtype)
        return step(make)
    theirs_bf16 = step(lambda p: torch.optim.Muon([p], lr=0.02, weight_decay=0.0))
    fp32, bf16 = ours("fp32"), ours("bf16")

    def dist_(a, b):
        return (torch.linalg.matrix_norm(a - b) / torch.linalg.matrix_norm(b)).item()
    for step_bf16 in (bf16, theirs_bf16):
        assert 1e-3 < dist_(step_bf16, fp32) < 6e-2, dist_(step_bf16, fp32)
    assert dist_(bf16, theirs_bf16) < 6e-2


def test_the_documented_reference_settings_load_as_recipes(tmp_path):
    """docs/design.md's Moonlight and Keller Jordan recipe snippets (the indented `train:` blocks of
    its Muon section) load through the recipe loader, validate, and say what the text says."""
    from pathlib import Path

    from launch.config.recipe import load_recipe
    text = (Path(__file__).resolve().parents[2] / "docs" / "design.md").read_text()
    section = text[text.index("\n## Muon at every layout"):]
    section = section[:section.index("\n## ", 1)]
    snippets = []
    for block in section.split("\n\n"):
        if block.startswith("    train:"):
            path = tmp_path / f"snippet{len(snippets)}.yaml"
            path.write_text("\n".join(line[4:] for line in block.splitlines()) + "\n")
            recipe = load_recipe(path, [])
            recipe.validate()
            snippets.append(recipe.train)
    moonlight, keller = snippets
    assert (moonlight.optimizer, moonlight.muon_lr_rule, moonlight.weight_decay) == ("muon", "moonlight", 0.1)
    assert moonlight.muon_adamw_lr is None and moonlight.muon_adamw_weight_decay is None  # AdamW's lr and decay
    assert (keller.optimizer, keller.muon_lr_rule, keller.lr, keller.muon_momentum) == ("muon", "keller", 0.02, 0.95)
    assert keller.muon_nesterov and keller.muon_ns_steps == 5 and keller.muon_adamw_lr == 2e-3
