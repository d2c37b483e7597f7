"""Which checkpoint `--load` resumes from, and whether this run may resume it.

A save directory's layout and commit protocol: launch/checkpoints/store.py. `--load` takes a
save directory (the checkpoint its `latest` names) or one tag directory; only complete
checkpoints (with complete.json, every file of its manifest at its recorded size), and an
unreadable complete.json or `latest` is an error, never a reason to take an older checkpoint. So
is a complete.json of another format (CHECKPOINT_FORMAT), of another shape or of a newer version
(`check_manifest`), a `latest` naming anything but a tag directory of its own, and a tag that is
a symbolic link: one line each, before any process group starts.
"""
import dataclasses
import json
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from data.fingerprint import fingerprint_changes
from launch.checkpoints.manifest import COMPLETE, ENGINE_ZERO_STAGE, shown_value, read_complete
from launch.errors import ConfigError
from model.config import ARCH_SWITCHES, ModelConfig

LATEST = "latest"
TAG = re.compile(r"step(\d{8})")


def saved_zero_stage(meta: Dict[str, Any]) -> int:
    return meta[ENGINE_ZERO_STAGE]


def _built_zero_stage(recipe_dict: Dict[str, Any], layout: Dict[str, Any]) -> int:
    """The stage launch/engine/ds_config.py builds: built_zero_stage, unless the recipe's deepspeed
    section sets one."""
    from launch.analysis.engine_memory import built_zero_stage
    train = recipe_dict["train"]
    built = built_zero_stage(train["zero_stage"], train["precision"], layout["dp"] * layout["cp"],
                             ModelConfig(**recipe_dict["model"]).moe.enabled)
    return (recipe_dict.get("deepspeed") or {}).get("zero_optimization", {}).get("stage", built)


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def step_of(tag: str) -> Optional[int]:
    match = TAG.fullmatch(tag)
    return int(match.group(1)) if match else None


@dataclass
class CheckpointRef:
    """A complete checkpoint on disk and what complete.json says about it."""
    root: Path
    tag: str
    meta: Dict[str, Any]

    @property
    def path(self) -> Path:
        return self.root / self.tag


def find_checkpoint(load: Path) -> CheckpointRef:
    """The checkpoint `--load` names, verified against its manifest of file sizes."""
    ref = _locate(load)
    for name, size in ref.meta["files"].items():
        path = ref.path / name
        actual = path.stat().st_size if path.is_file() else None
        if actual != size:
            found = "missing" if actual is None else f"{actual} bytes"
            raise ConfigError(f"checkpoint {str(ref.path)!r} is damaged: {name!r} is {found}, expected {size} bytes; "
                              f"load an older checkpoint (a tag directory) instead")
    return ref


def find_resume_point(load: Path, save: Optional[Path], is_writer: bool) -> Optional[CheckpointRef]:
    """The checkpoint `--load` resumes from, or None where `--load` and `--save` name one directory
    that holds no checkpoint yet (missing, empty, or only saves cut short and set aside): then the
    run starts at step 1 and says so, so that a scheduler can rerun one command line after a
    preemption or a failure. A `--load` of its own that holds nothing stays an error (a typo)."""
    requeued = save is not None and load.resolve() == save.resolve()
    if requeued and _no_checkpoint_yet(load):
        if is_writer:
            print(f"--load {load}: no checkpoint there yet; starting at step 1 (rerun the same command to "
                  f"resume from its checkpoints)", flush=True)
        return None
    if requeued and load.is_dir() and not (load / LATEST).exists():
        newest = _newest_of_one_run(load)
        if newest is not None:  # a save killed between its complete.json and `latest` (the first one has none)
            if is_writer:
                print(f"--load {load}: no {LATEST} file; resuming from {newest}, the newest complete checkpoint, "
                      f"whose history holds every other one there", flush=True)
            return find_checkpoint(load / newest)
    return find_checkpoint(load)


def resumes_from(ref: Optional[CheckpointRef], root: Path) -> bool:
    """Whether the run resumes from a tag directory of save directory `root` (`--load root`, or
    `--load root/stepNNNNNNNN`): then `root` holds this run's own history."""
    return ref is not None and step_of(ref.tag) is not None and ref.root.resolve() == root.resolve()


