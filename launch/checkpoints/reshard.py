"""Resume a checkpoint at another layout: re-shard the weights and the optimizer state on load.

Every rank reads, from the saved ZeRO-1 files (`[bf16_]zero_pp_rank_D_mp_rank_M_optim_states.pt`,
located through their `param_slice_mappings`) or a ZeRO-0 run's model-states files (indexed by name:
launch/checkpoints/zero0_state.py), only the fragments of its own parameters, one
parameter at a time; merges the saved TP shards and cuts its own with model/hf/convert.py's rules;
and writes the fp32 master weight, the optimizer's per-element state (Adam's moments, or Muon's
momentum for its matrices: whatever keys each saved param group holds) and step, the lr, the LR
schedule and the engine's step counters into the new engine (ZeRO-1's flat partitions, or a ZeRO-0
engine's parameters and torch optimizer). Why this way, its memory bound and its limits (no fp16
ZeRO-0, RNG states carried only at the saved layout): docs/checkpoints.md, "Resuming at another layout".

Experts (a mixture-of-experts model) re-shard over (tp, ep) too: ZeRO-1 partitions an expert
parameter over its expert-data-parallel group (the data indices d with d % ep = r hold EP rank
r's experts), so EP rank r's shard is read from those files only; the EP ranks' experts are
stacked along dim 0 (model/hf/convert.py: merge_experts) and each rank reads only the saved EP ranks
that hold its own experts (docs/checkpoints.md, "Mixture of experts").

Interleaved stages (train.virtual_stages) re-shard with nothing of their own: at any v a rank's
parameters are named by their index in the layer table (model/gpt/pipe.py builds each chunk under
its layers' own names), so a saved rank's files, which hold its v chunks, are read by name like a
stage's at v = 1; only the flat partitions differ, which is why a change of v comes here
(launch/checkpoints/locate.py: same_layout)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Dict, Iterable, Iterator, List, Optional, Set, Tuple

import torch
import torch.nn as nn

from launch.checkpoints import zero0_state
from model.config import ModelConfig
from model.hf.convert import dense_name, merge, merge_experts, rule_for, split
from model.parallel.state import ParallelState, build_topology

if TYPE_CHECKING:  # annotations only: no import cost at run time
    from deepspeed.runtime.pipe.engine import PipelineEngine

MOMENTS = ("exp_avg", "exp_avg_sq")  # torch AdamW's state, next to the fp32 master weight
FP32 = "fp32"
STEP = "step"  # a scalar per group; every other key of a group's state is shaped as its flat partition


def _moment_keys(group_state: dict) -> Tuple[str, ...]:
    """The per-element state of one saved param group: AdamW's MOMENTS, or Muon's `momentum_buffer`
    (launch/optim/muon.py)."""
    return tuple(k for k in group_state if k != STEP)


def _load_deepspeed_file(path: Path) -> dict:
    """A DeepSpeed optimizer or model-states file, read with the safe unpickler (no code runs:
    launch/checkpoints/safe_io.py), memory-mapped."""
    from launch.checkpoints.safe_io import load_safely
    return load_safely(path, map_location="cpu", mmap=True)


def _optimizer_file(ckpt: Path, dp_rank: int, mp_rank: int) -> Path:
    # ZeRO writes `zero_pp_rank_...`, DeepSpeed's bf16 optimizer `bf16_zero_pp_rank_...`.
    matches = list(ckpt.glob(f"*zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"))
    if len(matches) != 1:
        raise FileNotFoundError(f"{ckpt}: expected one optimizer file of dp rank {dp_rank}, model-parallel "
                                f"rank {mp_rank}, found {[m.name for m in matches]}")
    return matches[0]


def _model_file(ckpt: Path, mp_rank: int) -> Path:
    return ckpt / f"mp_rank_{mp_rank:02d}_model_states.pt"


def slice_ranks(tp: int, pp: int, dp: int) -> Dict[Tuple[int, int], int]:
    """{(stage, tp rank): DeepSpeed's model-parallel rank M in the file names}: the index of the
    global rank among the ranks of data-parallel index 0 (PipelineParallelGrid.ds_model_rank)."""
    topology = build_topology(tp, pp, dp)
    ranks = sorted(topology.get_axis_list(axis="data", idx=0))
    return {(topology.get_coord(r).pipe, topology.get_coord(r).model): i for i, r in enumerate(ranks)}


def _saved_names(ckpt: Path, mp_rank: int) -> List[str]:
    """The pipeline parameter names of one saved (stage, TP rank), ZeRO-1's or ZeRO-0's."""
    model_states = _load_deepspeed_file(_model_file(ckpt, mp_rank))
    if zero0_state.is_zero0(model_states):
        return zero0_state.saved_names(model_states)
    return [name for group in model_states["param_shapes"] for name in group]


def _open_slice(ckpt: Path, mp_rank: int, dp: int):
    """One saved (stage, TP rank), its model-states file read once for either kind of slice."""
    model_states = _load_deepspeed_file(_model_file(ckpt, mp_rank))
    if zero0_state.is_zero0(model_states):
        return zero0_state.SavedZero0Slice(ckpt, model_states, _load_deepspeed_file)
    return _SavedSlice(ckpt, mp_rank, dp, model_states)


def _index_fragments(optim: dict) -> Dict[str, Tuple[int, object]]:
    """{pipeline name: (param group, fragment address)} of one ZeRO partition file."""
    return {name: (g, address) for g, fragments in enumerate(optim["param_slice_mappings"])
            for name, address in fragments.items()}


class _SavedSlice:
    """One saved (stage, TP rank): its parameter shapes and its dp partition files, opened once
    and memory-mapped, so that reading a parameter touches only that parameter's fragments."""

    def __init__(self, ckpt: Path, mp_rank: int, dp: int, model_states: dict):
        self.ckpt = ckpt
        self.shapes = {}
        for group in model_states["param_shapes"]:  # the slice's mp_rank_MM_model_states.pt
            self.shapes.update(group)
        self.partitions = [_load_deepspeed_file(_optimizer_file(ckpt, d, mp_rank))["optimizer_state_dict"]
                           for d in range(dp)]
        self.fragments = [_index_fragments(optim) for optim in self.partitions]

    def shard(self, name: str, data_indices: Optional[Iterable[int]] = None) -> Dict[str, torch.Tensor]:
        """{fp32, its group's moments} of pipeline parameter `name` on this slice: its fragments,
        in dp-partition order, make its flattened shard (a new tensor; the files stay untouched).
        `data_indices`: the partition files to read (an expert parameter's: its EP rank's); default all."""
        pieces: Dict[str, List[torch.Tensor]] = {}
        indices = range(len(self.partitions)) if data_indices is None else data_indices
        for optim, fragments in ((self.partitions[d], self.fragments[d]) for d in indices):
            if name not in fragments:
                continue
            g, address = fragments[name]
            group_state = optim["base_optimizer_state"]["state"][g]
            flat = {FP32: optim["single_partition_of_fp32_groups"][g]}
            flat.update({k: group_state[k] for k in _moment_keys(group_state)})
            for key, tensor in flat.items():
                pieces.setdefault(key, []).append(tensor.narrow(0, address.start, address.numel))
        shape = self.shapes[name]
        found = sum(part.numel() for part in pieces.get(FP32, []))
        if found != shape.numel():  # checked before the view, which would fail with a bare shape error
            raise ValueError(f"{self.ckpt}: the fragments of {name} hold {found} elements, "
                             f"its shape {tuple(shape)} has {shape.numel()}")
        return {key: torch.cat(parts).view(shape) for key, parts in pieces.items()}


def iter_training_state(ckpt: Path, saved_layout: Dict[str, int], layers: ModelConfig, vocab_size: int,
                        wanted: Iterable[str], experts: Optional[range] = None
                        ) -> Iterator[Tuple[str, Dict[str, torch.Tensor]]]:
    """(dense name, {fp32, its moments}) for each dense parameter name in `wanted`: the
    full (TP-merged, real-vocabulary) fp32 weight and Adam moments, one parameter at a time. An
    expert parameter's hold the experts `experts` (global ids along dim 0; default all E).

    Memory: only one parameter's full tensors exist at a time (the caller drops them before the
    next), and a saved stage's files are open only while its parameters are read; each file is
    opened once per reading rank, and stages that hold none of `wanted` are never opened. Of an
    expert parameter only the saved EP ranks holding wanted experts are read."""
    tp, pp = saved_layout["tp"], saved_layout["pp"]
    # DeepSpeed's data axis, over which the ZeRO-1 files are partitioned, held dp x cp ranks
    # (model/parallel/state.py); the weights themselves do not depend on cp.
    dp = saved_layout["dp"] * saved_layout["cp"]
    ep = saved_layout["ep"]
    wanted = set(wanted)
    mp_ranks = slice_ranks(tp, pp, dp)
    done: Set[str] = set()
    for stage in range(pp):
        names = {}  # pipeline name on this stage -> dense name, for the wanted ones not yet read
        for name in _saved_names(ckpt, mp_ranks[stage, 0]):
            dense = dense_name(name, layers)
            if dense in wanted and dense not in done and dense not in names.values():
                names[name] = dense
        if not names:
            continue  # nothing of this stage is needed here: its files are never opened
        slices = [_open_slice(ckpt, mp_ranks[stage, r], dp) for r in range(tp)]
        for name, dense in names.items():
            if rule_for(dense, layers).experts:
                yield dense, _expert_state(slices, name, dense, ep, dp, experts, vocab_size, layers)
            else:
                shards = [s.shard(name) for s in slices]
                yield dense, {key: merge(dense, [shard[key] for shard in shards], vocab_size, layers)
                              for key in shards[0]}
            done.add(dense)
        del slices  # unmap this stage's files before the next stage's
    missing = wanted - done
    if missing:
        raise ValueError(f"{ckpt} holds no optimizer state for {sorted(missing)[:4]}")


def _expert_state(slices: List[_SavedSlice], name: str, dense: str, ep: int, dp: int, experts: Optional[range],
                  vocab_size: int, layers: ModelConfig) -> Dict[str, torch.Tensor]:
    """{fp32, moments} of the experts `experts` (default all) of expert parameter `name`:
    each saved EP rank r holding some of them is read from its expert-data-parallel partitions (the
    data indices r, r + ep, ...), TP-merged; the EP ranks' experts stacked, then cut to `experts`."""
    local = slices[0].shapes[name][0]  # E/ep experts per saved EP rank
    wanted = experts if experts is not None else range(local * ep)
    ranks = [r for r in range(ep) if r * local < wanted.stop and wanted.start < (r + 1) * local]
    per_rank = []
    for r in ranks:
        shards = [s.shard(name, range(r, dp, ep)) for s in slices]
        per_rank.append({key: merge(dense, [shard[key] for shard in shards], vocab_size, layers)
                         for key in shards[0]})
    start = wanted.start - ranks[0] * local
    return {key: merge_experts(dense, [part[key] for part in per_rank])[start:start + len(wanted)].clone()
            for key in per_rank[0]}


def _rank_independent_state(ckpt: Path) -> dict:
    """Slice 0, dp rank 0's optimizer state: Adam's step count, the param groups' hyper-parameters
    and the loss scaler are the same on every rank (each steps once per optimizer step)."""
    model_states = _load_deepspeed_file(_model_file(ckpt, 0))
    if zero0_state.is_zero0(model_states):
        return zero0_state.rank_independent_state(model_states)
    return _load_deepspeed_file(_optimizer_file(ckpt, 0, 0))["optimizer_state_dict"]


def _init_optimizer_state(optimizer, base: dict, zero0: bool) -> None:
    """Create the state DeepSpeed's first step would create, with the keys of the saved group of the
    same kind, before any parameter is read, so that the load only copies into it: ZeRO-1's flat
    partitions, each parameter's fragment linked to them for `safe_set_full_optimizer_state`; or a
    ZeRO-0 engine's per-parameter state. (Allocated as the load went, ZeRO-0's state sat between
    the freed full tensors of the parameters read: 242 MiB more at 117M parameters, growing with the
    model; bench/memory/reshard_memory.py.)"""
    step = base["state"][0][STEP]
    inner = optimizer if zero0 else optimizer.optimizer
    for group in inner.param_groups:
        saved = base["state"][base["param_groups"].index(_saved_group(group, base["param_groups"]))]
        for param in group["params"] if zero0 else group["params"][:1]:  # ZeRO-1: the group's one flat partition
            inner.state[param] = {STEP: step.clone(), **{k: torch.zeros_like(param) for k in _moment_keys(saved)}}
    if not zero0:
        optimizer._lazy_init_hp_params_optimizer_state()


def _saved_group(group: dict, saved_groups: List[dict]) -> dict:
    """The saved param group of the same kind as `group`: Muon's or not, expert or not, the same weight
    decay (the same index at the same layout; a stage without experts saves no expert groups); else the first."""
    def kind(g: dict):
        return bool(g.get("muon", False)), bool(g.get("moe", False)), g.get("weight_decay")
    return next((saved for saved in saved_groups if kind(saved) == kind(group)), saved_groups[0])


def _load_balance_state(module: nn.Module, ckpt: Path) -> None:
    """The MoE routers' balancing state (model/transformer/moe_balance.py): buffers, replicated over
    TP, EP and DP, so read from the layer's own file of TP rank 0 (DeepSpeed's module.state_dict(),
    keyed by the global layer index at every layout)."""
    from model.transformer.moe import BALANCE_STATE
    for name, buffer in module.named_buffers():
        layer, key = name.split(".", 1)
        if key.rsplit(".", 1)[-1] in BALANCE_STATE:
            buffer.copy_(_load_deepspeed_file(ckpt / f"layer_{int(layer):02d}-model_00-model_states.pt")[key])


@torch.no_grad()
def load_resharded(engine: PipelineEngine, ckpt: Path, saved_layout: Dict[str, int], state: ParallelState,
                   layers: ModelConfig, vocab_size: int, padded_vocab_size: int) -> None:
    """Fill `engine` (a fresh DeepSpeed pipeline engine with a ZeRO-1 or bf16 optimizer, or fp32
    ZeRO-0's bare one) with the weights, optimizer state, LR schedule and counters of checkpoint
    `ckpt`, saved at `saved_layout` (tp, pp, dp, cp, ep, v and the cut), for this rank's stage (its
    chunks) and TP rank."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    module: nn.Module = engine.module
    params = {dense_name(name, layers): param for name, param in module.named_parameters()}
    common = _rank_independent_state(ckpt)
    base = common["base_optimizer_state"]
    zero0 = engine.zero_optimization_stage() == 0  # fp32: the parameters are the master weights
    optimizer = engine.optimizer if zero0 else engine.optimizer.optimizer
    _init_optimizer_state(engine.optimizer, base, zero0)
    for group in optimizer.param_groups:  # lr, betas, ...; not the group's identity
        group.update({k: v for k, v in _saved_group(group, base["param_groups"]).items()
                      if k not in ("params", "name", "moe")})
    if getattr(engine.optimizer, "dynamic_loss_scale", False) and getattr(common.get("loss_scaler"), "dynamic", False):
        engine.optimizer.loss_scaler = common["loss_scaler"]  # fp16: the scale found so far, and its counters
    local = layers.moe.num_experts // state.ep_size  # this rank's experts, [ep_rank * local, ...)
    experts = range(state.ep_rank * local, (state.ep_rank + 1) * local) if layers.moe.enabled else None
    for dense, full in iter_training_state(ckpt, saved_layout, layers, vocab_size, params, experts):
        param = params[dense]
        shards = {key: split(dense, tensor, state.tp_rank, state.tp_size, padded_vocab_size, layers)
                  for key, tensor in full.items()}
        if shards[FP32].shape != param.shape:
            raise ValueError(f"{dense}: the checkpoint gives a shard of {tuple(shards[FP32].shape)}, the "
                             f"model has {tuple(param.shape)}")
        if zero0:
            zero0_state.set_state(optimizer, param, shards[FP32], {k: v for k, v in shards.items() if k != FP32})
        else:
            safe_set_full_fp32_param(param, shards[FP32])
            for key in shards.keys() - {FP32}:
                safe_set_full_optimizer_state(param, shards[key], key)
            param.copy_(shards[FP32].to(param.dtype))  # the training-dtype copy DeepSpeed's step makes
        del full, shards  # before the next parameter is read: one parameter's state at a time

    _load_balance_state(module, ckpt)
    model_states = _load_deepspeed_file(_model_file(ckpt, 0))
    engine.lr_scheduler.load_state_dict(model_states["lr_scheduler"])
    engine.global_steps = model_states["global_steps"]
    engine.global_samples = model_states["global_samples"]
    engine.skipped_steps = model_states["skipped_steps"]
