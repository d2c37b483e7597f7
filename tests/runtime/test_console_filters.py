"""The log lines launch/engine/console.py names are dropped from DeepSpeed's logger, and nothing
else: checked in process on DeepSpeed's own logger, with the tracker that writes the line."""
import logging

from deepspeed.utils import logger
from deepspeed.utils.pin_memory_tracker import _tracker, track_pinned_memory

from launch.engine.console import _KnownLogNoise, silence_known_noise


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _logged_while(action):
    handler, level = _Collect(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        action()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return handler.lines


def _pin_40_gb_then_say_hello():
    _tracker.reset()
    track_pinned_memory(40 * 2 ** 30)  # crosses the tracker's first checkpoint (32 GB)
    _tracker.reset()
    logger.info("hello from DeepSpeed")


def test_pinned_memory_total_is_dropped_and_other_lines_pass():
    saved = list(logger.filters)
    try:
        logger.filters[:] = [f for f in saved if not isinstance(f, _KnownLogNoise)]  # an earlier test's call
        before = _logged_while(_pin_40_gb_then_say_hello)
        assert any(line.startswith("[pinned-memory checkpoint]") for line in before), before  # the noise is real
        silence_known_noise()
        silence_known_noise()  # idempotent: one filter
        assert _logged_while(_pin_40_gb_then_say_hello) == ["hello from DeepSpeed"]
    finally:
        logger.filters[:] = saved
