"""Count what every torch.distributed collective moves, per training step, per purpose and group
(`--comm-counts`; docs/planner-and-metrics.md, "Communication counts").

`install_comm_counter(engine, state, out_dir)` wraps the torch.distributed entry points our model
code and DeepSpeed 0.19.8 (deepspeed.comm looks them up at call time) go through, and
`engine.train_batch`. Each call is recorded under (phase, purpose, role, op) with its calls,
elements and bytes: phase "step k" or "after step k" (nothing before the first step); purpose from
the calling function (PURPOSES, else "bookkeeping: <caller>"); role the group's axis in the
topology (tp, dp, pp, pp-p2p, world, self; cp and ep for context and expert parallelism's calls); payload the tensor this rank hands to the call. Each
rank writes OUT_DIR/rank{R}.json after every step; a measurement tool, not for production."""
from __future__ import annotations

import atexit
import functools
import importlib
import inspect
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Dict, Optional, Tuple

import torch.distributed as dist

if TYPE_CHECKING:  # annotations only: no import cost at run time
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    from model.parallel.state import ParallelState
    from types import FrameType

# Function -> the argument holding the payload: what this rank hands to the collective.
PAYLOAD_ARGUMENT = {
    "all_reduce": "tensor", "broadcast": "tensor", "reduce": "tensor",
    "all_gather": "tensor", "all_gather_into_tensor": "input_tensor",
    "reduce_scatter": "input_list", "reduce_scatter_tensor": "input",
    "all_gather_single": "input_tensor", "reduce_scatter_single": "input",  # torch 2.13's names of the two above
    "send": "tensor", "recv": "tensor", "isend": "tensor", "irecv": "tensor",
    "all_to_all_single": "input",  # context parallelism's exchanges (model/parallel/mappings.py)
}
POINT_TO_POINT = {"send": "dst", "isend": "dst", "recv": "src", "irecv": "src"}

# The innermost calling function (qualified name) that names the purpose of a call; the keys of
# launch/analysis/comm_formulas.py. Calls from anywhere else are bookkeeping (loss, grad norm, metrics).
PURPOSES = {
    "_ReduceFromTP.forward": "tp-forward",  # row-parallel outputs, the embedding
    "_CopyToTP.backward": "tp-backward",  # input grads of the MoE experts' inputs
    "_OverlappedLinears.backward": "tp-backward",  # input grads of column-parallel layers and the head
    "_PaddedVocabLogits.backward": "tp-backward",  # the head's, on a shard with padding rows
    "_GatherFromTP.forward": "tp-gather",
    "_GatherRowsFromTP.forward": "tp-kv-gather",  # key/value heads shared by TP ranks (model/transformer/llama.py)
    "_GatherRowsFromTP.backward": "tp-kv-grads",  # their gradients, reduce-scattered
    "_VocabParallelCrossEntropy.forward": "tp-loss",  # max, sum-exp, target logit
    "all_gather_sequence": "sp-gather",  # sequence parallelism (model/parallel/mappings.py), both directions
    "reduce_scatter_sequence": "sp-scatter",
    "PipelineEngine._send_tensor_meta": "pp-shape",
    "PipelineEngine._recv_tensor_meta": "pp-shape",
    "PipelineEngine._exec_send_activations": "pp-activations",
    "PipelineEngine._exec_recv_activations": "pp-activations",
    "PipelineEngine._exec_send_grads": "pp-grads",
    "PipelineEngine._exec_recv_grads": "pp-grads",
    "PartitionedTensor.full": "pp-tp-gather",  # a stage tensor sent as 1/t per TP rank, re-assembled
    "PipelineEngine._exec_reduce_tied_grads": "tied-grads",
    "DeepSpeedZeroOptimizer.allreduce_bucket": "dp-grads",
    "DeepSpeedEngine.allreduce_bucket": "dp-grads",  # fp32 ZeRO-0 and the BF16 optimizer's fp32 buffers
    "all_gather_into_tensor_dp_groups": "dp-params",
    "all_gather_dp_groups": "dp-params",
    # Context parallelism (Ulysses): sequence shards to head shards and back, each the other's backward.
    "_SequenceToHeads.forward": "cp-forward",
    "_HeadsToSequence.forward": "cp-forward",
    "_SequenceToHeads.backward": "cp-backward",
    "_HeadsToSequence.backward": "cp-backward",
    "all_gather_context": "cp-segments",  # the document mask's segment ids of the whole sequence
    # OLMoE's q/k norm over the whole projection: the sum of squares over TP, both directions (model/transformer/llama.py).
    "_AllReduceSum.forward": "tp-qk-norm",
    "_AllReduceSum.backward": "tp-qk-norm",
    # Expert parallelism (model/transformer/moe.py): the counts, the rows to the experts' ranks and back, both directions.
    "exchange_counts": "ep-counts",
    "_TokensToExperts.forward": "ep-dispatch",
    "_TokensToExperts.backward": "ep-dispatch",
    "_TokensFromExperts.forward": "ep-combine",
    "_TokensFromExperts.backward": "ep-combine",
}
BOOKKEEPING = "bookkeeping: "
_COMM_LAYERS = ("torch/distributed/", "deepspeed/comm/", "launch/instruments/comm_counter.py")


