"""What the planner is asked about: one candidate layout and batch (`Setup`) on given hardware
(`Hardware`, `GPUS`), the training run's own layout rules checked on it (`check_setup`), and where
its ranks sit (`rank_groups`: the TP, CP, PP, DP and EP groups; `within_node`). Separate from
planner.py, which estimates a candidate's memory and step time and ranks candidates: this is the
input that every estimate, the report (plan_report.py) and launch/plan.py's flags share, and holds
no formula."""
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Union

from launch.analysis import engine_memory, formulas
from launch.analysis.device_profile import DeviceProfile, datasheet_profile
from launch.analysis import partition as partition_rules
from launch.config.layout import Layout, check_and_derive_layout
from launch.config.recipe import Recipe, TrainSection
from launch.errors import ConfigError
from model.config import ModelConfig


GIB = 2 ** 30


@dataclass(frozen=True)
class GPU:
    peak_flops: float
    """Dense bf16 FLOP/s (formulas.PEAK_FLOPS_BF16)."""
    memory_gib: float
    intra_node_bw: float
    """Bytes/s per GPU, one direction, inside a node (NVLink 4: 900 GB/s both ways; NVLink 3: 600)."""
    inter_node_bw: float
    """Bytes/s per GPU, one direction, across nodes (one 400 Gb/s NDR or 200 Gb/s HDR NIC per GPU)."""
    memory_bw: float
    """Bytes/s of device memory, the datasheet's (H100 SXM 3.35 TB/s, H200 4.8 TB/s, A100 80 GB SXM 2.0 TB/s)."""


GPUS: Dict[str, GPU] = {"H100": GPU(formulas.PEAK_FLOPS_BF16["H100"], 80, 450e9, 50e9, 3.35e12),
                        "H200": GPU(formulas.PEAK_FLOPS_BF16["H200"], 141, 450e9, 50e9, 4.8e12),
                        "A100": GPU(formulas.PEAK_FLOPS_BF16["A100"], 80, 300e9, 25e9, 2.039e12)}


@dataclass(frozen=True)
class Setup:
    """One candidate layout and batch."""
    gpus: int
    tp: int
    pp: int
    micro_batch: int
    global_batch: int
    zero: int = 1
    recompute: str = "none"
    """train.recompute: none, selective (the attention core) or full (whole blocks)."""
    partition: Union[str, Tuple[int, ...]] = partition_rules.DEFAULT
    """train.partition: balanced, blocks or blocks per stage (launch/analysis/partition.py)."""
    schedule: str = "1f1b"
    """train.schedule: 1f1b or zb-h1 (launch/analysis/zero_bubble_schedule.py)."""
    precision: str = "bf16"
    """train.precision: fp32, bf16 or fp16; decides DeepSpeed's optimizer and its buffers
    (launch/analysis/engine_memory.py) and the bytes of every activation."""
    communication_data_type: Optional[str] = None
    """The recipe's deepspeed.communication_data_type: the DP all-reduce's dtype (None: engine_memory.reduce_dtype)."""
    reduce_bucket_elements: int = engine_memory.REDUCE_BUCKET_ELEMENTS
    """The recipe's deepspeed.zero_optimization.reduce_bucket_size (ZeRO-1's bucket, fp32 and fp16)."""
    grad_accum_fusion: bool = True
    """train.grad_accum_fusion: in bf16 the weight matrices' gradients go straight into the fp32 buffer."""
    cp: int = 1
    """Context-parallel degree: each rank holds s/cp tokens of every sequence; the
    replicas are dp = gpus / (tp * cp * pp), DeepSpeed's data axis dp * cp ranks."""
    ep: int = 1
    """Expert-parallel degree: each MoE block's experts split over ep ranks of the data
    axis; ZeRO-1 splits the experts' optimizer state over the dp * cp / ep ranks that hold them."""
    optimizer: str = "adamw"
    """train.optimizer: adamw, or muon (one momentum per hidden matrix element instead of two moments,
    its gathers and Newton-Schulz FLOPs: launch/analysis/muon_cost.py)."""
    expert_load: float = 1.0
    """The busiest expert's routed rows over the mean (1: balanced). A block's expert GEMMs end
    when its busiest expert's do, so the experts' compute scales by it; a run measures it (its
    metrics' expert_load counts per MoE block), the planner assumes it."""

    @property
    def data_axis(self) -> int:
        """DeepSpeed's data axis, dp * cp ranks: ZeRO-1 and the gradient all-reduce span it."""
        return self.gpus // (self.tp * self.pp)

    @property
    def expert_data_axis(self) -> int:
        """The ranks holding the same experts, dp * cp / ep: their gradients' all-reduce and ZeRO-1 span it."""
        return self.data_axis // self.ep

    @property
    def full_recompute(self) -> bool:
        return self.recompute == "full"


