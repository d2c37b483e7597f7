"""A clock a test advances by hand (launch/resilience/clock.py): a day of a run in a second."""
from launch.resilience.clock import Clock


class SimulatedClock(Clock):
    def __init__(self, start: float = 1000.0):
        self.t = start

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def advance(self, seconds: float) -> None:
        self.t += seconds