def purpose_of_call(frame: Optional[FrameType]) -> str:
    """PURPOSES entry of the innermost matching caller, else 'bookkeeping: <first caller>'."""
    first_caller = None
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if not any(layer in path for layer in _COMM_LAYERS):
            name = frame.f_code.co_qualname
            if name in PURPOSES:
                return PURPOSES[name]
            first_caller = first_caller or name
        frame = frame.f_back
    return BOOKKEEPING + str(first_caller)


class CommCounter:
    def __init__(self, topology: PipeModelDataParallelTopology, rank: int, out_dir: Path):
        self.topology = topology
        self.rank = rank
        self.path = Path(out_dir) / f"rank{rank}.json"
        self.phase = "before step 1"
        self.step = 0
        # phase -> (purpose, role, op) -> [calls, elements, bytes]
        self.counts: Dict[str, Dict[Tuple[str, str, str], list]] = defaultdict(lambda: defaultdict(lambda: [0, 0, 0]))
        self._roles: Dict[Tuple[int, ...], str] = {}

    # ------------------------------------------------------------ groups

    def role(self, ranks: Tuple[int, ...]) -> str:
        if ranks not in self._roles:
            coords = [self.topology.get_coord(r) for r in ranks]
            varying = {axis for axis in ("pipe", "data", "model") if len({getattr(c, axis) for c in coords}) > 1}
            if not varying:
                role = "self"
            elif len(varying) == 1:  # also when that axis is the whole world
                role = {"pipe": "pp", "data": "dp", "model": "tp"}[varying.pop()]
            elif len(ranks) == self.topology.world_size():
                role = "world"
            else:
                role = "+".join(sorted(varying))
            self._roles[ranks] = role
        return self._roles[ranks]

    def record(self, op: str, bound: inspect.BoundArguments, frame: Optional[FrameType]) -> None:
        payload = bound.arguments[PAYLOAD_ARGUMENT[op]]
        tensors = payload if isinstance(payload, (list, tuple)) else [payload]
        elements = sum(t.numel() for t in tensors)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        purpose = purpose_of_call(frame)
        if op in POINT_TO_POINT:
            role = "pp-p2p" if self.role((self.rank, bound.arguments[POINT_TO_POINT[op]])) == "pp" else "p2p"
        else:
            group = bound.arguments.get("group")
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(
                range(dist.get_world_size()))
            # CP and EP groups lie inside DeepSpeed's data axis (model/parallel/state.py), and at dp = 1
            # may be that axis: name them by what the call is for, as the planner does.
            role = purpose[:2] if purpose.startswith(("cp-", "ep-")) else self.role(ranks)
        entry = self.counts[self.phase][(purpose, role, op)]
        entry[0] += 1
        entry[1] += elements
        entry[2] += nbytes

    # ------------------------------------------------------------ installation

    def wrap(self, op: str, original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def counted(*args, **kwargs):
            self.record(op, signature.bind(*args, **kwargs), sys._getframe(1))
            return original(*args, **kwargs)
        counted.comm_counter_original = original
        return counted

    def install(self, engine: PipelineEngine) -> None:
        for op in PAYLOAD_ARGUMENT:
            if hasattr(dist, op):  # the *_single names are torch 2.13's (model/parallel/torch_compat.py)
                setattr(dist, op, self.wrap(op, getattr(dist, op)))
        # DeepSpeed's TorchBackend caches these two functions when it is built: wrap the cached ones.
        backend = importlib.import_module("deepspeed.comm.comm").cdb
        for attribute, op in (("all_gather_function", "all_gather_into_tensor"),
                              ("reduce_scatter_function", "reduce_scatter_tensor")):
            cached = getattr(backend, attribute, None)
            if cached is not None and op in getattr(cached, "__name__", ""):
                setattr(backend, attribute, self.wrap(op, cached))

        train_batch = engine.train_batch

        @functools.wraps(train_batch)
        def counted_train_batch(*args, **kwargs):
            self.step += 1
            self.phase = f"step {self.step}"
            try:
                return train_batch(*args, **kwargs)
            finally:
                self.phase = f"after step {self.step}"
                self.write()
        engine.train_batch = counted_train_batch
        atexit.register(self.write)

    # ------------------------------------------------------------ output

    def to_dict(self) -> dict:
        coord = self.topology.get_coord(self.rank)
        return {"rank": self.rank,
                "coord": {"pipe": coord.pipe, "data": coord.data, "model": coord.model},
                "phases": {phase: [{"purpose": purpose, "role": role, "op": op,
                                    "calls": calls, "elements": elements, "bytes": nbytes}
                                   for (purpose, role, op), (calls, elements, nbytes) in sorted(entries.items())]
                           for phase, entries in self.counts.items()}}

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        tmp.replace(self.path)


def install_comm_counter(engine: PipelineEngine, state: ParallelState, out_dir: Optional[Path]) -> Optional[CommCounter]:
    """Count this rank's communication from now on into out_dir/rank{R}.json; None: do nothing."""
    if out_dir is None:
        return None
    counter = CommCounter(state.topology, state.global_rank, out_dir)
    counter.install(engine)
    return counter

