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
from launch.analysis.memory_formulas import process_fixed_bytes
from launch.analysis import partition as partition_rules
from data.spec import DataSpec
from launch.config.layout import Layout, check_and_derive_layout
from launch.config.recipe import Recipe, TrainSection
from launch.errors import ConfigError
from model.config import ModelConfig


GIB = 2 ** 30


@dataclass(frozen=True)
class GPU:
    peak_flops: float
    """Dense bf16 FLOP/s (no sparsity)."""
    memory_gib: float
    """The vendor's memory size (HBM's "GB" are GiB of chips; a device reports a little less)."""
    intra_node_bw: float
    """Bytes/s per GPU, one direction, inside a node (NVLink, xGMI, else PCIe)."""
    inter_node_bw: float
    """Bytes/s per GPU, one direction, across nodes (one NIC per GPU, as in the vendor's reference node)."""
    memory_bw: float
    """Bytes/s of device memory, the datasheet's."""
    names: Tuple[str, ...] = ()
    """The device's name as torch.cuda.get_device_name reports it: matched whole, never as a part
    ("NVIDIA GH200 480GB" is not an H200, "NVIDIA H100 PCIe" not the SXM)."""
    source: str = ""
    """The datasheet the numbers are from."""


# Sources: NVIDIA H100 Tensor Core GPU datasheet (SXM, PCIe, NVL columns); NVIDIA H200 datasheet;
# NVIDIA H800 product brief (NVLink 400 GB/s); NVIDIA H20 (HGX H20) datasheet; NVIDIA A100
# datasheet (40/80 GB, SXM/PCIe); NVIDIA DGX B200 / HGX B200 datasheet (8 TB/s, NVLink 5 1.8 TB/s);
# NVIDIA L40S datasheet (PCIe 4.0, no NVLink); AMD Instinct MI300X datasheet (7 Infinity Fabric
# links, 896 GB/s in all). Link figures are both directions on the sheets; halved here. The NIC
# across nodes: 400 Gb/s NDR per GPU (DGX H100/B200), 200 Gb/s HDR for A100 (DGX A100); PCIe cards
# are capped by their slot (PCIe 5.0 x16 64 GB/s, 4.0 x16 32 GB/s a direction).
_HOPPER_NIC, _AMPERE_NIC = 50e9, 25e9
GPUS: Dict[str, GPU] = {
    "H100": GPU(formulas.PEAK_FLOPS_BF16["H100"], 80, 450e9, _HOPPER_NIC, 3.35e12,
                ("NVIDIA H100 80GB HBM3",), "NVIDIA H100 datasheet, SXM5"),
    "H100-PCIe": GPU(756e12, 80, 64e9, _HOPPER_NIC, 2.0e12, ("NVIDIA H100 PCIe",), "NVIDIA H100 datasheet, PCIe"),
    "H100-NVL": GPU(835e12, 94, 64e9, _HOPPER_NIC, 3.9e12, ("NVIDIA H100 NVL",),
                    "NVIDIA H100 datasheet, NVL (the NVLink bridge joins pairs only: PCIe 5.0 between pairs)"),
    "H200": GPU(formulas.PEAK_FLOPS_BF16["H200"], 141, 450e9, _HOPPER_NIC, 4.8e12, ("NVIDIA H200",),
                "NVIDIA H200 datasheet, SXM"),
    "H200-NVL": GPU(835e12, 141, 64e9, _HOPPER_NIC, 4.8e12, ("NVIDIA H200 NVL",),
                    "NVIDIA H200 datasheet, NVL (bridges of 2 or 4: PCIe 5.0 beyond them)"),
    "H800": GPU(989e12, 80, 200e9, _HOPPER_NIC, 3.35e12, ("NVIDIA H800",), "NVIDIA H800 SXM5 (NVLink 400 GB/s)"),
    "H20": GPU(148e12, 96, 450e9, _HOPPER_NIC, 4.0e12, ("NVIDIA H20",), "NVIDIA HGX H20 datasheet"),
    "A100": GPU(formulas.PEAK_FLOPS_BF16["A100"], 80, 300e9, _AMPERE_NIC, 2.039e12, ("NVIDIA A100-SXM4-80GB",),
                "NVIDIA A100 datasheet, 80 GB SXM"),
    "A100-40GB": GPU(312e12, 40, 300e9, _AMPERE_NIC, 1.555e12, ("NVIDIA A100-SXM4-40GB",),
                     "NVIDIA A100 datasheet, 40 GB SXM"),
    "A100-PCIe": GPU(312e12, 80, 32e9, _AMPERE_NIC, 1.935e12, ("NVIDIA A100 80GB PCIe",),
                     "NVIDIA A100 datasheet, 80 GB PCIe"),
    "A100-PCIe-40GB": GPU(312e12, 40, 32e9, _AMPERE_NIC, 1.555e12, ("NVIDIA A100-PCIE-40GB",),
                          "NVIDIA A100 datasheet, 40 GB PCIe"),
    "B200": GPU(2.25e15, 180, 900e9, _HOPPER_NIC, 8.0e12, ("NVIDIA B200",),
                "NVIDIA HGX B200 datasheet (36 PFLOP/s bf16 with sparsity for 8 GPUs)"),
    "L40S": GPU(362e12, 48, 32e9, _AMPERE_NIC, 0.864e12, ("NVIDIA L40S",), "NVIDIA L40S datasheet (PCIe 4.0)"),
    "MI300X": GPU(1307e12, 192, 448e9, _HOPPER_NIC, 5.3e12, ("AMD Instinct MI300X",), "AMD Instinct MI300X datasheet"),
}

