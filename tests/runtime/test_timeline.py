"""`--timeline` (launch/instruments/timeline.py): the bubble arithmetic on synthetic events, the recorder
driven by DeepSpeed's own `_exec_schedule` and 1F1B schedule in this process, and a real pp=2 run."""
import re
import time

import pytest
import torch.distributed as dist
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

from helpers import chart_pixels
from launch.analysis import formulas
from launch.analysis.pipeline_chart import COLOURS
from launch.analysis.schedule_sim import simulate_schedule
from launch.engine.distributed import free_port
from launch.instruments.timeline import install_timeline_recorder, measured_bubble, stage_busy_seconds
from helpers.launcher import TINY, launch_forked


# ---------------------------------------------------------------- the bubble arithmetic

def test_measured_bubble_of_hand_made_steps():
    # Stage 0 busy 0-1 and 2-3, stage 1 busy 1-2: span 3, busy 3 of 2*3 stage-seconds.
    half_idle = [(0, "F", 0, 0.0, 1.0), (1, "F", 0, 1.0, 2.0), (0, "B", 0, 2.0, 3.0)]
    never_idle = [(0, "F", 0, 5.0, 6.0), (1, "F", 0, 5.0, 6.0)]  # offsets do not matter
    assert measured_bubble([half_idle]) == pytest.approx(0.5)
    assert measured_bubble([half_idle, never_idle]) == pytest.approx(0.25)  # the mean over steps
    assert stage_busy_seconds([half_idle, never_idle]) == pytest.approx([(2 + 1) / 2, (1 + 1) / 2])


@pytest.mark.parametrize("pp,m", [(2, 8), (4, 4), (4, 16)])
def test_measured_bubble_of_an_ideal_schedule_is_the_formula(pp, m):
    """Without communication, 1F1B idles (p-1)/(m+p-1) of the step."""
    events = simulate_schedule("1f1b", pp, m, 1.0, 2.0)
    assert measured_bubble([events]) == pytest.approx(formulas.bubble_fraction(pp, m))


def test_the_chart_reader_finds_the_axes_matplotlib_drew(tmp_path):
    """helpers/chart_pixels.py reads the schedule's columns back where matplotlib put its axes,
    here for a chart whose last tick label and the legend's frame (both showing a few pixels of the
    idle grey) would join the axes to the legend for a reader of every column holding that grey."""
    import matplotlib.pyplot as plt

    from launch.analysis.pipeline_chart import draw_schedule
    span = 0.5026869899031989  # one of the spans that joined them
    events = [e for mb in range(4) for e in ((0, "F", mb, span * mb / 4, span * (mb / 4 + 1 / 12)),
                                             (0, "B", mb, span * (mb / 4 + 1 / 8), span * (mb + 1) / 4))]
    fig, axes = plt.subplots(2, 1, squeeze=False, figsize=(12, 2 * 1.7))  # as the recorder's, two steps
    for ax in axes[:, 0]:
        draw_schedule(ax, events, "step 2: bubble 25.0%")
    fig.tight_layout()
    fig.savefig(tmp_path / "chart.png", dpi=120)
    drawn = axes[0, 0].get_window_extent()
    plt.close(fig)
    _, (left, right) = chart_pixels.schedule_area(chart_pixels.read_rgb(tmp_path / "chart.png"))
    scale = 120 / fig.dpi  # the window's pixels to the file's
    assert left == pytest.approx(drawn.x0 * scale, abs=2) and right == pytest.approx(drawn.x1 * scale, abs=2), \
        ((left, right), (drawn.x0 * scale, drawn.x1 * scale))


# ---------------------------------------------------------------- the recorder, in-process

def _wait(seconds):
    def handler(engine, **kwargs):
        time.sleep(seconds)
    return handler


def _timed_pass(seconds):
    """A forward or backward pass that notes its own start and end on the test's clock."""
    def handler(engine, **kwargs):
        start = time.perf_counter()
        time.sleep(seconds)
        engine.passes[-1].append((start, time.perf_counter()))
    return handler


class FakeEngine:
    """Stage 0 of 2 running DeepSpeed's real `_exec_schedule` over its real schedules; only the
    instruction handlers are stand-ins: forward 5 ms, backward 10 ms, and 7.5 ms waiting for each
    gradient from the next stage (RecvGrad), the idle time of a real first stage; the rest nothing."""
    num_stages, micro_batches, stage_id = 2, 4, 0
    _INSTRUCTION_MAP = {**{cmd: _wait(0) for cmd in PipelineEngine._INSTRUCTION_MAP},
                        schedule.ForwardPass: _timed_pass(0.005), schedule.BackwardPass: _timed_pass(0.010),
                        schedule.RecvGrad: _wait(0.0075)}

    def __init__(self):
        self.passes = []  # per train_batch or eval_batch call: its passes' (start, end)

    def _reserve_pipe_buffers(self, num_buffers):
        pass

    def train_batch(self):
        self.passes.append([])
        PipelineEngine._exec_schedule(self, schedule.TrainSchedule(self.micro_batches, self.num_stages, self.stage_id))

    def eval_batch(self):
        self.passes.append([])
        PipelineEngine._exec_schedule(self, schedule.InferenceSchedule(self.micro_batches, self.num_stages,
                                                                       self.stage_id))


