"""The hang watchdog at the durations a real run has, on a simulated clock: two ranks' watchdogs on
one real TCPStore, each polled once a simulated second as its failure watcher does, through 10-minute
saves, 30-minute evaluations, a 5-minute storage stall on one rank, a 10-minute checkpoint load and
a day of 1-5 s steps: no false alarm; a real hang is found within its bound, and each long phase
past its own bound is reported with its own cause."""
import random
from datetime import timedelta

import pytest

from helpers.simulated_clock import SimulatedClock
from launch.resilience.hang_watchdog import GATHER_S, HANG_FLOOR_S, WINDOW, HangWatchdog

WAITING = "in torch.distributed.all_reduce (from launch/feed/step_tokens.py:51)"
HOUR = 3600.0


class Published(Exception):
    """A rank's watcher published the hang line (the real protocol then ends every rank)."""

    def __init__(self, rank: int, line: str, at: float):
        super().__init__(line)
        self.rank, self.line, self.at = rank, line, at


class SimulatedRank(HangWatchdog):
    """A rank's watchdog whose main thread is where the test says (it is the test's own thread)."""

    where = WAITING

    def position(self) -> str:
        return self.where


class Run:
    """Two ranks in lockstep unless told otherwise; `elapse` moves the clock a second at a time and
    polls each rank's watchdog as its watcher thread would."""

    def __init__(self, tmp_path, hang_timeout_s=0.0, save_timeout_s=0.0, stall_timeout_s=480.0,
                 first_step_timeout_s=480.0):
        import torch.distributed as dist
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=30))
        self.clock = SimulatedClock()
        self.ranks = [SimulatedRank(r, 2, tmp_path, hang_timeout_s, first_step_timeout_s, save_timeout_s,
                                    stall_timeout_s, self.clock) for r in range(2)]

    def elapse(self, seconds: float) -> None:
        whole, part = divmod(seconds, 1.0)
        for _ in range(int(whole)):
            self.clock.advance(1.0)
            self.poll()
        self.clock.advance(part)

    def poll(self) -> None:
        for r in self.ranks:
            r.poll(self.store, lambda line, r=r: self._publish(r.rank, line))

    def _publish(self, rank: int, line: str) -> None:
        raise Published(rank, line, self.clock.now())

    def start(self) -> None:
        for r in self.ranks:
            r.start()

    def steps(self, n: int, rng: random.Random, data_s: float = 0.05) -> None:
        """n steps of 1-5 s, each drawing its data first (a short data wait)."""
        for _ in range(n):
            self.phase("data", data_s)
            self.elapse(rng.uniform(1.0, 5.0))
            for r in self.ranks:
                r.step_ended()

    def phase(self, kind: str, seconds: float, batch_s: float = 0.0) -> None:
        """Both ranks in phase `kind` for `seconds`, a progress() every `batch_s` if given."""
        entered = [r.phase(kind) for r in self.ranks]
        for cm in entered:
            cm.__enter__()
        left = seconds
        while left > 0:
            dt = min(left, batch_s or left)
            self.elapse(dt)
            left -= dt
            if batch_s:
                for r in self.ranks:
                    r.progress()
        for cm in entered:
            cm.__exit__(None, None, None)

    def one_rank_in(self, rank: int, kind: str, seconds: float) -> None:
        """Rank `rank` in phase `kind` (a save, a data wait) for `seconds` while the other waits for it
        in a collective of its step; then both end the step."""
        self.ranks[rank].where = "at data/prefetch.py:70 in __next__"
        with self.ranks[rank].phase(kind):
            self.elapse(seconds)
        self.ranks[rank].where = WAITING
        self.elapse(1.5)
        for r in self.ranks:
            r.step_ended()


