"""Stragglers named, cheaply at thousands of ranks.

Each step every rank gives five numbers, gathered by ONE all-gather of a (world x 5) float64
tensor (`gather_step_numbers`): its compute seconds (launch/instruments/compute_clock.py), its
seconds waited on data, its step's peak allocated and reserved bytes, and whether it received a
stop signal; the maxima of the last three are the record's memory peaks and the ranks' agreed stop
(launch/resilience/signals.py), so the step needs no second collective for them.

**The unit judged is the in-pass group** (`in_pass_group`): the ranks that wait on each other
inside a forward or backward pass, the TP x CP ranks of one replica of a stage (with expert
parallelism, the replicas one EP group's all-to-all joins too). A slow rank's peers wait for it
inside its all-reduces and all-to-alls, and the compute clock counts that wait as theirs: the
group is slow as one, so it is named as one. Its time is the median of its ranks' compute
seconds; a group above FACTOR x the median of the OTHER groups of its pipeline stage for STREAK
consecutive steps gets one warning line, once per slow spell. Stages differ in work (the head,
the embedding), so groups are never compared across stages. A stage of one group (dp = cp = 1,
or an EP group as wide as the data axis) has nothing to compare with and is not judged: there a
slow rank is seen only as a slow step (step_time_s, and the compute_s summary's max).

**A slow data reader is named**: a rank whose wait on data is above DATA_SHARE of the step time
for STREAK steps in a row gets one line per spell (its rank and host, not only the step's max).

Cost at 4,096 ranks (bench/faults/straggler_watch.py): the watch holds O(world) numpy arrays and
judges a step with two sorts (ranks by group, groups by stage); each group's leave-one-out
median is read from its stage's sorted times in O(1). Comparing every
rank with every other rank of its stage would cost seconds per step and O(world^2) memory."""
import math
import socket
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np

FACTOR, STREAK = 1.5, 5
DATA_SHARE = 0.2
"""A rank waiting on data for more than this share of the step, STREAK steps in a row, is named:
a read-ahead that keeps up makes the wait ~0 (data/prefetch.py), so 20% is a reader falling behind."""
MOST_RUNS, MOST_HOSTS = 6, 4  # a line names this many rank runs / hosts, then counts the rest


@dataclass
class StepNumbers:
    """One step's numbers of every rank (position = rank) and the memory peaks over all ranks."""
    compute_s: np.ndarray
    data_wait_s: np.ndarray
    peak_allocated: int
    peak_reserved: Optional[int]  # None when no rank's device reports reserved memory
    stop_requested: bool  # any rank was signalled to stop (launch/resilience/signals.py)


def gather_step_numbers(compute_s: float, data_wait_s: float, allocated: int, reserved: Optional[int],
                        stop_requested: bool, device) -> StepNumbers:
    """Every rank's (compute seconds, data-wait seconds), the largest allocated / reserved bytes,
    and whether any rank asks to stop: one all-gather of 5 float64 per rank (collective: every rank
    calls it). float64 holds byte counts exactly up to 2^53 (8 PiB)."""
    import torch
    import torch.distributed as dist

    from model.parallel.torch_compat import all_gather_single
    mine = torch.tensor([compute_s, data_wait_s, allocated, -1 if reserved is None else reserved, float(stop_requested)],
                        dtype=torch.float64, device=device)
    every = torch.empty(dist.get_world_size() * mine.numel(), dtype=torch.float64, device=device)  # flat: gloo refuses 2-D
    all_gather_single(every, mine)
    table = every.cpu().numpy().reshape(-1, mine.numel())
    top_reserved = int(table[:, 3].max())
    return StepNumbers(compute_s=table[:, 0].copy(), data_wait_s=table[:, 1].copy(),
                       peak_allocated=int(table[:, 2].max()), peak_reserved=None if top_reserved < 0 else top_reserved,
                       stop_requested=bool(table[:, 4].max() > 0))


def in_pass_group(state) -> int:
    """The id of this rank's in-pass group (module docstring): the smallest global rank in it.

    In DeepSpeed's (pipe, data, model) topology a replica's TP x CP ranks are the cp data indices
    [d * cp, (d + 1) * cp) of one stage, every model index; an EP group is a run of ep data indices
    (model/parallel/state.py). Runs of cp and of ep merge into runs of lcm(cp, ep) data indices:
    two runs are split only where a boundary is one of both. The id is the rank at model 0 of
    the run's first data index."""
    coord = state.topology.get_coord(state.global_rank)
    joined = math.lcm(state.cp_size, state.ep_size)
    return state.topology.get_rank(pipe=coord.pipe, data=coord.data // joined * joined, model=0)


def gather_rank_roles(stage: int, group: int) -> Dict[str, list]:
    """Every rank's pipeline stage, in-pass group and host name, once at start (collective):
    StragglerWatch(**gather_rank_roles(state.pp_rank, in_pass_group(state)))."""
    import torch.distributed as dist
    everyone: List[Optional[tuple]] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (stage, group, socket.gethostname()))
    return {"stages": [s for s, _, _ in everyone], "groups": [g for _, g, _ in everyone],
            "hosts": [h for _, _, h in everyone]}


