"""Checkpoints: DeepSpeed's engine state plus ours, committed atomically (docs/checkpoints.md).

A save directory:
    DIR/latest                     the tag of the newest complete checkpoint (atomic rename)
    DIR/step00000042/              DeepSpeed's files (per-layer weights, ZeRO optimizer partitions,
                                   LR scheduler, loss scaler) and our client state (step, samples
                                   consumed, resolved recipe)
    DIR/step00000042/rng/rank_N.pt the RNG states of global rank N (dropout replay)
    DIR/step00000042/experts/      a mixture-of-experts model's expert weights, one file per
                                   (pipeline layer, TP rank, EP rank), named by the global expert
                                   ids it holds (`expert_file_name`); the layer files hold the rest
    DIR/step00000042/complete.json written last, by rank 0, after every rank has saved and fsynced:
                                   step, layout, resolved recipe, every file's size, the parent
    DIR/abandoned-<UTC time>/      tags after the one a run resumed from, moved aside at start
`--load` takes only complete checkpoints, and an unreadable manifest or `latest` is an error;
`--keep-last K` keeps the K newest of the parent chain. Loads are torch.load(weights_only=True)."""
from __future__ import annotations

import contextlib
import json
import re
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from launch.checkpoints.locate import COMPLETE, FUSED_LLAMA, LATEST, CheckpointRef, same_layout, step_of, tag_for
from launch.checkpoints.safe_io import fsync_dir, load_safely, save_durably, use_safe_engine, write_durably
from launch.errors import ConfigError

if TYPE_CHECKING:  # annotations only: no import cost at run time
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from model.config import GPTConfig
    from model.parallel_state import ParallelState


def _rng_state() -> Dict[str, Any]:
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker
    return {"cpu": torch.get_rng_state(), "accelerator": get_accelerator().get_rng_state(),
            "tracker": get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: Dict[str, Any]) -> None:
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker
    torch.set_rng_state(state["cpu"])
    get_accelerator().set_rng_state(state["accelerator"])
    get_cuda_rng_tracker().set_states(state["tracker"])


PRUNING = ".pruning-"  # a pruned tag is renamed to this prefix at once, then deleted in the background


def prepare_save_dir(root: Path, resume_from: Optional[CheckpointRef], is_writer: bool) -> None:
    """Before a run saves into `root`, make its checkpoints after the resumed step T (0 for a
    fresh run) leave: the tag directories of later steps (an abandoned run's, or a save cut
    short) move into root/abandoned-<UTC time>/, and `latest` names T's tag if it lies in `root`
    (else it is removed: nothing in `root` continues this run yet). So a save never writes into
    a directory with another run's files, `--load root` never picks the abandoned run, and
    `--keep-last` prunes this run's history. Called on every rank before torch.distributed starts;
    only the writer (global rank 0) moves, and no rank saves before it has joined them."""
    if not is_writer or not root.is_dir():
        return
    try:
        _set_aside_later_tags(root, resume_from)
    except OSError as e:
        raise ConfigError(f"--save {str(root)!r}: could not move its later checkpoints aside ({e}); "
                          f"move them yourself or save into another directory") from None


def _set_aside_later_tags(root: Path, resume_from: Optional[CheckpointRef]) -> None:
    resumed = resume_from.meta["step"] if resume_from is not None else 0
    later = sorted(p for p in root.iterdir() if p.is_dir() and (step_of(p.name) or 0) > resumed)
    in_root = resume_from is not None and resume_from.root.resolve() == root.resolve()
    if later:
        aside = root / time.strftime("abandoned-%Y%m%dT%H%M%SZ", time.gmtime())
        while aside.exists():
            aside = aside.with_name(aside.name + "-1")
        aside.mkdir()
        for p in later:
            p.rename(aside / p.name)
        fsync_dir(root)
        print(f"checkpoints after step {resumed} moved out of the way into {aside}: "
              f"{', '.join(p.name for p in later)}", flush=True)
    if in_root:
        write_durably(root / LATEST, resume_from.tag)
    elif (root / LATEST).exists():
        (root / LATEST).unlink()
        fsync_dir(root)


