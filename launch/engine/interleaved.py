"""Interleaved 1F1B on one DeepSpeed pipeline engine (Narayanan et al. 2021, sec. 2.2.2): the rank's
GPTPipelineModule holds v chunks (model/gpt/pipe.py), and the engine runs Megatron-LM's order of
their passes (launch/analysis/interleaved_schedule.py) through DeepSpeed's own instruction handlers.

Each of DeepSpeed's instructions carries a `chunk` here. Around its handler the engine is made to
look like that chunk's stage: the module's current chunk; `is_first_stage` true only for rank 0's
chunk 0 and `is_last_stage` only for the last rank's chunk v - 1 (DeepSpeed reads them to load the
data, compute the loss and skip the sends); the peers (rank +- 1) mod pp, the last rank's chunk c
sending to rank 0's chunk c + 1 (DeepSpeed's p2p groups already pair them: `_build_p2p_groups`).

Sends do not block: Megatron's order needs a sender to go on before its receiver has posted the
receive (Megatron posts them with batch_isend_irecv); DeepSpeed's `p2p.send` blocks. Each send is an
`isend` waited at the step's end; receives block, as DeepSpeed's do. On each pair of ranks and
direction the sender sends its messages in the order the receiver receives them (at pp = 2
activations and gradients share the pair), so they match in order, untagged, on gloo and NCCL alike.
DeepSpeed's last stage keeps one `loss`, the last forward's: the order runs each last-chunk backward
right after its forward (both checked in tests/model/test_interleaved_schedule.py).
"""
from __future__ import annotations

from typing import Dict, Iterator, List

import torch.distributed as dist
from deepspeed.runtime.pipe import p2p, schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

from launch.analysis.interleaved_schedule import Pass, forward_order, interleaved_order, peak_in_flight, stage_of


SENDS = (schedule.SendActivation, schedule.SendGrad)
CHUNK_INSTRUCTIONS = (schedule.LoadMicroBatch, schedule.ForwardPass, schedule.BackwardPass, schedule.RecvActivation,
                      schedule.RecvGrad, *SENDS)


class WaitSends(schedule.PipeInstruction):
    """Wait until every send of the step has left (each is an `isend`: module docstring)."""


class InterleavedSchedule(schedule.PipeSchedule):
    """One rank's instructions for a step of interleaved 1F1B: `interleaved_order`'s passes, each
    with its receive before and its send after, one buffer per chunk-micro-batch in flight; or,
    with `train=False`, the forwards of an evaluation step (`forward_order`, any m)."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int, virtual_stages: int, train: bool = True):
        super().__init__(micro_batches, stages, stage_id)
        self.virtual_stages, self.train = virtual_stages, train
        order = interleaved_order if train else forward_order
        self.order: List[Pass] = order(stages, virtual_stages, micro_batches)[stage_id]

    def num_pipe_buffers(self) -> int:
        return peak_in_flight(self.order) if self.train else 1

    def steps(self) -> Iterator[List[schedule.PipeInstruction]]:
        last = self.stages * self.virtual_stages - 1
        free = list(range(self.num_pipe_buffers()))
        buffers: Dict[tuple, int] = {}
        for chunk, mb, kind in self.order:
            stage = stage_of(self.stage_id, chunk, self.stages)
            cmds: List[schedule.PipeInstruction] = []
            if kind == "F":
                buf = buffers[(chunk, mb)] = free.pop(0)
                if stage in (0, last):
                    cmds.append(schedule.LoadMicroBatch(buf, chunk=chunk))
                if stage != 0:
                    cmds.append(schedule.RecvActivation(buf, chunk=chunk))
                cmds.append(schedule.ForwardPass(buf, chunk=chunk))
                if stage != last:
                    cmds.append(schedule.SendActivation(buf, chunk=chunk))
                if not self.train:
                    free.append(buffers.pop((chunk, mb)))
            else:
                buf = buffers.pop((chunk, mb))
                if stage != last:
                    cmds.append(schedule.RecvGrad(buf, chunk=chunk))
                cmds.append(schedule.BackwardPass(buf, chunk=chunk))
                if stage != 0:
                    cmds.append(schedule.SendGrad(buf, chunk=chunk))
                free.append(buf)
            yield cmds
        if self.train:
            yield [WaitSends(), schedule.ReduceTiedGrads(), schedule.ReduceGrads(), schedule.OptimizerStep()]
        else:
            yield [WaitSends()]


class _Sends:
    """The step's sends in flight (each with its tensor, which must live until it is sent). Those
    done are let go at each new send: the (b, s, h) tensors of a step are not all held to its end."""

    def __init__(self) -> None:
        self.works: List[tuple] = []

    def add(self, work, tensor) -> None:
        self.works = [(w, t) for w, t in self.works if not w.is_completed()] + [(work, tensor)]

    def wait(self) -> None:
        for work, _ in self.works:
            work.wait()
        self.works = []


def _as_chunk(engine: PipelineEngine, chunk: int, handler, sends: bool, **kwargs) -> None:
    """Run DeepSpeed's `handler` as if this rank held only chunk `chunk`'s stage (module docstring)."""
    pp, rank, v = engine.num_stages, engine.stage_id, engine.module.virtual_stages
    engine.module.current_chunk = chunk
    engine.is_first_stage = lambda: rank == 0 and chunk == 0
    engine.is_last_stage = lambda: rank == pp - 1 and chunk == v - 1
    engine.prev_stage, engine.next_stage = (rank - 1) % pp, (rank + 1) % pp
    send = p2p.send
    if sends:  # DeepSpeed's handler, its p2p.send an isend (module docstring)
        grid = engine.grid

        def isend(tensor, dest_stage, async_op=False):
            engine._interleaved_sends.add(dist.isend(tensor, grid.stage_to_global(stage_id=dest_stage)), tensor)
        p2p.send = isend
    try:
        handler(engine, **kwargs)
    finally:
        p2p.send = send
        del engine.is_first_stage, engine.is_last_stage  # the class's again: the rank's own
        engine.prev_stage, engine.next_stage = rank - 1, rank + 1


def _chunk_handler(kind: type, handler):
    def run(engine: PipelineEngine, buffer_id: int, chunk: int) -> None:
        _as_chunk(engine, chunk, handler, kind in SENDS, buffer_id=buffer_id)
    return run


def _wait_sends(engine: PipelineEngine) -> None:
    engine._interleaved_sends.wait()


def use_interleaved_schedule(engine: PipelineEngine, virtual_stages: int) -> None:
    """Train and evaluate `engine` (whose module holds `virtual_stages` chunks) with interleaved 1F1B
    from its next `train_batch` or `eval_batch` on."""
    assert engine.module.virtual_stages == virtual_stages > 1 and engine.num_stages > 1
    rank, pp = engine.stage_id, engine.num_stages
    engine._interleaved_sends = _Sends()
    handlers = dict(engine._INSTRUCTION_MAP)
    for kind in CHUNK_INSTRUCTIONS:
        handlers[kind] = _chunk_handler(kind, handlers[kind])
    handlers[WaitSends] = _wait_sends
    engine._INSTRUCTION_MAP = handlers  # an instance attribute: `_exec_schedule` looks it up on the engine
    engine._train_schedule = lambda: InterleavedSchedule(micro_batches=engine.micro_batches, stages=pp,
                                                         stage_id=rank, virtual_stages=virtual_stages)
    engine._inference_schedule = lambda micro_batches: InterleavedSchedule(
        micro_batches=micro_batches, stages=pp, stage_id=rank, virtual_stages=virtual_stages, train=False)