def rank_ranges(ranks: Sequence[int]) -> str:
    """Ranks as runs, short at any size: '4-7', '0, 2, 4', '0-3, 8-11 and 5 more runs'."""
    runs: List[List[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs[:MOST_RUNS])
    return text + (f" and {len(runs) - MOST_RUNS} more runs" if len(runs) > MOST_RUNS else "")


def host_names(hosts: Sequence[str]) -> str:
    """Distinct hosts in order of first rank: 'b', 'a, b', 'a, b, c, d and 4 more hosts'."""
    distinct = list(dict.fromkeys(hosts))
    text = ", ".join(distinct[:MOST_HOSTS])
    return text + (f" and {len(distinct) - MOST_HOSTS} more hosts" if len(distinct) > MOST_HOSTS else "")


def sorted_medians(values: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The median of each segment [start, start + count) of `values`, each segment sorted; as
    statistics.median: the middle value, or the mean of the two middle values."""
    return (values[starts + (counts - 1) // 2] + values[starts + counts // 2]) / 2


class StragglerWatch:
    """Fed each step's compute seconds (and data waits) of every rank; returns the warning lines due.

    stages, groups, hosts: per rank (position = rank), as gather_rank_roles gives them; a group id
    is any int shared by the ranks of one in-pass group (all in one stage). `group_kind` words
    what a group of several ranks is (with experts: 'tensor/context/expert-parallel')."""

    def __init__(self, stages: Sequence[int], groups: Sequence[int], hosts: Sequence[str],
                 group_kind: str = "tensor/context-parallel"):
        self.stages = np.asarray(stages, dtype=np.int64)
        self.hosts, self.group_kind = list(hosts), group_kind
        group_ids, self.rank_group = np.unique(np.asarray(groups, dtype=np.int64), return_inverse=True)
        n_groups = len(group_ids)
        # Ranks by group: group g's ranks are members[group_start[g]:group_start[g] + group_size[g]].
        self.members = np.argsort(self.rank_group, kind="stable")
        self.group_size = np.bincount(self.rank_group, minlength=n_groups)
        self.group_start = np.concatenate([[0], np.cumsum(self.group_size)[:-1]])
        self.group_stage = self.stages[self.members[self.group_start]]
        if np.any(self.group_stage[self.rank_group] != self.stages):
            raise ValueError("an in-pass group spans pipeline stages: its ranks do different work")
        # Groups by stage: stage k's groups are positions [stage_start[k], +stage_groups[k]) of
        # one array sorted by (stage, time) each step.
        stage_ids, group_stage_index = np.unique(self.group_stage, return_inverse=True)
        stage_groups = np.bincount(group_stage_index, minlength=len(stage_ids))
        stage_start = np.concatenate([[0], np.cumsum(stage_groups)[:-1]])
        self.peer_start, self.peer_count = stage_start[group_stage_index], stage_groups[group_stage_index]
        self.judged = self.peer_count > 1  # a stage of one group has no other group to compare with
        others = self.peer_count - 1
        self.middle_low, self.middle_high = (others - 1) // 2, others // 2  # of the others, sorted
        self.group_streak = np.zeros(n_groups, dtype=np.int64)
        self.reader_streak = np.zeros(len(self.stages), dtype=np.int64)

    def group_seconds(self, compute_s: np.ndarray) -> np.ndarray:
        """Each group's time: the median of its ranks' compute seconds."""
        if len(self.group_size) == len(compute_s):  # one rank per group: group g is rank members[g]
            return compute_s[self.members]
        by_group = compute_s[np.lexsort((compute_s, self.rank_group))]
        return sorted_medians(by_group, self.group_start, self.group_size)

    def others_median(self, times: np.ndarray) -> np.ndarray:
        """For each group, the median of the other groups of its stage (NaN for a stage of one):
        with its stage's times sorted and its own at position p, the i-th other is at i or i + 1."""
        by_stage = np.lexsort((times, self.group_stage))
        ordered = times[by_stage]
        position = np.empty_like(by_stage)
        position[by_stage] = np.arange(len(by_stage))
        own = position - self.peer_start
        low = self.peer_start + self.middle_low + (self.middle_low >= own)
        high = self.peer_start + self.middle_high + (self.middle_high >= own)
        last = len(ordered) - 1  # a stage of one group points one past its own; the NaN below replaces it
        median = (ordered[np.minimum(low, last)] + ordered[np.minimum(high, last)]) / 2
        return np.where(self.judged, median, np.nan)

    def observe(self, step: int, compute_s: Sequence[float], data_wait_s: Optional[Sequence[float]] = None,
                step_time_s: Optional[float] = None) -> List[str]:
        """The lines due at this step: slow groups, then slow data readers (these only when the
        data waits and the step time are given)."""
        compute = np.asarray(compute_s, dtype=np.float64)
        times = self.group_seconds(compute)
        median = self.others_median(times)
        slow = self.judged & (times > FACTOR * np.where(self.judged, median, 0.0))
        self.group_streak = np.where(slow, self.group_streak + 1, 0)
        # once per slow spell: it warns again after a normal step
        lines = [self.slow_group_line(int(g), step, float(times[g]), float(median[g]))
                 for g in np.flatnonzero(self.group_streak == STREAK)]
        if data_wait_s is not None and step_time_s is not None and step_time_s > 0:
            waits = np.asarray(data_wait_s, dtype=np.float64)
            self.reader_streak = np.where(waits > DATA_SHARE * step_time_s, self.reader_streak + 1, 0)
            lines += [self.slow_reader_line(int(r), step, float(waits[r]), step_time_s)
                      for r in np.flatnonzero(self.reader_streak == STREAK)]
        return lines

    def slow_group_line(self, group: int, step: int, seconds: float, median: float) -> str:
        stage = int(self.group_stage[group])
        start = self.group_start[group]
        ranks = sorted(int(r) for r in self.members[start:start + self.group_size[group]])
        if len(ranks) == 1:
            return (f"warning: rank {ranks[0]} on {self.hosts[ranks[0]]} is a straggler: {seconds:.3f} s of compute "
                    f"at step {step}, more than {FACTOR}x the median {median:.3f} s of the other ranks of "
                    f"stage {stage}, for {STREAK} steps in a row")
        return (f"warning: ranks {rank_ranges(ranks)} on {host_names([self.hosts[r] for r in ranks])} (one "
                f"{self.group_kind} group of stage {stage}) are stragglers: {seconds:.3f} s of compute (their "
                f"median) at step {step}, more than {FACTOR}x the median {median:.3f} s of the other groups of "
                f"stage {stage}, for {STREAK} steps in a row; one of them is slow and its peers wait for it "
                f"inside the pass")

    def slow_reader_line(self, rank: int, step: int, waited: float, step_time_s: float) -> str:
        return (f"warning: rank {rank} on {self.hosts[rank]} is a slow data reader: it waited {waited:.3f} s "
                f"for data at step {step}, {waited / step_time_s:.0%} of the {step_time_s:.3f} s step, more than "
                f"{DATA_SHARE:.0%} for {STREAK} steps in a row; its data reader cannot keep up: raise "
                f"data.read_ahead_steps, or check that host's storage and network")


def summarise_seconds(seconds: Sequence[float], stages: Sequence[int]) -> Dict[str, object]:
    """A step's per-rank seconds as a metrics record keeps them at any world size (at
    4,096 ranks the list would be most of the record): the largest, the median and the rank with
    the largest (the first, on a tie), over all ranks and over each pipeline stage's ranks. Plain
    Python numbers: the record is JSON."""
    values = np.asarray(seconds, dtype=np.float64)
    stage_of = np.asarray(stages, dtype=np.int64)

    def summary(ranks: np.ndarray, ordered: np.ndarray) -> Dict[str, object]:
        slowest = int(ranks[np.argmax(values[ranks])])
        middle = len(ordered)
        return {"max": float(values[slowest]),
                "median": float((ordered[(middle - 1) // 2] + ordered[middle // 2]) / 2), "slowest_rank": slowest}
    by_stage = np.lexsort((values, stage_of))  # one sort: each stage's ranks, fastest first
    stage_ids, counts = np.unique(stage_of[by_stage], return_counts=True)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    per_stage = []
    for start, count in zip(starts, counts):
        ranks = by_stage[start:start + count]
        per_stage.append(summary(np.sort(ranks), values[ranks]))
    return dict(summary(np.arange(len(values)), np.sort(values)), by_stage=per_stage)


def slowest_data_reader(data_wait_s: Sequence[float]) -> Dict[str, object]:
    """The rank that waited longest on data this step (the first, on a tie) and its seconds: the
    record's data_wait_s is that max, and this names whose it is."""
    waits = np.asarray(data_wait_s, dtype=np.float64)
    rank = int(np.argmax(waits))
    return {"rank": rank, "seconds": float(waits[rank])}
