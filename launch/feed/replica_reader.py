"""One reader per replica: of the ranks that draw a replica's micro-batches,
only the first stage's TP rank 0, CP rank 0 reads and tokenizes streamed data; it broadcasts
each micro-batch, (b, seq_len) input and label ids, to the others over small groups.

Who draws: DeepSpeed's pipeline loads micro-batches on the first stage (the inputs) and on the
last (the labels); every TP rank of those stages draws, and each CP rank draws whole micro-batches
and keeps its sequence shard. Were each of them to read, a replica's data would be read and
tokenized tp x cp x (2 when pp > 1) times.

The groups, for replica d (its data indices d*cp .. d*cp + cp - 1 in DeepSpeed's topology):
- the first stage's tp x cp ranks, the reader lowest (group rank 0);
- at pp > 1, the reader and the last stage's tp x cp ranks.
The reader broadcasts over the first, then the second; every other drawing rank is in exactly one.
The last stage draws a step's micro-batches when the step starts (launch/feed/step_tokens.py),
so at pp > 1 the first stage does too, and the broadcasts pair up in the same order. Cached data
is a memory-mapped slice every rank reads cheaply: no groups, no broadcasts."""
from __future__ import annotations

from typing import TYPE_CHECKING, List, Tuple

if TYPE_CHECKING:
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    from model.parallel.state import ParallelState


def replica_readers(topology: PipeModelDataParallelTopology, tp: int, pp: int, dp: int, cp: int
                    ) -> List[Tuple[int, List[List[int]]]]:
    """Per data replica, in order: (the rank that reads its data, the rank lists it broadcasts
    micro-batches over): its first stage's tp x cp ranks, and at pp > 1 itself with the last
    stage's. Pure: a 1,024-rank job can be dealt in one process (tests/data/test_dealing_at_scale.py)."""
    readers = []
    for replica in range(dp):
        def stage_ranks(pipe: int) -> List[int]:
            return sorted(topology.get_rank(pipe=pipe, data=replica * cp + c, model=t)
                          for c in range(cp) for t in range(tp))
        first = stage_ranks(0)
        groups = [first] if tp * cp > 1 else []
        if pp > 1:
            groups.append([first[0]] + stage_ranks(pp - 1))
        readers.append((first[0], groups))
    return readers


def replica_reader_groups(state: ParallelState, streamed: bool) -> Tuple[List, bool]:
    """(the groups this rank broadcasts a replica's micro-batches over, whether it reads); ([],
    True) where every rank reads for itself: cached data, or a replica of one drawing rank.
    Collective: every rank creates every replica's groups, in the same order."""
    import torch.distributed as dist
    if not streamed or (state.tp_size * state.cp_size == 1 and state.pp_size == 1):
        return [], True
    me, mine, reads = state.global_rank, [], True
    for reader, groups in replica_readers(state.topology, state.tp_size, state.pp_size, state.dp_size,
                                          state.cp_size):
        for ranks in groups:
            group = dist.new_group(ranks)
            if me in ranks:
                mine.append(group)
        if me != reader and any(me in ranks for ranks in groups):
            reads = False
    return mine, reads
