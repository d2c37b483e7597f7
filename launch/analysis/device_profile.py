"""What the planner's cost model knows about a device: the FLOP/s its GEMMs reach at
each shape, its memory bandwidth and a fixed cost per micro-batch, either measured on the job's
own devices (launch/autotune/calibrate.py, cached per device and software) or taken from the
datasheet (one flat fraction of peak at every shape, the planner's rule before calibration).

A GEMM's rate depends on its shape: a rank's GEMMs shrink with tp (columns), cp and the
micro-batch (rows), and an expert's with its share of the routed rows. The table holds measured
(M, K, N) -> FLOP/s; `gemm_rate` interpolates in log M between measured rows of the same (K, N)
and otherwise takes the nearest measured shape. Memory bandwidth bounds a micro-batch from below:
each one reads every weight of the rank and adds into its gradient (`bytes_per_weight`).

A calibration on one machine's processes also times the model's own pieces as each candidate
runs them (launch/autotune/calibrate_blocks.py): a dense and an MoE block, forward and backward,
and the embedding with the head and loss, at the candidate's tp, ep, micro-batch and tokens, in
real TP and EP groups with every process busy at once. That time holds what the GEMM table
cannot see: the element-wise ops, each op's dispatch, the TP and EP collectives and their
latency under the machine's oversubscription. `blocks` keys it by the model's shape
(`model_key`) and the case (`block_key`); the planner uses it when every part it needs is there."""
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

Shape = Tuple[int, int, int]  # (M rows, K inner, N columns)
ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


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
    roofline: bool = False
    """With a flat rate: a GEMM runs at most at its arithmetic intensity (FLOPs per byte of its
    three matrices, each read or written once) times the memory bandwidth (NVIDIA's Matrix
    Multiplication Background User's Guide, "Math and Memory Bounds"): the datasheet's own curve of
    efficiency against rows, which leaves out tile and wave quantization."""
    memory_bw: Optional[float] = None
    """Bytes/s of device memory (a streaming copy); None: no bandwidth floor."""
    link_bw: Optional[float] = None
    """Bus bytes/s of a ring all-reduce among the processes of one machine (gloo on CPU); None:
    the links are the datasheet's (NVLink in a node, the NIC across)."""
    all_to_all_bw: Optional[float] = None
    """Bytes/s each rank sends in an all-to-all among the processes of one machine (CP's and EP's
    exchanges); None: link_bw."""
    group_bw: Dict[str, float] = field(default_factory=dict)
    """"all_reduce:K" (bus bytes/s of a ring all-reduce) and "all_to_all:K" (bytes/s each rank
    sends) in groups of K of the machine's processes, every group at once, as a candidate's TP, CP,
    EP or data groups run; K the whole machine's too (the same as link_bw and all_to_all_bw). Empty:
    link_bw and all_to_all_bw at every group size."""
    p2p_bw: Optional[float] = None
    """Bytes/s of one point-to-point transfer, every pair at once (a pipeline stage's); None: link_bw."""
    link_latency_s: float = 0.0
    """Seconds every collective costs besides its bytes (a one-element all-reduce); 0: unmeasured."""
    per_microbatch_s: float = 0.0
    """Seconds every stage spends per micro-batch besides its GEMMs (the engine's dispatch)."""
    per_step_s: float = 0.0
    """Seconds every optimizer step costs besides the micro-batches, the gradient all-reduce's
    bytes and the optimizer's arithmetic (the engine's and the loop's own collectives and bookkeeping)."""
    per_tensor_microbatch_s: Optional[float] = None
    """Seconds a micro-batch costs per parameter tensor of the rank (ZeRO's gradient hook on each),
    launch/autotune/calibrate_engine.py; None: unmeasured (no such cost)."""
    per_tensor_step_s: Optional[float] = None
    """Seconds a step costs per parameter tensor of the rank (its reduction, clipping and copy back)."""
    optimizer_s_per_param: Optional[float] = None
    """Seconds of the optimizer's update per parameter of the rank (AdamW's fp32 arithmetic);
    None: the traffic `OPTIMIZER_BYTES_PER_PARAM` at the memory bandwidth."""
    host_sync_s: float = 0.0
    """Seconds a host sync costs (a device-to-host copy the host waits for: an MoE block's split
    sizes); a datasheet assumes HOST_SYNC_S."""
    blocks: Dict[str, float] = field(default_factory=dict)
    """`block_key` -> seconds of one model piece measured as a candidate runs it (module docstring)."""

    def shapes(self) -> List[Shape]:
        return [tuple(int(v) for v in key.split(",")) for key in self.gemm]

    def gemm_rate(self, m: float, k: int, n: int) -> float:
        """FLOP/s of an (m x k) @ (k x n) GEMM: the flat rate, a measured shape, log-M
        interpolation between the nearest measured rows of the same (k, n) (held at the ends), or
        the nearest measured shape in log distance."""
        if self.flat_rate is not None and self.roofline and self.memory_bw:
            element = ELEMENT_BYTES.get(self.dtype, 2)
            intensity = 2 * m * k * n / (element * (m * k + k * n + m * n))
            return min(self.flat_rate, intensity * self.memory_bw)
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

    def collective_bw(self, kind: str, size: int) -> Optional[float]:
        """Bytes/s of collective `kind` ("all_reduce", "all_to_all") in groups of `size` processes:
        measured at that size, else at the whole machine (link_bw, all_to_all_bw), else None."""
        measured = self.group_bw.get(f"{kind}:{size}")
        if measured:
            return measured
        return self.all_to_all_bw if kind == "all_to_all" and self.all_to_all_bw else self.link_bw

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


    def block_seconds(self, model, tp: int, ep: int, micro_batch: int, tokens: int) -> Optional[Dict[str, float]]:
        """Seconds of each measured piece of `model` at this case ("dense", "moe" blocks and the
        "head", forward and backward; "<piece>.forward" the forward alone), or None when one the
        model has is missing (the planner then costs the case from the GEMM table)."""
        arch = model.resolved()
        pieces = ["head"] + [kind for kind, present in (("dense", has_dense_blocks(arch)), ("moe", arch.moe.enabled))
                             if present]
        found = {}
        for piece in pieces:
            for part in (piece, piece + ".forward"):
                key = block_key(model_key(arch), part, tp, ep, micro_batch, tokens)
                if key not in self.blocks:
                    return None
                found[part] = self.blocks[key]
        return found