def refuse_another_runs_save_dir(save: Path, resume_from: Optional[CheckpointRef]) -> None:
    """A save into a directory holding complete checkpoints, by a run that does not resume from one
    of them, is refused in one line: its start would move them aside and remove `latest`
    (store.prepare_save_dir), and `--keep-last` would then delete them. A requeue (`--save DIR
    --load DIR`) resumes from DIR's checkpoints, or finds none there and starts at step 1. Every
    rank calls this before the data and torch.distributed; it reads `save` and writes nothing.
    A tag after the resumed step that is a symbolic link (or no directory) is refused too, requeue
    or not: the set-aside leaves it (store._own), and the save of that step would write its files
    wherever the link leads."""
    if not save.is_dir():
        return
    resumed = resume_from.meta["step"] if resume_from is not None else 0
    blocking = next((p for p in sorted(save.iterdir()) if (step_of(p.name) or 0) > resumed and not_a_tag_dir(p)), None)
    if blocking is not None:
        raise ConfigError(f"--save {str(save)!r}: {not_a_tag_dir(blocking)}, where this run would save step "
                          f"{step_of(blocking.name)}; remove it or save into another directory")
    if resumes_from(resume_from, save):
        return
    complete = sorted(p.name for p in save.iterdir() if step_of(p.name) is not None and (p / COMPLETE).is_file())
    if complete:
        raise ConfigError(f"--save {str(save)!r} holds the checkpoints of another run (the latest: {complete[-1]}, "
                          f"step {step_of(complete[-1])}), which this run would move aside: pass --load "
                          f"{str(save)!r} to resume that run, --save another directory, or remove them")


def not_a_tag_dir(path: Path) -> Optional[str]:
    """None when `path` is missing or a real directory, else what it is, for a one-line message:
    a save into a tag directory that is a symbolic link writes its files wherever it leads."""
    if path.is_symlink():
        return f"{path.name!r} is a symbolic link to {os.readlink(path)!r}, which a save would write through"
    return f"{path.name!r} is not a directory" if path.exists() and not path.is_dir() else None


def own_tag(root: Path, tag: Any) -> bool:
    """Whether `tag` names a tag directory of `root` itself: a `stepNNNNNNNN` name (no `/`, no `..`)
    that is no symbolic link, so the directory lies in `root` and is nowhere else."""
    return isinstance(tag, str) and step_of(tag) is not None and not (root / tag).is_symlink()


def history(root: Path, tag: Optional[str]) -> List[Path]:
    """The tag directories of `tag`'s history in `root`, newest first: each complete.json names
    its parent. A manifest that cannot be read ends the walk: pruning only deletes what it is sure of.
    So does a parent that is no tag directory of `root` (`own_tag`): a checkpoint copied from another
    directory can name "../other-run/step00000003", an absolute path or a link, and pruning would
    move that run's checkpoint in and delete it. The chain ends there, without an error: what lies
    outside `root` is not this run's to prune, and training goes on."""
    chain: List[Path] = []
    while own_tag(root, tag) and (root / tag / COMPLETE).is_file() and root / tag not in chain:
        chain.append(root / tag)
        try:
            tag = json.loads((root / tag / COMPLETE).read_text(encoding="utf-8")).get("parent")
        except (OSError, ValueError, AttributeError, RecursionError) as e:
            print(f"warning: the history of {str(root / tag)!r} stops there: its {COMPLETE} cannot be read "
                  f"({type(e).__name__}: {shown_value(str(e))[1:-1]})",
                  file=sys.stderr, flush=True)
            break
    return chain


def _newest_of_one_run(root: Path) -> Optional[str]:
    """The newest complete tag of `root` when every complete tag there lies in its history (the parent
    chain of the manifests: one run's saves), else None (which continues the run is not recorded)."""
    complete = sorted(p.name for p in root.iterdir()
                      if own_tag(root, p.name) and p.is_dir() and (p / COMPLETE).exists())
    if not complete:
        return None
    chain = {p.name for p in history(root, complete[-1])}
    return complete[-1] if chain >= set(complete) else None


HANG_STACKS = "hang-stacks"
"""Where launch/resilience/hang_watchdog.py writes every rank's stacks, beside the checkpoints."""
STARTS = "starts.jsonl"
"""The save directory's record of the run's starts and how each ended (launch/resilience/restarts.py)."""


def _no_checkpoint_yet(root: Path) -> bool:
    """Missing, or a directory of only unfinished tag directories, abandoned-* ones, the hang
    watchdog's stacks and the record of starts (a run that failed or hung before its first save is
    requeued as a fresh one)."""
    if not root.exists():
        return True
    return root.is_dir() and all(p.name == STARTS or p.name.startswith(f".{STARTS}.tmp") or  # (killed mid-write)
                                 p.is_dir() and (p.name.startswith("abandoned-") or p.name == HANG_STACKS or
                                                 (step_of(p.name) is not None and not (p / COMPLETE).exists()))
                                 for p in root.iterdir())


