"""A run's predicted step time beside the measured one: what the console
summary and every `--metrics-out` record print, and the measured median after warm-up at the end.
The prediction itself: launch/autotune/step_prediction.py."""
import statistics
from dataclasses import dataclass, field
from typing import List, Optional

WARM_UP_STEPS = 2
"""A process's first steps, left out of the measured median (allocator growth, compilation, the
first broadcasts)."""


@dataclass
class StepPrediction:
    seconds: Optional[float]
    """The planner's step time for this layout, None without a profile for this device."""
    by: str
    """Its cost model (`calibrated on ...`, `datasheet ...`), or why there is none."""
    measured: List[float] = field(default_factory=list)

    def observe(self, step_time_s: float) -> None:
        self.measured.append(step_time_s)

    def summary_line(self) -> str:
        if self.seconds is None:
            return f"  step time predicted: none ({self.by})"
        return f"  step time predicted: {self.seconds:.4g} s ({self.by})"

    def closing_line(self) -> Optional[str]:
        """Measured against predicted, once the run has steps after its warm-up."""
        after = self.measured[WARM_UP_STEPS:]
        if not after:
            return None
        median = statistics.median(after)
        line = f"step time: measured {median:.4g} s (median of {len(after)} steps after {WARM_UP_STEPS} of warm-up)"
        if self.seconds is None:
            return line + f"; no prediction ({self.by})"
        return line + f", predicted {self.seconds:.4g} s: measured / predicted = {median / self.seconds:.2f}"
