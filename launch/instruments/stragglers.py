"""Stragglers named (issue 23): a rank whose compute time per step (launch/instruments/
compute_clock.py) is above FACTOR x the median of its peers for STREAK consecutive steps gets
one warning line: rank, host, its time and the median. A straggler throttles every synchronous
job; on a thousand GPUs one is always there.

Its peers are the other ranks of its pipeline stage (the same layers, so the same work): stages
differ in work (the head, the embedding), so ranks are never compared across stages. A stage
of one rank (tp = dp = 1) has no peer and is not judged."""
import socket
import statistics
from typing import Dict, List, Optional, Sequence

FACTOR, STREAK = 1.5, 5


class StragglerWatch:
    """Fed each step's compute seconds of every rank; returns the warning lines due."""

    def __init__(self, stages: Sequence[int], hosts: Sequence[str]):
        self.stages, self.hosts = list(stages), list(hosts)
        self.peers = [[q for q, s in enumerate(self.stages) if s == stage and q != r]
                      for r, stage in enumerate(self.stages)]
        self.streak = [0] * len(self.stages)

    def observe(self, step: int, seconds: Sequence[float]) -> List[str]:
        lines = []
        for r, peers in enumerate(self.peers):
            if not peers:
                continue
            median = statistics.median(seconds[q] for q in peers)
            self.streak[r] = self.streak[r] + 1 if seconds[r] > FACTOR * median else 0
            if self.streak[r] == STREAK:  # once per slow spell: it warns again after a normal step
                lines.append(f"warning: rank {r} on {self.hosts[r]} is a straggler: {seconds[r]:.3f} s of compute "
                             f"at step {step}, more than {FACTOR}x the median {median:.3f} s of the other ranks of "
                             f"stage {self.stages[r]}, for {STREAK} steps in a row")
        return lines


def summarise_seconds(seconds: Sequence[float], stages: Sequence[int]) -> Dict[str, object]:
    """A step's per-rank seconds as a metrics record keeps them at any world size (issue 35: at
    4,096 ranks the list would be most of the record): the largest, the median and the rank with
    the largest, over all ranks and over each pipeline stage's ranks."""
    def summary(ranks: List[int]) -> Dict[str, object]:
        slowest = max(ranks, key=lambda r: seconds[r])
        return {"max": seconds[slowest], "median": statistics.median(seconds[r] for r in ranks),
                "slowest_rank": slowest}
    by_stage = [summary([r for r, s in enumerate(stages) if s == stage]) for stage in sorted(set(stages))]
    return dict(summary(list(range(len(seconds)))), by_stage=by_stage)


def gather_seconds(seconds: float, device) -> List[float]:
    """Every rank's `seconds`, in rank order: one all-gather of a float per rank (collective)."""
    import torch
    import torch.distributed as dist
    mine = torch.tensor([seconds], dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return torch.cat(every).tolist()


def gather_stage_hosts(stage: int) -> Dict[str, list]:
    """Every rank's (pipeline stage, host name), once at start (collective)."""
    import torch.distributed as dist
    everyone: List[Optional[tuple]] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (stage, socket.gethostname()))
    return {"stages": [s for s, _ in everyone], "hosts": [h for _, h in everyone]}
