"""The predicted pipeline schedule: the instruction streams DeepSpeed's engine executes (1F1B's
TrainSchedule, or ZB-H1's, launch/analysis/zero_bubble_schedule.py), played with given pass times.

Each stage runs its own stream in order. A forward, backward, B or W pass takes its stage's time
for it; a send and the matching receive on the neighbouring stage complete together, when the
later of the two is posted (blocking point-to-point, as DeepSpeed's sends and receives pair up),
and take no time. The result is a list of events (stage, kind, micro-batch, start, end), kind
"F", "B" (1F1B's whole backward, or ZB-H1's input-gradient pass) or "W", for
launch/analysis/pipeline_chart.py to draw and `idle_fraction` to measure. (Both live here, not
with the chart: the planner runs at every training run's start and needs no matplotlib, ~0.7 s.)

With equal stages this gives 1F1B's bubble (p-1)/(m+p-1) (Narayanan et al. 2021) and, when
T_F = T_B = T_W, ZB-H1's (p-1)(T_F+T_B-T_W) (Qi et al. 2023, sec. 3.1): tests/model/test_zero_bubble.py.
"""
import functools
import os
from typing import Dict, List, Sequence, Tuple, Union

Event = Tuple[int, str, int, float, float]  # (stage, "F" | "B" | "W", microbatch, start, end)
Times = Union[float, Sequence[float]]


def idle_fraction(events: Sequence[Event]) -> float:
    """Share of stage-time spent idle between the first start and the last end (the bubble)."""
    stages = {e[0] for e in events}
    span = max(e[4] for e in events) - min(e[3] for e in events)
    busy = sum(e[4] - e[3] for e in events)
    return 1.0 - busy / (len(stages) * span)


def instruction_streams(schedule: str, pp: int, microbatches: int) -> List[list]:
    """Every stage's instructions for one step, from the schedule classes the engine runs."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's schedule classes need no device
    from deepspeed.runtime.pipe.schedule import TrainSchedule

    from launch.analysis.zero_bubble_schedule import ZeroBubbleH1Schedule
    from launch.config.layout import runs_zero_bubble
    cls = ZeroBubbleH1Schedule if runs_zero_bubble(schedule, pp) else TrainSchedule
    return [[cmd for step in cls(micro_batches=microbatches, stages=pp, stage_id=k) for cmd in step]
            for k in range(pp)]


@functools.lru_cache(maxsize=None)
def _stream_shapes(schedule: str, pp: int, microbatches: int) -> Tuple[Tuple[tuple, ...], ...]:
    """Every stage's stream as ("pass", "F" | "BW" | "B" | "W") and ("send" | "recv", peer, what),
    "BW" being 1F1B's whole backward. Once per (schedule, p, m): DeepSpeed's schedule classes build
    an object per instruction, most of the time of a planner search that plays hundreds of layouts."""
    from deepspeed.runtime.pipe import schedule as ds_schedule

    from launch.analysis.zero_bubble_schedule import BackwardInputPass, WeightPass
    passes = {ds_schedule.ForwardPass: "F", ds_schedule.BackwardPass: "BW", BackwardInputPass: "B", WeightPass: "W"}
    shapes = []
    for stage, commands in enumerate(instruction_streams(schedule, pp, microbatches)):
        p2p = {ds_schedule.SendActivation: ("send", stage + 1, "activation"),
               ds_schedule.RecvActivation: ("recv", stage - 1, "activation"),
               ds_schedule.SendGrad: ("send", stage - 1, "gradient"),
               ds_schedule.RecvGrad: ("recv", stage + 1, "gradient")}
        shapes.append(tuple(("pass", passes[type(cmd)]) if type(cmd) in passes else p2p[type(cmd)]
                            for cmd in commands if type(cmd) in passes or type(cmd) in p2p))
    return tuple(shapes)


def _program(shape: Sequence[tuple], times: Dict[str, float]) -> List[tuple]:
    """A stage's stream as ("pass", kind, seconds) and ("send" | "recv", peer, what)."""
    timed = {"F": ("F", times["F"]), "BW": ("B", times["B"] + times["W"]),  # 1F1B's whole backward
             "B": ("B", times["B"]), "W": ("W", times["W"])}
    return [("pass", *timed[step[1]]) if step[0] == "pass" else step for step in shape]


def simulate_schedule(schedule: str, pp: int, microbatches: int, t_forward: Times, t_backward_input: Times,
                      t_weight: Times = 0.0) -> List[Event]:
    """Play the step's instruction streams with pass times in seconds, one per stage or one for all:
    forward, input-gradient backward (B) and weight-gradient backward (W). 1F1B's backward takes
    B + W in one pass."""
    def per_stage(times: Times) -> List[float]:
        return [float(times)] * pp if isinstance(times, (int, float)) else list(times)
    t_forward, t_backward_input, t_weight = per_stage(t_forward), per_stage(t_backward_input), per_stage(t_weight)
    programs = [_program(shape, {"F": t_forward[k], "B": t_backward_input[k], "W": t_weight[k]})
                for k, shape in enumerate(_stream_shapes(schedule, pp, microbatches))]
    position, clock = [0] * pp, [0.0] * pp
    counts = [{"F": 0, "B": 0, "W": 0} for _ in range(pp)]
    events: List[Event] = []
    while any(position[k] < len(programs[k]) for k in range(pp)):
        progressed = False
        for k in range(pp):
            while position[k] < len(programs[k]) and programs[k][position[k]][0] == "pass":
                _, kind, seconds = programs[k][position[k]]
                events.append((k, kind, counts[k][kind], clock[k], clock[k] + seconds))
                counts[k][kind] += 1
                clock[k] += seconds
                position[k] += 1
                progressed = True
            if position[k] == len(programs[k]):
                continue
            op, peer, what = programs[k][position[k]]
            if position[peer] < len(programs[peer]):
                peer_op, peer_peer, peer_what = programs[peer][position[peer]]
                if peer_op in ("send", "recv") and peer_op != op and peer_peer == k:
                    assert peer_what == what, f"stages {k} and {peer} would exchange {what} for {peer_what}"
                    clock[k] = clock[peer] = max(clock[k], clock[peer])
                    position[k] += 1
                    position[peer] += 1
                    progressed = True
        assert progressed, f"the {schedule} streams deadlock at positions {position}"
    return sorted(events, key=lambda e: (e[0], e[3]))