def test_a_simulated_day_raises_no_false_alarm_and_finds_the_hang_at_hour_20(tmp_path):
    """Defaults (10x the median step, at least 120 s; no save bound; stalls 480 s): a 10-minute load
    file by file, steps of 1-5 s, a 10-minute save every hour, a 30-minute validation at hour 6, a
    30-minute task evaluation at hour 8, a 5-minute storage stall on rank 1 at hour 10; at hour 20
    rank 1 stops inside its step. The line comes within the bound and a gather, naming rank 1."""
    run, rng = Run(tmp_path), random.Random(0)
    run.start()
    run.phase("load", 600.0, batch_s=20.0)  # 30 files of 20 s
    done = set()
    while run.clock.now() - 1000.0 < 20 * HOUR:
        hour = int((run.clock.now() - 1000.0) // HOUR)
        run.steps(50, rng)
        if hour not in done:
            done.add(hour)
            if hour:
                run.phase("save", 600.0)
            if hour == 6:
                run.phase("validation", 1800.0, batch_s=1.0)
            if hour == 8:
                run.phase("tasks", 1800.0, batch_s=2.0)
            if hour == 10:
                run.one_rank_in(1, "data", 300.0)
    steps = sum(1 for _ in run.ranks[0].intervals)
    assert steps == WINDOW  # a bounded window, full after hours of steps
    run.ranks[1].where = "at launch/resilience/failure.py:82 in maybe_inject_fault"
    hung_at = run.clock.now()
    with pytest.raises(Published) as published:
        run.elapse(HANG_FLOOR_S + 2 * GATHER_S)
    seconds = published.value.at - hung_at
    assert HANG_FLOOR_S < seconds <= HANG_FLOOR_S + 2, seconds  # both ranks reported: no gather wait
    line = published.value.line
    assert line.startswith("rank 1: hang: no step ended for 121 s (bound 120 s, train.hang_timeout_s"), line
    assert f"rank 1 at launch/resilience/failure.py:82 in maybe_inject_fault, while 1 other rank waits {WAITING}" in line


def test_a_save_longer_than_the_step_bound_is_not_a_hang_and_one_past_its_own_bound_is(tmp_path):
    run = Run(tmp_path, hang_timeout_s=5.0, first_step_timeout_s=60.0, save_timeout_s=900.0)
    run.start()
    run.steps(5, random.Random(1))
    run.phase("save", 600.0)  # 120 step bounds
    run.steps(5, random.Random(2))
    with pytest.raises(Published) as published:
        run.phase("save", 3600.0)
    assert published.value.line.startswith("every rank: hang: a save ran for 901 s (bound 900 s, "
                                           "train.save_timeout_s)"), published.value.line


def test_one_rank_saving_past_the_step_bound_holds_the_other_ranks_steps(tmp_path):
    """Rank 0 commits the checkpoint (a slow fsync) while rank 1 is already in its next step's
    collective, waiting for it: rank 1's step waits for the save without a report."""
    run = Run(tmp_path, hang_timeout_s=5.0, first_step_timeout_s=60.0)
    run.start()
    run.steps(5, random.Random(3))
    run.one_rank_in(0, "save", 300.0)
    run.steps(5, random.Random(4))


@pytest.mark.parametrize("kind", ["validation", "tasks", "load"])
def test_an_evaluation_or_load_that_progresses_is_not_a_hang_and_one_that_stops_is(tmp_path, kind):
    run = Run(tmp_path, hang_timeout_s=5.0, first_step_timeout_s=60.0)
    run.start()
    run.steps(5, random.Random(5))
    run.phase(kind, 1800.0, batch_s=3.0)  # 360 step bounds, a batch every 3 s
    run.steps(5, random.Random(6))
    with pytest.raises(Published) as published:
        run.phase(kind, 600.0, batch_s=60.0)  # the first batch may compile (60 s), the next may not
    what = {"validation": "validation", "tasks": "evaluation (eval.tasks)", "load": "the checkpoint load"}[kind]
    assert published.value.line.startswith(f"every rank: hang: {what} made no progress for 6 s (bound 5 s"), \
        published.value.line


def test_a_storage_stall_within_its_bound_recovers_and_one_past_it_names_what_it_reads(tmp_path):
    """The line names what data/reading.py says the data reads (the read-ahead worker's unit)."""
    from data.reading import reading, reading_now
    run = Run(tmp_path, stall_timeout_s=480.0)
    for r in run.ranks:
        r.reading_now = lambda: reading_now(run.clock.now)
    run.start()
    run.steps(20, random.Random(7))
    run.one_rank_in(1, "data", 300.0)  # 5 minutes: recovers
    run.steps(20, random.Random(8))
    run.ranks[1].where = "at data/prefetch.py:70 in __next__"
    stalled_at = run.clock.now()
    unit = "fineweb: https://example.test/data/part-0003.parquet row group 7"
    with pytest.raises(Published) as published:
        with run.ranks[1].phase("data"), reading(unit, clock=run.clock.now):
            run.elapse(480.0 + 2 * GATHER_S)
    assert 480 < published.value.at - stalled_at <= 482  # as soon as it was past, the other rank reporting too
    line = published.value.line
    assert line.startswith("rank 1: hang: waited 481 s for data (bound 480 s, data.stall_timeout_s); reading "
                           f"{unit} for 481 s; rank 1 at data/prefetch.py:70 in __next__, while 1 other rank waits"), line


def test_the_step_bound_follows_the_recent_steps_and_its_window_stays_bounded(tmp_path):
    """100,000 steps of 3 s, then 300 of 20 s: the bound is 10 x 20 s (the recent median), and the
    watchdog holds WINDOW intervals, not the run's, so a poll's work does not grow with the run."""
    run = Run(tmp_path)
    hang = run.ranks[0]
    hang.start()
    for _ in range(100_000):
        run.clock.advance(3.0)
        hang.step_ended()
    assert hang.bound_s() == HANG_FLOOR_S and len(hang.intervals) == WINDOW
    for _ in range(300):
        run.clock.advance(20.0)
        hang.step_ended()
    assert hang.bound_s() == pytest.approx(200.0) and len(hang.intervals) == WINDOW
