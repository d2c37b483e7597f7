"""The stop request's clock (launch/resilience/signals.py: StopTimes) driven by a simulated clock: a
day of steps and hour-long saves runs in milliseconds. With real signals and processes:
tests/runtime/test_silent_rank.py."""
from pathlib import Path

from helpers.simulated_clock import SimulatedClock
from launch.resilience.signals import SAME_REQUEST_S, StopTimes, saved_line


def _steps(times: StopTimes, clock: SimulatedClock, seconds: float, n: int) -> None:
    for _ in range(n):
        clock.advance(seconds)
        times.step_ended(stopping=False)


def test_a_day_of_steps_then_a_signal_during_an_hour_long_save():
    """A day of 60 s steps (the first, compiling, 10 min) with a save of an hour every 120 steps;
    SIGTERM at a save's start. Nothing is timed while the save runs, however long; after it the
    rank waits twice the longest step (120 s, above the 30 s grace) for the next step, not less."""
    clock = SimulatedClock()
    times = StopTimes(grace_s=30.0, clock=clock)
    clock.advance(600.0)
    times.step_ended(stopping=False)
    for _ in range(12):  # 12 x (120 steps + a save of an hour) = a day and a half
        _steps(times, clock, 60.0, 120)
        times.save_started()
        clock.advance(3600.0)
        times.save_ended()
    assert times.longest_step_s == 60.0  # the saves and the first step left out
    _steps(times, clock, 60.0, 1)
    times.save_started()
    times.signalled()
    assert times.seconds_left() is None
    clock.advance(3 * 3600.0)
    assert times.seconds_left() is None  # a save is never cut short here
    times.save_ended()
    assert times.seconds_left() == 120.0
    clock.advance(119.0)
    assert times.seconds_left() == 1.0
    clock.advance(1.0)
    assert times.seconds_left() == 0.0  # the step did not end: the rank leaves without a save
    times.step_ended(stopping=True)
    assert times.seconds_left() is None  # every rank agreed: the stop's save is not timed either


def test_signals_within_the_window_are_one_request():
    clock = SimulatedClock()
    times = StopTimes(grace_s=30.0, clock=clock)
    times.signalled()
    clock.advance(SAME_REQUEST_S - 0.01)
    assert times.same_request()
    clock.advance(0.02)
    assert not times.same_request()


def test_the_line_after_a_save_says_how_long_a_stop_needs():
    """The longest step (the first, 5 min of compilation, left out) plus the save just made."""
    clock = SimulatedClock()
    times = StopTimes(grace_s=30.0, clock=clock)
    clock.advance(300.0)
    times.step_ended(stopping=False)
    for seconds in (2.9, 3.1, 3.0):
        clock.advance(seconds)
        times.step_ended(stopping=False)
    times.save_started()
    clock.advance(8.1)
    times.save_ended()
    assert saved_line(Path("runs/ck/step00000200"), times.last_save_s, times.longest_step_s) == (
        "saved runs/ck/step00000200 in 8.1 s; a stop needs up to 11.2 s (the longest step 3.1 s + this save): "
        "signal at least that long before the kill")


def test_a_save_after_the_first_step_counts_that_step():
    """Only the first step so far: its time (compilation included) is the estimate's step."""
    clock = SimulatedClock()
    times = StopTimes(grace_s=30.0, clock=clock)
    clock.advance(40.0)
    times.step_ended(stopping=False)
    times.save_started()
    clock.advance(2.0)
    times.save_ended()
    assert (times.longest_step_s, times.last_save_s) == (40.0, 2.0)