OPTIMIZER_BYTES_PER_PARAM = 32
"""AdamW's update reads the fp32 weight, gradient and two moments and writes three back (28 B),
plus the 16-bit copy of a mixed-precision run (4 B)."""


def has_dense_blocks(model) -> bool:
    return not model.moe.enabled or any(not model.moe.is_moe_block(i) for i in range(model.n_layer))


def model_key(model) -> str:
    """What a measured block depends on: every field of the resolved config but the layer count."""
    import hashlib
    fields = {k: v for k, v in asdict(model.resolved()).items() if k != "n_layer"}
    return hashlib.sha1(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:12]


def block_key(model: str, part: str, tp: int, ep: int, micro_batch: int, tokens: int) -> str:
    """One measured piece: the model's key, the part, the rank's tp, ep, micro-batch and tokens of a sequence."""
    return f"{model}|{part}|tp{tp}|ep{ep}|b{micro_batch}|s{tokens}"


def gemm_key(m: int, k: int, n: int) -> str:
    return f"{m},{k},{n}"


HOST_SYNC_S = 20e-6
"""An assumed GPU host sync: the copy's round trip and the launch latency of the kernels queued
after it (CUDA's launch overhead is ~5-10 us a kernel); a calibration measures its own."""


def datasheet_profile(name: str, peak_flops: float, efficiency: float, memory_bw: Optional[float],
                      roofline: bool = False, dtype: str = "bf16") -> DeviceProfile:
    """The planner without calibration: `efficiency` of peak at every shape (at most the
    roofline's rate with `roofline`), the datasheet's memory bandwidth, an assumed host sync."""
    return DeviceProfile(device=name, source="datasheet", dtype=dtype, flat_rate=peak_flops * efficiency,
                         memory_bw=memory_bw, host_sync_s=HOST_SYNC_S, roofline=roofline)


def bytes_per_weight(element_bytes: int, full_recompute: bool) -> int:
    """Device-memory bytes one micro-batch moves per weight of the rank: the weight read by the
    forward, by the input-gradient GEMM and once more under full recompute, the weight-gradient
    GEMM's output, and its fp32 accumulation (read and write, 8 B) into the gradient buffer (bf16
    with fusion: 2 + 2 + 2 + 8 = 14)."""
    return element_bytes * (3 + (1 if full_recompute else 0)) + 8