def _locate(load: Path) -> CheckpointRef:
    """`load` is a save directory (the checkpoint its `latest` names) or one tag directory."""
    if not load.is_dir():
        raise ConfigError(f"--load {str(load)!r}: no such directory")
    if load.is_symlink() and (load / COMPLETE).exists():
        raise ConfigError(f"--load {str(load)!r} is a symbolic link to a checkpoint, {str(load.resolve())!r}: a "
                          f"checkpoint is a real directory in its save directory (a save or --keep-last there "
                          f"would reach through a link); load it where it lies: --load {_shell_arg(load.resolve())}")
    meta = read_complete(load)
    if meta is not None:
        return CheckpointRef(load.parent, load.name, meta)
    if (load / LATEST).exists():
        tag = _latest_of(load)
        meta = read_complete(load / tag) if (load / tag).is_dir() else None
        if meta is None:
            raise ConfigError(f"--load {str(load)!r}: its {LATEST} names {tag!r}, which is not a complete checkpoint "
                              f"in it; load a checkpoint (a tag directory) explicitly")
        return CheckpointRef(load, tag, meta)
    complete = sorted(p.name for p in load.iterdir() if p.is_dir() and not p.is_symlink() and (p / COMPLETE).exists())
    if complete:  # no `latest`: which of them continues the run is not recorded, so do not guess
        raise ConfigError(f"--load {str(load)!r} has no {LATEST} file but complete checkpoints "
                          f"({', '.join(map(repr, complete[-3:]))}); load one of them explicitly, e.g. --load "
                          f"{_shell_arg(load / complete[-1])}")
    if any(load.iterdir()):
        raise ConfigError(f"--load {str(load)!r} holds no complete checkpoint (no {COMPLETE}); "
                          f"it is not a checkpoint directory or every save in it was interrupted")
    raise ConfigError(f"--load {str(load)!r} is empty: no checkpoint to resume from")


def _latest_of(load: Path) -> str:
    """The tag `load`/latest names: a tag directory of `load` itself (`own_tag`), so that a `latest`
    naming "../other-run/step00000005", an absolute path or a link never leads out of `load`."""
    try:
        tag = (load / LATEST).read_text(encoding="utf-8").strip()
    except (OSError, ValueError) as e:  # ValueError: not UTF-8
        raise ConfigError(f"--load {str(load)!r}: its {LATEST} cannot be read ({type(e).__name__}: "
                          f"{shown_value(str(e))[1:-1]}); load a checkpoint (a tag directory) explicitly") from None
    if not own_tag(load, tag):
        raise ConfigError(f"--load {str(load)!r}: its {LATEST} names {shown_value(tag)}, which is no tag directory of it "
                          f"(stepNNNNNNNN, no path, no symbolic link); load a checkpoint (a tag directory) explicitly")
    return tag


def _shell_arg(path: Path) -> str:
    """`path` as an argument of a command line to copy: quoted for a shell, escaped (repr) when it
    holds control characters, which a message must not print raw."""
    return shlex.quote(str(path)) if str(path).isprintable() else repr(str(path))


def data_position(ref: CheckpointRef, fingerprint: Dict[str, Any], restart: bool) -> Tuple[Optional[dict], int]:
    """(the streams' saved position or None, the samples trained before the current data order
    began) to continue from `ref`. Its data fingerprint (data/fingerprint.py) must equal this
    run's, else the position would re-deal the samples: refused in one line naming what changed.
    `restart` (--restart-data) starts the data order again at the resume step instead."""
    samples = ref.meta["samples"]
    if restart:
        return None, samples
    saved = ref.meta["data_fingerprint"]  # null: saved with no data behind it (store.save's default)
    changes = fingerprint_changes(saved, fingerprint) if saved is not None else []
    if changes:
        more = f" and {len(changes) - 3} more" if len(changes) > 3 else ""
        raise ConfigError(f"checkpoint {str(ref.path)!r} was saved with other data: {'; '.join(changes[:3])}{more}; "
                          f"its data position would deal other samples (some trained twice, others never): resume "
                          f"with the data it was saved with, or pass --restart-data to start the data order again "
                          f"at step {ref.meta['step'] + 1}")
    return ref.meta["data_state"], ref.meta["data_origin_samples"]


