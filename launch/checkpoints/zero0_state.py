"""A ZeRO-0 engine's optimizer state by parameter name, so that launch/checkpoints/reshard.py
re-shards it as it re-shards ZeRO-1's (fp32 runs on one data rank build ZeRO-0,
launch/analysis/engine_memory.py: built_zero_stage, and resume at dp > 1 under ZeRO-1, and back).

DeepSpeed saves a ZeRO-0 engine's optimizer as torch's `optimizer.state_dict()` in each
model-parallel rank's `mp_rank_MM_model_states.pt`: each parameter's state (AdamW's step and
moments, or Muon's momentum) keyed by its position in the param groups, with no names, and the
weights in the pipeline's layer files. `client_state` adds to that file each position's pipeline
parameter name and the layer file and key holding its weight; a parameter no layer file holds (a
tied copy that a stage calls through a function) is stored by value."""
from __future__ import annotations

from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Dict, Iterable, List, Optional

import torch

if TYPE_CHECKING:  # annotations only: no import cost at run time
    from deepspeed.runtime.pipe.engine import PipelineEngine

INDEX = "zero0_index"
"""The client-state key: {"groups": [[pipeline name per position]], "files": {name: [layer file, key]},
"weights": {name: tensor}}."""
STEP = "step"


def client_state(engine: PipelineEngine) -> Dict[str, dict]:
    """What a ZeRO-0 engine adds to its model-states file; every rank of data index 0 writes its own."""
    module = engine.module
    names = {id(p): name for name, p in module.named_parameters()}
    files: Dict[int, List[str]] = {}
    for local, layer in enumerate(module.forward_funcs):
        if isinstance(layer, torch.nn.Module):  # DeepSpeed's save_state_dict writes these, by local key
            file = Path(module.ckpt_layer_path("", local)).name
            for key, p in layer.named_parameters():
                files.setdefault(id(p), [file, key])
    params = [p for group in engine.optimizer.param_groups for p in group["params"]]
    return {INDEX: {"groups": [[names[id(p)] for p in group["params"]] for group in engine.optimizer.param_groups],
                    "files": {names[id(p)]: files[id(p)] for p in params if id(p) in files},
                    "weights": {names[id(p)]: p.detach() for p in params if id(p) not in files}}}


def is_zero0(model_states: dict) -> bool:
    """A model-states file of a ZeRO-0 engine that `client_state` indexed."""
    return model_states.get("optimizer") is not None and INDEX in model_states


def saved_names(model_states: dict) -> List[str]:
    return list(chain.from_iterable(model_states[INDEX]["groups"]))


def rank_independent_state(model_states: dict) -> dict:
    """The optimizer state that reshard.py reads from a ZeRO-1 file's `optimizer_state_dict`: the
    param groups' hyper-parameters, and per group a state with the group's keys and step (its first
    parameter's: every parameter steps once per optimizer step)."""
    optim = model_states["optimizer"]
    state = {g: optim["state"][group["params"][0]] for g, group in enumerate(optim["param_groups"])
             if group["params"] and group["params"][0] in optim["state"]}
    return {"base_optimizer_state": {"state": state, "param_groups": optim["param_groups"]}, "loss_scaler": None}


class SavedZero0Slice:
    """One saved (stage, TP rank) of a ZeRO-0 checkpoint, with _SavedSlice's `shard`: a parameter's
    fp32 weight (from its layer file, opened once and memory-mapped) and its optimizer state."""

    def __init__(self, ckpt: Path, model_states: dict, load):
        self.ckpt, self.load = ckpt, load
        index = model_states[INDEX]
        self.files, self.weights = index["files"], index["weights"]
        self.state = model_states["optimizer"]["state"]
        self.position = {name: i for i, name in enumerate(saved_names(model_states))}
        self.opened: Dict[str, dict] = {}

    def _weight(self, name: str) -> torch.Tensor:
        if name in self.weights:
            return self.weights[name]
        file, key = self.files[name]
        if file not in self.opened:
            self.opened[file] = self.load(self.ckpt / file)
        return self.opened[file][key]

    def shard(self, name: str, data_indices: Optional[Iterable[int]] = None) -> Dict[str, torch.Tensor]:
        if data_indices is not None:
            raise ValueError(f"{self.ckpt}: ZeRO-0 state of {name} is not partitioned over data ranks")
        state = self.state.get(self.position[name])
        if state is None:
            raise ValueError(f"{self.ckpt} holds no optimizer state for {name}")
        weight = self._weight(name)
        return {"fp32": weight.float(), **{key: value for key, value in state.items() if key != STEP}}


def set_state(optimizer: torch.optim.Optimizer, param: torch.nn.Parameter, weight: torch.Tensor,
              state: Dict[str, torch.Tensor]) -> None:
    """Copy one parameter's weight and per-element optimizer state into a ZeRO-0 engine's bare torch
    optimizer, whose state reshard.py created for every parameter first (DeepSpeed's
    safe_set_full_* do nothing at stage 0)."""
    param.copy_(weight)
    for key, value in state.items():
        optimizer.state[param][key].copy_(value)