UNKNOWN_INTRA_NODE_BW = 32e9
"""An unknown device's links in a node when none were measured: PCIe 4.0 x16, one direction (the
slowest link a current accelerator node has between its devices)."""
UNKNOWN_INTER_NODE_BW = 12.5e9
"""An unknown device's links across nodes: one 100 Gb/s NIC per device."""

RANK_COMMUNICATORS = 6
"""The NCCL communicators a rank of a 3D run holds: its TP, PP, data-axis, EP and expert-data
groups (model/parallel/state.py) and the world's (the run's barriers, DeepSpeed's own). A CP group
or a pipeline neighbour's point-to-point pair adds one, but each is counted at NCCL's upper bound
of channels (memory_formulas.NCCL_CHANNELS), which most topologies stay well below."""
HEADROOM_BYTES = process_fixed_bytes(RANK_COMMUNICATORS)
"""Device memory a training process cannot give to tensors, whatever the model (2.06 GiB): the CUDA
context and its loaded kernels, cuBLAS's workspaces and NCCL's communicator buffers, counted in
one place, memory_formulas.process_fixed_bytes."""
HEADROOM_FRACTION = 0.05
"""And PyTorch's caching allocator's fragmentation: blocks reserved but not allocated at the peak."""


def usable_memory_bytes(total_bytes: float) -> float:
    """What the planner lets a rank's predicted memory reach: the device's total less the headroom
    (an "80 GB" H100, 79.1 GiB reported, gives 73.1 GiB)."""
    return total_bytes * (1 - HEADROOM_FRACTION) - HEADROOM_BYTES


def known_gpu(device_name: str) -> Optional[Tuple[str, GPU]]:
    """The datasheet entry whose reported name is exactly `device_name` (case and spacing aside), else None."""
    key = " ".join(device_name.split()).casefold()
    return next(((label, gpu) for label, gpu in GPUS.items() if key in {n.casefold() for n in gpu.names}), None)


def device_hardware(name: str, total_memory_bytes: Optional[float], profile: Optional[DeviceProfile],
                    gpus_per_node: int, precision: str = "bf16", efficiency: float = 0.5, roofline: bool = False,
                    gpu: Optional[GPU] = None) -> Tuple["Hardware", List[str]]:
    """The one place a device becomes the planner's Hardware (launch/plan.py's --gpu, and on a GPU
    what --layout auto and every run's prediction use): the datasheet of `gpu`, else of the entry
    named exactly `name`; its memory budget `total_memory_bytes` (the device's own, else the
    datasheet's) less the headroom; its calibration `profile`, else the datasheet's flat rate; links
    measured, else the datasheet's, else a stated conservative default, never free. Returns the
    lines to print about what was assumed."""
    notes = []
    if gpu is None:
        found = known_gpu(name)
        gpu = found[1] if found else None
    total = total_memory_bytes if total_memory_bytes is not None else (gpu.memory_gib * GIB if gpu else None)
    if profile is None:
        if gpu is None:
            raise ConfigError(f"no datasheet or calibration of {name!r}: `launch/plan.py --calibrate` on it measures one")
        profile = datasheet_profile(name, gpu.peak_flops, efficiency, gpu.memory_bw, roofline, precision)
    if gpu is not None:
        intra, inter = gpu.intra_node_bw, gpu.inter_node_bw
    else:
        intra = profile.link_bw or UNKNOWN_INTRA_NODE_BW
        inter = min(intra, UNKNOWN_INTER_NODE_BW)
        how = "measured" if profile.link_bw else "assumed (PCIe 4.0 x16)"
        notes.append(f"{name!r} has no datasheet entry: links {how} {intra / 1e9:.3g} GB/s in a node and "
                     f"{inter / 1e9:.3g} GB/s across (one 100 Gb/s NIC a device assumed), peak from its fastest "
                     f"measured GEMM")
    peak = gpu.peak_flops if gpu else max(list(profile.gemm.values()) + [profile.flat_rate or 0.0], default=1.0) or 1.0
    return Hardware(peak_flops=peak, intra_node_bw=intra, inter_node_bw=inter, gpus_per_node=gpus_per_node,
                    efficiency=efficiency, memory_bytes=usable_memory_bytes(total) if total else None,
                    profile=profile, notes=tuple(notes)), notes


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
    virtual_stages: int = 1
    """train.virtual_stages: chunks of the layer table per pipeline rank (interleaved 1F1B,
    launch/analysis/interleaved_schedule.py); 1: no interleaving."""
    compile: bool = False
    """The recipe's train.compile: only the run's refusal of it at v > 1 reads it."""
    document_mask: bool = False
    """The recipe's data.document_mask: only the run's refusal of it at v > 1 reads it."""
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
    notes: Tuple[str, ...] = ()
    """What was assumed about the device and must be said (an unknown device's links)."""

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
    interleaved = setup.virtual_stages > 1
    recipe = Recipe(model=model, data=DataSpec(document_mask=setup.document_mask and interleaved),
                    train=TrainSection(micro_batch_size=setup.micro_batch, global_batch_size=setup.global_batch,
                                       precision=setup.precision, zero_stage=setup.zero, cp=setup.cp, ep=setup.ep,
                                       # The run's refusals of v > 1 (check_virtual_stages) name the schedule and
                                       # optimizer: passed where they apply, so a v = 1 plan is checked as before.
                                       virtual_stages=setup.virtual_stages,
                                       **(dict(schedule=setup.schedule, optimizer=setup.optimizer,
                                               compile=setup.compile) if interleaved else {}),
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