def same_layout(saved: Dict[str, Any], layout: Dict[str, Any]) -> bool:
    """Same (tp, pp, dp, cp, ep) and the same stage boundaries: DeepSpeed's own loader restores each
    rank's flat ZeRO-1 partition, which holds the parameters of that rank's layers (and, with
    experts, its EP rank's experts), so another cut of the pipeline at the same layout re-shards too.
    So do another train.virtual_stages and another cut of the chunks: at v > 1 a rank's partition holds
    its v chunks' parameters."""
    return (all(saved[k] == layout[k] for k in ("tp", "pp", "dp", "cp", "ep", "virtual_stages"))
            and all(list(saved[k]) == list(layout[k]) for k in ("parts", "chunk_parts")))


def _ep(layout: Dict[str, Any]) -> str:
    return f" ep={layout['ep']}" if layout["ep"] > 1 else ""


def check_compatible(ref: CheckpointRef, recipe_dict: Dict[str, Any], layout: Dict[str, int]) -> None:
    """The model shape, the global batch and the optimizer must match the checkpoint's; another
    layout or ZeRO stage re-shards (launch/checkpoints/reshard.py), which reads and writes ZeRO-1
    (and the bf16 optimizer's) state and fp32 ZeRO-0's of a dense model. Say which key differs."""
    # Compared with every architecture switch filled from its preset (the run's recipe may leave them null).
    saved_model, model = (dataclasses.asdict(ModelConfig(**section).resolved())
                          for section in (ref.meta["recipe"]["model"], recipe_dict["model"]))
    # Free to change on resume: they leave every weight's shape and TP shard as they are.
    free = ("dropout", "sequence_parallel")
    # The shape first, then the switches (a different n_embd also changes the derived ffn_hidden_size).
    for key in sorted(set(saved_model) | set(model), key=lambda k: (k in ARCH_SWITCHES, k)):
        if saved_model.get(key) != model.get(key) and key not in free:
            raise ConfigError(f"checkpoint {str(ref.path)!r} has model.{key}={saved_model.get(key)!r}, this run "
                              f"{model.get(key)!r}: a checkpoint only resumes the model it was saved from")
    saved_batch, batch = ref.meta["recipe"]["train"]["global_batch_size"], recipe_dict["train"]["global_batch_size"]
    if saved_batch != batch:
        raise ConfigError(f"checkpoint {str(ref.path)!r} has train.global_batch_size={saved_batch}, this run {batch}: "
                          f"the data position and the LR schedule count steps of that batch; resume with "
                          f"--set train.global_batch_size={saved_batch}")
    optimizers = (ref.meta["recipe"]["train"]["optimizer"], recipe_dict["train"]["optimizer"])
    if optimizers[0] != optimizers[1]:
        raise ConfigError(f"checkpoint {str(ref.path)!r} has train.optimizer={optimizers[0]}, this run "
                          f"{optimizers[1]}: the optimizer state is that optimizer's; resume with --set "
                          f"train.optimizer={optimizers[0]}")
    saved, stages = ref.meta["layout"], (saved_zero_stage(ref.meta), _built_zero_stage(recipe_dict, layout))
    if same_layout(saved, layout) and stages[0] == stages[1]:
        return  # DeepSpeed's own loader
    sides = [("checkpoint", ref.meta["recipe"], stages[0]), ("run", recipe_dict, stages[1])]
    for side, recipe, stage in sides:
        moe = ModelConfig(**recipe["model"]).moe.enabled
        if stage == 0 and (recipe["train"]["precision"] == "fp16" or moe):
            what = "a mixture of experts" if moe else "fp16"
            raise ConfigError(
                f"checkpoint {str(ref.path)!r} was saved at tp={saved['tp']} pp={saved['pp']} dp={saved['dp']}"
                f"{_ep(saved)} with ZeRO-{stages[0]}, this run is tp={layout['tp']} pp={layout['pp']} dp={layout['dp']}"
                f"{_ep(layout)} with ZeRO-{stages[1]}, stage boundaries {list(saved['parts'])} and this run "
                f"{list(layout['parts'])}: re-sharding {what} needs ZeRO-1 on both sides, and the {side}'s is "
                f"ZeRO-0; resume at the saved layout with --set train.zero_stage={ref.meta['recipe']['train']['zero_stage']} "
                f"(and its cut: --set train.partition=[blocks per stage])")