@dataclass(frozen=True)
class Hardware:
    peak_flops: float
    intra_node_bw: float
    inter_node_bw: float
    gpus_per_node: int = 8
    efficiency: float = 0.5
    """Fraction of peak the matmuls reach ([N21] reports 44-52% end to end)."""
    memory_bytes: Optional[float] = None
    """Per-device budget; None checks nothing."""
    profile: Optional[DeviceProfile] = None
    """GEMM rates by shape, memory bandwidth and the fixed cost per micro-batch:
    measured here (launch/autotune/calibrate.py) or the datasheet's; None: `efficiency` of peak
    at every shape, no bandwidth floor."""

    def device_profile(self) -> DeviceProfile:
        return self.profile or datasheet_profile("datasheet", self.peak_flops, self.efficiency, None)


def check_precision(setup: Setup) -> None:
    """The one precision rule of every layout, named by the planner's flags (docs/design.md contract 8)."""
    if setup.precision == "bf16" and setup.zero == 0:
        raise ConfigError("--zero 0 with bf16: DeepSpeed 0.19.8 has no ZeRO-0 bf16 path with fp32 gradient "
                          "accumulation (docs/design.md contract 8); use --zero 1, or --precision fp32")


def check_setup(model: ModelConfig, setup: Setup) -> Layout:
    """The training script's own layout rules (check_and_derive_layout), on a recipe of these dims."""
    # Checked first, so that the message names the planner's flag rather than the recipe key.
    for flag, value in [("--gpus", setup.gpus), ("--layers", model.n_layer), ("--hidden", model.n_embd),
                        ("--heads", model.n_head), ("--seq-len", model.seq_len), ("--vocab", model.vocab_size),
                        ("--vocab-pad-multiple", model.vocab_pad_multiple),
                        ("--micro-batch", setup.micro_batch), ("--global-batch", setup.global_batch)]:
        if value < 1:
            raise ConfigError(f"{flag} {value} must be >= 1")
    if setup.cp < 1:
        raise ConfigError(f"--cp {setup.cp} must be >= 1")
    per_replica = setup.tp * setup.cp * setup.pp
    if setup.tp >= 1 and setup.pp >= 1 and setup.gpus % per_replica != 0:
        raise ConfigError(f"--gpus {setup.gpus} is not divisible by tp*cp*pp = {setup.tp}*{setup.cp}*{setup.pp} = "
                          f"{per_replica}; use a multiple of {per_replica} GPUs, or a tp*cp*pp that divides "
                          f"{setup.gpus}")
    check_precision(setup)
    recipe = Recipe(model=model,
                    train=TrainSection(micro_batch_size=setup.micro_batch, global_batch_size=setup.global_batch,
                                       precision=setup.precision, zero_stage=setup.zero, cp=setup.cp, ep=setup.ep,
                                       partition=setup.partition if isinstance(setup.partition, str)
                                       else list(setup.partition)))
    return check_and_derive_layout(recipe, setup.gpus, setup.tp, setup.pp, on_cpu=False)  # its dp: the replicas


def rank_groups(tp: int, pp: int, dp: int, cp: int = 1, ep: int = 1) -> Dict[str, List[List[int]]]:
    """Global ranks of every TP, CP, PP and DP group, from the topology the training run builds:
    DeepSpeed's data axis holds dp x cp ranks, CP fastest (data index = dp_rank * cp + cp_rank);
    "data" is that axis (ZeRO-1, the gradient all-reduce), "dp" the replicas; "ep" the
    expert-parallel groups (runs of ep ranks of the data axis), "expert_data" the ranks
    holding the same experts."""
    from model.parallel.state import (build_topology, context_parallel_groups, expert_data_parallel_groups,
                                      expert_parallel_groups)
    topology = build_topology(tp, pp, dp, cp)
    data = topology.get_axis_comm_lists("data")
    return {"tp": topology.get_axis_comm_lists("model"), "cp": sorted(context_parallel_groups(topology, cp)),
            "pp": topology.get_axis_comm_lists("pipe"),
            "dp": sorted(axis[c::cp] for axis in data for c in range(cp)), "data": data,
            "ep": sorted(expert_parallel_groups(topology, ep)),
            "expert_data": sorted(expert_data_parallel_groups(topology, ep))}


def within_node(groups: List[List[int]], gpus_per_node: int) -> bool:
    return all(len({rank // gpus_per_node for rank in group}) == 1 for group in groups)
