"""Test hook: GPT3D_SLOW_SAVE="SECONDS" makes every rank wait that long after writing its files,
before the save's barrier and commit (launch/checkpoints/store.py: save), so that a test can signal
the ranks inside a save: the scheduler's time limit landing in the stop's save
(tests/e2e/test_slurm_stop.py, docs/resilience.md "Preemption"). Unset, it does nothing."""
import os
import time

from launch.errors import ConfigError

SLOW_SAVE_ENV = "GPT3D_SLOW_SAVE"


def slow_save_s() -> float:
    """The extra seconds of each save (0 when unset); a ConfigError when malformed, which
    launch/trainer/preflight.py raises before the start."""
    value = os.environ.get(SLOW_SAVE_ENV)
    if not value:
        return 0.0
    try:
        seconds = float(value)
        if not 0 <= seconds < 3600:
            raise ValueError
    except ValueError:
        raise ConfigError(f"{SLOW_SAVE_ENV}={value!r} must be seconds in [0, 3600) (a test hook, e.g. 8)") from None
    return seconds


def wait_if_asked(rank: int) -> None:
    seconds = slow_save_s()
    if seconds:
        print(f"rank {rank}: {SLOW_SAVE_ENV}={seconds:g}: this save waits {seconds:g} s before its commit", flush=True)
        time.sleep(seconds)
