"""One reader per replica (issue 34, item 2): of the ranks that draw a replica's micro-batches,
only the first stage's TP rank 0, CP rank 0 reads and tokenizes streamed data; it broadcasts
each micro-batch, (b, seq_len) input and label ids, to the others over small groups.

Who draws: DeepSpeed's pipeline loads micro-batches on the first stage (the inputs) and on the
last (the labels); every TP rank of those stages draws, and each CP rank draws whole micro-batches
and keeps its sequence shard. Reading in each of them read and tokenized a replica's data
tp x cp x (2 when pp > 1) times, or cp x 2 with TP rank 0 sharing over TP as before.

The groups, for replica d (its data indices d*cp .. d*cp + cp - 1 in DeepSpeed's topology):
- the first stage's tp x cp ranks, the reader lowest (group rank 0);
- at pp > 1, the reader and the last stage's tp x cp ranks.
The reader broadcasts over the first, then the second; every other drawing rank is in exactly one.
The last stage draws a step's micro-batches when the step starts (launch/runtime/step_tokens.py),
so at pp > 1 the first stage does too, and the broadcasts pair up in the same order. Cached data
is a memory-mapped slice every rank reads cheaply: no groups, no broadcasts."""
from __future__ import annotations

from typing import TYPE_CHECKING, List, Tuple

if TYPE_CHECKING:
    from model.parallel.state import ParallelState


def replica_reader_groups(state: ParallelState, streamed: bool) -> Tuple[List, bool]:
    """(the groups this rank broadcasts a replica's micro-batches over, whether it reads); ([],
    True) where every rank reads for itself: cached data, or a replica of one drawing rank.
    Collective: every rank creates every replica's groups, in the same order."""
    import torch.distributed as dist
    topology, pp, cp = state.topology, state.pp_size, state.cp_size
    stage_size = state.tp_size * cp
    if not streamed or (stage_size == 1 and pp == 1):
        return [], True
    me, mine, reads = state.global_rank, [], True
    for replica in range(state.dp_size):
        def stage_ranks(pipe: int) -> List[int]:
            return sorted(topology.get_rank(pipe=pipe, data=replica * cp + c, model=t)
                          for c in range(cp) for t in range(state.tp_size))
        first = stage_ranks(0)
        reader = first[0]
        groups = [first] if stage_size > 1 else []
        if pp > 1:
            groups.append([reader] + stage_ranks(pp - 1))
        for ranks in groups:
            group = dist.new_group(ranks)
            if me in ranks:
                mine.append(group)
        if me != reader and any(me in ranks for ranks in groups):
            reads = False
    return mine, reads
