"""What the planner's cost model knows about a device (issue 36): the FLOP/s its GEMMs reach at
each shape, its memory bandwidth and a fixed cost per micro-batch, either measured on the job's
own devices (launch/runtime/calibrate.py, cached per device and software) or taken from the
datasheet (one flat fraction of peak at every shape, the planner's rule before calibration).

A GEMM's rate depends on its shape: a rank's GEMMs shrink with tp (columns), cp and the
micro-batch (rows), and an expert's with its share of the routed rows. The table holds measured
(M, K, N) -> FLOP/s; `gemm_rate` interpolates in log M between measured rows of the same (K, N)
and otherwise takes the nearest measured shape. Memory bandwidth bounds a micro-batch from below:
each one reads every weight of the rank and adds into its gradient (`bytes_per_weight`)."""
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

Shape = Tuple[int, int, int]  # (M rows, K inner, N columns)


@dataclass
class DeviceProfile:
    device: str
    """What was measured: the accelerator's name, or the CPU's model and the processes sharing it."""
    source: str
    """"calibrated" (measured here) or "datasheet"."""
    dtype: str = "bf16"
    software: str = ""
    """torch and DeepSpeed versions the measurement ran under (a new version is measured again)."""
    gemm: Dict[str, float] = field(default_factory=dict)
    """"M,K,N" -> FLOP/s measured."""
    flat_rate: Optional[float] = None
    """A datasheet's FLOP/s at every shape (peak x efficiency); None for a measured table."""
    memory_bw: Optional[float] = None
    """Bytes/s of device memory (a streaming copy); None: no bandwidth floor."""
    link_bw: Optional[float] = None
    """Bus bytes/s of a ring all-reduce among the processes of one machine (gloo on CPU); None:
    the links are the datasheet's (NVLink in a node, the NIC across)."""
    link_latency_s: float = 0.0
    """Seconds every collective costs besides its bytes (a one-element all-reduce); 0: unmeasured."""
    per_microbatch_s: float = 0.0
    """Seconds every stage spends per micro-batch besides its GEMMs (the engine's dispatch)."""

    def shapes(self) -> List[Shape]:
        return [tuple(int(v) for v in key.split(",")) for key in self.gemm]

    def gemm_rate(self, m: float, k: int, n: int) -> float:
        """FLOP/s of an (m x k) @ (k x n) GEMM: the flat rate, a measured shape, log-M
        interpolation between the nearest measured rows of the same (k, n) (held at the ends), or
        the nearest measured shape in log distance."""
        if self.flat_rate is not None:
            return self.flat_rate
        m = max(1.0, m)
        rows = sorted((sm, rate) for (sm, sk, sn), rate in zip(self.shapes(), self.gemm.values()) if (sk, sn) == (k, n))
        if rows:
            below = [r for r in rows if r[0] <= m]
            above = [r for r in rows if r[0] >= m]
            if not below or not above:
                return (below or above)[-1 if below else 0][1]
            (m0, r0), (m1, r1) = below[-1], above[0]
            if m0 == m1:
                return r0
            w = (math.log(m) - math.log(m0)) / (math.log(m1) - math.log(m0))
            return r0 + w * (r1 - r0)
        nearest = min(zip(self.shapes(), self.gemm.values()),
                      key=lambda sr: sum(abs(math.log(max(1, a)) - math.log(max(1, b))) for a, b in zip(sr[0], (m, k, n))))
        return nearest[1]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "DeviceProfile":
        return cls(**json.loads(text))

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)


def gemm_key(m: int, k: int, n: int) -> str:
    return f"{m},{k},{n}"


def datasheet_profile(name: str, peak_flops: float, efficiency: float, memory_bw: Optional[float]) -> DeviceProfile:
    """The planner without calibration: `efficiency` of peak at every shape, the datasheet's memory bandwidth."""
    return DeviceProfile(device=name, source="datasheet", flat_rate=peak_flops * efficiency, memory_bw=memory_bw)


def bytes_per_weight(element_bytes: int, full_recompute: bool) -> int:
    """Device-memory bytes one micro-batch moves per weight of the rank: the weight read by the
    forward, by the input-gradient GEMM and once more under full recompute, the weight-gradient
    GEMM's output, and its fp32 accumulation (read and write, 8 B) into the gradient buffer (bf16
    with fusion: 2 + 2 + 2 + 8 = 14)."""
    return element_bytes * (3 + (1 if full_recompute else 0)) + 8