def save(engine: PipelineEngine, root: Path, step: int, samples: int, recipe_dict: Dict[str, Any],
         layout: Dict[str, int], keep_last: int, is_writer: bool, wandb_run_id: Optional[str] = None,
         data_state: Optional[Dict[str, Any]] = None) -> Path:
    """Every rank calls this; rank `is_writer` commits (it holds the wandb run, whose id a
    resumed run continues) and then prunes in the background, while the others train on.
    `data_state`: the streaming data position of the whole run (JSON, already gathered from the
    ranks), stored in complete.json for `--load`. Returns the tag directory."""
    use_safe_engine(engine)  # each rank fsyncs the files it writes
    tag = tag_for(step)
    client_state = {"step": step, "samples": samples, "recipe": recipe_dict}
    experts = _has_experts(engine)
    with _experts_apart(engine) if experts else contextlib.nullcontext():
        engine.save_checkpoint(str(root), tag=tag, client_state=client_state, save_latest=False)
    if experts:
        _save_experts(engine, root / tag, layout.get("ep", 1))
    rng_dir = root / tag / "rng"
    rng_dir.mkdir(parents=True, exist_ok=True)
    save_durably(_rng_state(), rng_dir / f"rank_{dist.get_rank()}.pt")
    dist.barrier()  # every rank's files are on disk before the checkpoint is declared complete
    if is_writer:
        meta = {"step": step, "samples": samples, "layout": layout, "recipe": recipe_dict,
                "world_size": dist.get_world_size(), "wandb_run_id": wandb_run_id, "data_state": data_state,
                "parent": _latest_tag(root), FUSED_LLAMA: True}
        _commit(root, tag, meta)
        _prune_in_background(root, tag, keep_last)
    return root / tag


def _latest_tag(root: Path) -> Optional[str]:
    return (root / LATEST).read_text().strip() if (root / LATEST).exists() else None


def _commit(root: Path, tag: str, meta: Dict[str, Any]) -> None:
    """complete.json (with every file's size), then `latest`; each made durable before the next."""
    tag_dir = root / tag
    meta["files"] = {str(f.relative_to(tag_dir)): f.stat().st_size for f in sorted(tag_dir.rglob("*")) if f.is_file()}
    for d in [tag_dir] + [d for d in tag_dir.rglob("*") if d.is_dir()]:
        fsync_dir(d)  # the entries of the files every rank created
    write_durably(tag_dir / COMPLETE, json.dumps(meta, indent=1))
    fsync_dir(root)  # the tag directory's own entry, before `latest` names it
    write_durably(root / LATEST, tag)


_pruning: Optional[threading.Thread] = None  # the writer's one background deletion


def _prune_in_background(root: Path, tag: str, keep_last: int) -> None:
    """Rename the tags of `tag`'s history beyond the newest `keep_last` out of the tag namespace
    (a rename: instant, and never a half-deleted checkpoint), then delete them in a thread."""
    global _pruning
    if keep_last < 1:
        return
    for old in history(root, tag)[keep_last:]:
        old.rename(root / f"{PRUNING}{old.name}-{time.time_ns()}")
    if _pruning is not None:
        _pruning.join()
    doomed = list(root.glob(f"{PRUNING}*"))  # also any that a killed run left behind
    if doomed:
        _pruning = threading.Thread(target=_delete, args=(doomed,), name="checkpoint-prune")
        _pruning.start()


def _delete(directories: List[Path]) -> None:
    for d in directories:
        shutil.rmtree(d, ignore_errors=True)


def history(root: Path, tag: str) -> List[Path]:
    """The tag directories of `tag`'s history in `root`, newest first: each complete.json names
    its parent. A manifest that cannot be read ends the walk: pruning only deletes what it is sure of."""
    chain: List[Path] = []
    while tag is not None and (root / tag / COMPLETE).is_file() and root / tag not in chain:
        chain.append(root / tag)
        try:
            tag = json.loads((root / tag / COMPLETE).read_text()).get("parent")
        except (OSError, ValueError, AttributeError) as e:
            print(f"warning: --keep-last stops at {root / tag}: its {COMPLETE} cannot be read ({e})",
                  file=sys.stderr, flush=True)
            break
    return chain


