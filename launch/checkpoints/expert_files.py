"""The expert weights of a mixture-of-experts checkpoint (docs/checkpoints.md).

DeepSpeed's engine takes a model with experts (model/gpt/pipe.py's ExpertParallelMarker) down its MoE
checkpoint path, which writes no pipeline layer files, and its pipeline module writes the layer
files of data-parallel rank 0 only, which holds 1/ep of the experts. So the save and the load run
DeepSpeed's dense pipeline path with the expert weights kept out of the layer files
(`experts_apart`), and the experts go into files of their own, written by the ranks of the first
EP group (expert-data-parallel rank 0: every expert once per TP rank) and named by the global
expert ids they hold, so that any layout finds any expert. Their optimizer state needs nothing:
each rank's ZeRO-1 file holds its partition of its own experts' groups, which DeepSpeed's loader
restores at the saved layout and launch/checkpoints/reshard.py reads at another."""
from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import TYPE_CHECKING, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from launch.checkpoints.safe_io import load_safely, save_durably

if TYPE_CHECKING:  # annotations only: no import cost at run time
    from deepspeed.runtime.pipe.engine import PipelineEngine


EXPERTS = "experts"
"""The tag's directory of expert weights."""
EXPERT_FILE = re.compile(r"layer_(\d+)-model_(\d+)-experts_(\d+)-(\d+)\.pt")


def expert_file_name(layer: int, tp_rank: int, first: int, last: int) -> str:
    """The file of pipeline layer `layer`'s experts `first`..`last` (global ids, both included) on
    TP rank `tp_rank`: {layer-relative name: tensor of those experts}, with the names and the TP
    shards of the layer's parameters (model/transformer/moe.py: "mlp.experts.gate_up_proj" (n, 2f/tp, h) and
    "mlp.experts.down_proj" (n, h, f/tp), n = last - first + 1 = E/ep)."""
    return f"layer_{layer:02d}-model_{tp_rank:02d}-experts_{first}-{last}.pt"


def has_experts(engine: PipelineEngine) -> bool:
    """The same on every rank (a stage without MoE blocks included): the save's collectives follow it."""
    return bool(getattr(engine, "has_moe_layers", False))


def _stage_experts(engine: PipelineEngine) -> Dict[int, Dict[str, torch.Tensor]]:
    """{pipeline layer index: {layer-relative name: expert parameter}} of this rank's stage."""
    from model.transformer.moe import is_expert_param
    module = engine.module
    stage: Dict[int, Dict[str, torch.Tensor]] = {}
    for local, layer in enumerate(module.forward_funcs):
        if isinstance(layer, torch.nn.Module):
            params = {name: p for name, p in layer.named_parameters() if is_expert_param(p)}
            if params:
                stage[module._local_start + local] = params
    return stage


def _expert_coordinate(engine: PipelineEngine, ep: int) -> Tuple[int, int, bool]:
    """(TP rank, EP rank, whether this rank writes its experts): EP groups are runs of ep data
    indices (model/parallel/state.py), so the first run, data index < ep, holds every expert once."""
    coord = engine.module._topo.get_coord(dist.get_rank())
    return coord.model, coord.data % ep, coord.data < ep


@contextlib.contextmanager
def experts_apart(engine: PipelineEngine) -> Iterator[None]:
    """DeepSpeed's dense pipeline save and load (per-layer files, ZeRO partitions) for a model with
    experts: DeepSpeed's MoE path off, the expert parameters left out of the layer files it writes,
    and filled with their own values when it loads them (strict loading stays on for the rest);
    `save_experts` and `load_experts` handle the experts."""
    from model.transformer.moe import is_expert_param
    handles = []
    for module in engine.module.modules():
        names = [name for name, p in module.named_parameters(recurse=False) if is_expert_param(p)]
        if not names:
            continue

        def leave_out(_module, state_dict, prefix, _metadata, names=names):
            for name in names:
                state_dict.pop(prefix + name, None)

        def fill_in(module, state_dict, prefix, *_, names=names):
            for name in names:
                state_dict.setdefault(prefix + name, getattr(module, name).detach())
        handles += [module.register_state_dict_post_hook(leave_out), module.register_load_state_dict_pre_hook(fill_in)]
    engine.has_moe_layers = False
    try:
        yield
    finally:
        engine.has_moe_layers = True
        for handle in handles:
            handle.remove()


def save_experts(engine: PipelineEngine, tag_dir: Path, ep: int) -> None:
    """The ranks of the first EP group write their experts of every MoE layer of their stage."""
    tp_rank, ep_rank, writer = _expert_coordinate(engine, ep)
    if not writer:
        return
    (tag_dir / EXPERTS).mkdir(parents=True, exist_ok=True)
    for layer, params in _stage_experts(engine).items():
        n = next(iter(params.values())).size(0)  # E/ep experts on every EP rank
        first = ep_rank * n
        # clone: a parameter is a view into ZeRO's flat buffer, which torch.save would write whole
        save_durably({name: p.detach().clone() for name, p in params.items()},
                     tag_dir / EXPERTS / expert_file_name(layer, tp_rank, first, first + n - 1))
    if ep_rank > 0 and not engine.zero_optimization():
        # ZeRO-0: DeepSpeed saves the optimizer state of data index 0 only, whose experts are EP rank 0's
        save_durably(engine.optimizer.state_dict(), tag_dir / EXPERTS / _zero0_optimizer_name(engine, ep_rank))