def own_idle_share(passes) -> float:
    """1 - busy / span of one step's passes on the handlers' own clock."""
    span = passes[-1][1] - passes[0][0]
    return 1.0 - sum(end - start for start, end in passes) / span


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_recorder_times_the_recorded_train_steps_only(world_of_one, tmp_path, capsys):
    engine, class_map = FakeEngine(), dict(FakeEngine._INSTRUCTION_MAP)
    recorder = install_timeline_recorder(engine, steps=2, total_steps=5, one_per_stage=True)
    assert FakeEngine._INSTRUCTION_MAP == class_map  # wrapped on this engine only
    for _ in range(4):
        engine.train_batch()
        engine.eval_batch()  # forwards outside train_batch: never recorded
    assert len(recorder.steps) == 2  # steps 2 and 3, after the warm-up step 1
    recorded_calls = engine.passes[2:6:2]  # calls: train 1, eval, train 2, eval, train 3, ...
    for events, own in zip(recorder.steps, recorded_calls):
        assert [(k, mb) for _, k, mb, _, _ in events if k == "F"] == [("F", i) for i in range(4)]
        assert [(k, mb) for _, k, mb, _, _ in events if k == "B"] == [("B", i) for i in range(4)]
        assert all(stage == 0 for stage, *_ in events)
        starts = [e[3] for e in events]
        assert starts == sorted(starts) and starts[0] >= 0.0
        # Each recorded pass holds the pass the handler timed itself, and little more (a busy
        # machine may deschedule the recorder for a moment).
        for (_, _, _, start, end), (own_start, own_end) in zip(events, own):
            assert own_end - own_start <= end - start < own_end - own_start + 0.003

    path = tmp_path / "charts" / "timeline.png"
    measured = recorder.draw(path, logging_rank=True)
    reference = sum(own_idle_share(own) for own in recorded_calls) / 2
    assert reference > 0.15  # 4 waits for a gradient, 30 ms of a span of about 90 ms
    assert measured == pytest.approx(reference, abs=0.02)
    assert "(p-1)/(m+p-1) = 20.0% with p=2, m=4" in capsys.readouterr().out

    # The chart: one panel per recorded step, each one stage row of 4 forward and 4 backward boxes,
    # idle where the recorder measured idle.
    rgb = chart_pixels.read_rgb(path)
    (top, bottom), (left, right) = chart_pixels.schedule_area(rgb)
    schedule_pixels = rgb[top:bottom, left:right]
    forward, backward = (chart_pixels.colour_mask(schedule_pixels, COLOURS[kind]) for kind in "FB")
    rows = chart_pixels.box_rows(forward | backward)
    assert len(rows) == 2
    assert [chart_pixels.boxes_in_row(forward, row) for row in rows] == [4, 4]
    assert [chart_pixels.boxes_in_row(backward, row) for row in rows] == [4, 4]
    drawn_idle = [chart_pixels.idle_share(schedule_pixels, row) for row in rows]
    assert sum(drawn_idle) / 2 == pytest.approx(measured, abs=0.02), (drawn_idle, measured)


# ---------------------------------------------------------------- a real pp=2 run

@pytest.mark.slow  # a 2-process training run
def test_timeline_of_a_pp2_run(tmp_path):
    """tiny.yaml at pp=2 under ZB-H1, 3 steps: steps 2 and 3 recorded after the warm-up step. The
    chart read back as pixels shows 2 panels of 2 stage rows, each with forward, B and W boxes, and
    as much idle as the printed bubble says."""
    png = tmp_path / "timeline.png"
    proc = launch_forked(2, ["--recipe", str(TINY), "--pp", "2", "--steps", "3", "--set", "train.eval_every=0",
                      "--set", "train.schedule=zb-h1", "--timeline", str(png), "--timeline-steps", "2"])
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    # tiny.yaml at pp=2: m = 16 / 2 = 8 micro-batches, (2-1)/(8+2-1) = 11.1%.
    line = re.search(r"^timeline: zb-h1 bubble measured ([\d.]+)% \(mean of steps 2-3\) vs predicted ([\d.]+)% "
                     r"from the measured pass times; \(p-1\)/\(m\+p-1\) = 11\.1% with p=2, m=8; busy per step: "
                     r"stage 0 [\d.]+ s, stage 1 [\d.]+ s \(slowest / fastest [\d.]+\); mean pass ms F/B/W per "
                     r"stage: [\d.]+/[\d.]+/[\d.]+, [\d.]+/[\d.]+/[\d.]+; chart in (.+)$",
                     proc.stdout, re.MULTILINE)
    assert line, proc.stdout[-3000:]
    assert line.group(3) == str(png)
    assert proc.stdout.count("timeline:") == 1  # the logging rank only

    rgb = chart_pixels.read_rgb(png)
    (top, bottom), (left, right) = chart_pixels.schedule_area(rgb)
    schedule_pixels = rgb[top:bottom, left:right]
    forward, backward, weight = (chart_pixels.colour_mask(schedule_pixels, COLOURS[kind]) for kind in "FBW")
    rows = chart_pixels.box_rows(forward | backward | weight)
    assert len(rows) == 2 * 2, rows  # steps x stages
    assert all(chart_pixels.boxes_in_row(weight, row) > 0 for row in rows)  # W passes on every stage
    drawn_idle = [chart_pixels.idle_share(schedule_pixels, row) for row in rows]
    # Boxes of a millisecond are a few pixels wide, their black edges a pixel of it: 3 points.
    assert sum(drawn_idle) / len(rows) == pytest.approx(float(line.group(1)) / 100, abs=0.03), (drawn_idle, line.group(0))
