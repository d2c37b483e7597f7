"""`--timeline` (launch/instruments/timeline.py): the bubble arithmetic on synthetic events, the recorder
driven by DeepSpeed's own `_exec_schedule` and 1F1B schedule in this process, and a real pp=2 run."""
import re
import time

import pytest
import torch.distributed as dist
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

from distributed import free_port
from launch.analysis import formulas
from launch.instruments.pipeline_chart import simulate_1f1b
from launch.instruments.timeline import install_timeline_recorder, measured_bubble
from launcher import TINY, launch

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- the bubble arithmetic

def test_measured_bubble_of_hand_made_steps():
    # Stage 0 busy 0-1 and 2-3, stage 1 busy 1-2: span 3, busy 3 of 2*3 stage-seconds.
    half_idle = [(0, "F", 0, 0.0, 1.0), (1, "F", 0, 1.0, 2.0), (0, "B", 0, 2.0, 3.0)]
    never_idle = [(0, "F", 0, 5.0, 6.0), (1, "F", 0, 5.0, 6.0)]  # offsets do not matter
    assert measured_bubble([half_idle]) == pytest.approx(0.5)
    assert measured_bubble([half_idle, never_idle]) == pytest.approx(0.25)  # the mean over steps


@pytest.mark.parametrize("pp,m", [(2, 8), (4, 4), (4, 16)])
def test_measured_bubble_of_an_ideal_schedule_is_the_formula(pp, m):
    """Without communication, 1F1B idles (p-1)/(m+p-1) of the step."""
    events = simulate_1f1b(pp, m, t_fwd=1.0, t_bwd=2.0)
    assert measured_bubble([events]) == pytest.approx(formulas.bubble_fraction(pp, m))


# ---------------------------------------------------------------- the recorder, in-process

def _sleep(seconds):
    def handler(engine, **kwargs):
        time.sleep(seconds)
    return handler


class FakeEngine:
    """Stage 0 of 2 running DeepSpeed's real `_exec_schedule` over its real schedules; only the
    instruction handlers are stand-ins (forward 2 ms, backward 4 ms, the rest nothing)."""
    num_stages, micro_batches, stage_id = 2, 4, 0
    _INSTRUCTION_MAP = {**{cmd: _sleep(0) for cmd in PipelineEngine._INSTRUCTION_MAP},
                        schedule.ForwardPass: _sleep(0.002), schedule.BackwardPass: _sleep(0.004)}

    def _reserve_pipe_buffers(self, num_buffers):
        pass

    def train_batch(self):
        PipelineEngine._exec_schedule(self, schedule.TrainSchedule(self.micro_batches, self.num_stages, self.stage_id))

    def eval_batch(self):
        PipelineEngine._exec_schedule(self, schedule.InferenceSchedule(self.micro_batches, self.num_stages,
                                                                       self.stage_id))


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
    for events in recorder.steps:
        assert [(k, mb) for _, k, mb, _, _ in events if k == "F"] == [("F", i) for i in range(4)]
        assert [(k, mb) for _, k, mb, _, _ in events if k == "B"] == [("B", i) for i in range(4)]
        assert all(stage == 0 for stage, *_ in events)
        starts = [e[3] for e in events]
        assert starts == sorted(starts) and starts[0] >= 0.0
        assert all(end - start >= (0.002 if kind == "F" else 0.004) for _, kind, _, start, end in events)

    path = tmp_path / "charts" / "timeline.png"
    measured = recorder.draw(path, logging_rank=True)
    assert 0.0 <= measured < 0.5  # one stage, back to back: little idle
    assert path.read_bytes().startswith(PNG_SIGNATURE)
    assert "vs predicted 20.0% = (p-1)/(m+p-1) with p=2, m=4" in capsys.readouterr().out


# ---------------------------------------------------------------- a real pp=2 run

def test_timeline_of_a_pp2_run(tmp_path):
    png = tmp_path / "timeline.png"
    proc = launch(2, ["--recipe", str(TINY), "--pp", "2", "--steps", "4", "--set", "train.eval_every=0",
                      "--timeline", str(png), "--timeline-steps", "2"])
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert png.stat().st_size > 10_000 and png.read_bytes().startswith(PNG_SIGNATURE)
    # tiny.yaml at pp=2: m = 16 / 2 = 8 micro-batches, predicted (2-1)/(8+2-1) = 11.1%.
    line = re.search(r"^timeline: bubble measured ([\d.]+)% \(mean of steps 2-3\) vs predicted 11\.1% "
                     r"= \(p-1\)/\(m\+p-1\) with p=2, m=8; chart in (.+)$", proc.stdout, re.MULTILINE)
    assert line, proc.stdout[-3000:]
    assert 0.0 < float(line.group(1)) < 100.0
    assert line.group(2) == str(png)
    assert proc.stdout.count("timeline:") == 1  # the logging rank only