def load(engine: PipelineEngine, ref: CheckpointRef, layout: Dict[str, int], state: ParallelState, config: GPTConfig) -> Dict[str, Any]:
    """Restore the engine and return the client state (step, samples, recipe). At the saved
    layout: DeepSpeed's own loader, this rank's experts (`experts/`) and its RNG states (a bitwise
    continuation). At another: launch/checkpoints/reshard.py re-shards weights and optimizer state,
    experts included (fp32 rounding)."""
    if not same_layout(ref.meta["layout"], layout):
        from launch.checkpoints.reshard import load_resharded
        from model.pipe import seed_dropout_rngs
        load_resharded(engine, ref.path, ref.meta["layout"], state, config, config.vocab_size,
                       config.padded_vocab_size(state.tp_size))
        # No saved RNG state fits this layout's ranks: new streams, not step 1's masks again.
        seed_dropout_rngs(config.seed, state, "resumed", ref.meta["step"])
        return {key: ref.meta[key] for key in ("step", "samples", "recipe")}
    use_safe_engine(engine)  # DeepSpeed's loader then unpickles with weights_only=True
    experts = _has_experts(engine)
    with _experts_apart(engine) if experts else contextlib.nullcontext():
        load_path, client_state = engine.load_checkpoint(str(ref.root), tag=ref.tag)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {ref.path}")
    if experts:
        _load_experts(engine, ref.path, layout.get("ep", 1))
    _set_rng_state(load_safely(ref.path / "rng" / f"rank_{dist.get_rank()}.pt"))
    return client_state


# ------------------------------------------------------------------ experts (mixture of experts)
#
# DeepSpeed's engine takes a model with experts (model/pipe.py's ExpertParallelMarker) down its MoE
# checkpoint path, which writes no pipeline layer files, and its pipeline module writes the layer
# files of data-parallel rank 0 only, which holds 1/ep of the experts. So the save and the load run
# DeepSpeed's dense pipeline path with the expert weights kept out of the layer files
# (`_experts_apart`), and the experts go into files of their own, written by the ranks of the first
# EP group (expert-data-parallel rank 0: every expert once per TP rank) and named by the global
# expert ids they hold, so that any layout finds any expert. Their optimizer state needs nothing:
# each rank's ZeRO-1 file holds its partition of its own experts' groups, which DeepSpeed's loader
# restores at the saved layout and launch/checkpoints/reshard.py reads at another.

EXPERTS = "experts"
"""The tag's directory of expert weights."""
EXPERT_FILE = re.compile(r"layer_(\d+)-model_(\d+)-experts_(\d+)-(\d+)\.pt")


def expert_file_name(layer: int, tp_rank: int, first: int, last: int) -> str:
    """The file of pipeline layer `layer`'s experts `first`..`last` (global ids, both included) on
    TP rank `tp_rank`: {layer-relative name: tensor of those experts}, with the names and the TP
    shards of the layer's parameters (model/moe.py: "mlp.experts.gate_up_proj" (n, 2f/tp, h) and
    "mlp.experts.down_proj" (n, h, f/tp), n = last - first + 1 = E/ep)."""
    return f"layer_{layer:02d}-model_{tp_rank:02d}-experts_{first}-{last}.pt"


def _has_experts(engine: PipelineEngine) -> bool:
    """The same on every rank (a stage without MoE blocks included): the save's collectives follow it."""
    return bool(getattr(engine, "has_moe_layers", False))


def _stage_experts(engine: PipelineEngine) -> Dict[int, Dict[str, torch.Tensor]]:
    """{pipeline layer index: {layer-relative name: expert parameter}} of this rank's stage."""
    from model.moe import is_expert_param
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
    indices (model/parallel_state.py), so the first run, data index < ep, holds every expert once."""
    coord = engine.module._topo.get_coord(dist.get_rank())
    return coord.model, coord.data % ep, coord.data < ep


@contextlib.contextmanager
def _experts_apart(engine: PipelineEngine) -> Iterator[None]:
    """DeepSpeed's dense pipeline save and load (per-layer files, ZeRO partitions) for a model with
    experts: DeepSpeed's MoE path off, the expert parameters left out of the layer files it writes,
    and filled with their own values when it loads them (strict loading stays on for the rest);
    `_save_experts` and `_load_experts` handle the experts."""
    from model.moe import is_expert_param
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


def _save_experts(engine: PipelineEngine, tag_dir: Path, ep: int) -> None:
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
def _load_experts(engine: PipelineEngine, tag_dir: Path, ep: int) -> None:
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
    model/convert.py's `merge_layer_states` merges them into the layer's full dense weights: the
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