def _zero0_optimizer_name(engine: PipelineEngine, ep_rank: int) -> str:
    """ZeRO-0 only: the whole optimizer state of EP rank `ep_rank` > 0 of a (stage, TP rank), whose
    experts' moments the mp_rank file (EP rank 0's) lacks."""
    return f"optimizer-mp_rank_{engine.checkpoint_mp_rank:02d}-ep_rank_{ep_rank}.pt"


@torch.no_grad()
def load_experts(engine: PipelineEngine, tag_dir: Path, ep: int) -> None:
    """Each rank's experts of every MoE layer of its stage, from `experts/` (the saved layout's)."""
    tp_rank, ep_rank, _ = _expert_coordinate(engine, ep)
    for layer, params in _stage_experts(engine).items():
        n = next(iter(params.values())).size(0)
        saved = read_experts(tag_dir, layer, tp_rank, range(ep_rank * n, (ep_rank + 1) * n))
        for name, param in params.items():
            if name not in saved or saved[name].shape != param.shape:
                found = tuple(saved[name].shape) if name in saved else "nothing"
                raise ValueError(f"{tag_dir / EXPERTS}: layer {layer} {name} on TP rank {tp_rank} gives {found}, "
                                 f"the model has {tuple(param.shape)}")
            param.copy_(saved[name])
    if ep_rank > 0 and not engine.zero_optimization():
        engine.optimizer.load_state_dict(load_safely(tag_dir / EXPERTS / _zero0_optimizer_name(engine, ep_rank),
                                                     map_location="cpu"))


def read_experts(tag_dir: Path, layer: int, tp_rank: int, experts: Optional[range] = None) -> Dict[str, torch.Tensor]:
    """Pipeline layer `layer`'s expert weights on TP rank `tp_rank` in checkpoint `tag_dir`:
    {layer-relative name: the experts `experts` (global ids; default all E), stacked along dim 0},
    from the files of whatever ep saved them; {} for a layer without experts. Only the files that
    hold wanted experts are read."""
    held = []
    for path in (tag_dir / EXPERTS).glob(f"layer_{layer:02d}-model_{tp_rank:02d}-experts_*.pt"):
        match = EXPERT_FILE.fullmatch(path.name)
        if match and int(match.group(1)) == layer:
            held.append((int(match.group(3)), int(match.group(4)), path))
    if not held:
        return {}
    held.sort()
    if held[0][0] != 0 or any(a[1] + 1 != b[0] for a, b in zip(held, held[1:])):
        raise ValueError(f"{tag_dir / EXPERTS}: the expert files of layer {layer} on TP rank {tp_rank} do not "
                         f"hold experts 0..E-1 once each: {[p.name for _, _, p in held]}")
    wanted = experts if experts is not None else range(held[-1][1] + 1)
    if wanted.start < 0 or wanted.stop > held[-1][1] + 1 or wanted.step != 1:
        raise ValueError(f"{tag_dir / EXPERTS}: layer {layer} has experts 0..{held[-1][1]}, not {wanted}")
    parts: Dict[str, List[torch.Tensor]] = {}
    for first, last, path in held:
        lo, hi = max(first, wanted.start), min(last + 1, wanted.stop)
        if lo < hi:
            for name, tensor in load_safely(path, map_location="cpu").items():
                parts.setdefault(name, []).append(tensor[lo - first:hi - first])
    return {name: torch.cat(pieces) for name, pieces in parts.items()}


LAYER_FILE = re.compile(r"layer_(\d+)-model_(\d+)-model_states\.pt")
"""DeepSpeed's name for the weights of pipeline layer XX on TP rank YY (PipelineModule.ckpt_layer_path)."""


def read_layer_files(files: List[Path]) -> List[Dict[str, torch.Tensor]]:
    """One pipeline layer's state dict on each TP rank (its layer files `files`, in TP-rank order,
    as DeepSpeed names them), expert weights included: those of every expert, from the tag's
    `experts/` files whatever ep saved them. So each state dict is that of the layer at ep = 1, and
    model/hf/convert.py's `merge_layer_states` merges them into the layer's full dense weights: the
    one reader of a checkpoint's weights (export, evaluation). Read with weights_only=True: a
    layer file is DeepSpeed's torch.save(module.state_dict()), plain tensors."""
    states = []
    for path in files:
        match = LAYER_FILE.fullmatch(path.name)
        state = load_safely(path, map_location="cpu")
        if match:
            state.update(read_experts(path.parent, int(match.group(1)), int(match.group(2))))
        states.append(state)
    return states
