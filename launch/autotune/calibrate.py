"""Calibration on the job's own device: the FLOP/s of the GEMMs the candidate
layouts run (their exact shapes, launch/analysis/planner.py: gemm_shapes) and the memory
bandwidth, measured with torch in the run's dtype, into a DeviceProfile the planner's cost model
uses. Cached per device, dtype, process count and software under the data cache
(`$GPT3D_CACHE/calibration/`, default ~/.cache/gpt3d/calibration/, or `$GPT3D_CALIBRATION`): a
later plan measures only shapes it has not seen.

On CPU the processes of a job share the cores, so `procs` copies of the measurement run at once
(each with the threads a rank gets, launch/engine/distributed.py: threads_per_rank) and the
slowest copy's rate is kept: the oversubscription a run meets is part of what is measured. The
copies then form a gloo group and time a ring all-reduce: the links of a job on this machine,
the optimizer's update per parameter, and, given the model, its own blocks and head as each
candidate runs them (launch/autotune/calibrate_blocks.py) and DeepSpeed's engine around them
(calibrate_engine.py). A GPU node runs the same code: one process per GPU (at most the node's
GPUs), each on its own device, an NCCL group instead of gloo; every timing waits for the device's
queue (calibrate_timing.py: a synchronize that is nothing on CPU). GEMMs are timed back to back,
one synchronize per batch of calls, and an expert GEMM as all of a rank's local experts at once,
through the model's own grouped GEMM (model/transformer/grouped_gemm.py)."""
import dataclasses
import multiprocessing
import os
import queue
import platform
import re
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from launch.analysis.device_profile import DeviceProfile, Shape, block_key, gemm_key, model_key
from launch.autotune.calibrate_blocks import Case, time_pieces
from launch.autotune.calibrate_engine import EngineOverheads, engine_overheads
from launch.autotune.calibrate_timing import back_to_back_rate, median_seconds, no_sync

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
MIN_SECONDS = 0.05   # per GEMM measurement, after one warm-up call
COPY_BYTES = {"cuda": 1 << 30, "cpu": 1 << 26}


def _torch_device():
    import torch
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _synchronize() -> Callable[[], None]:
    """What waits for this process's device: torch.cuda.synchronize on a GPU, nothing on CPU."""
    import torch
    return torch.cuda.synchronize if torch.cuda.is_available() else no_sync


def _thread_setting() -> dict:
    """Only OMP_NUM_THREADS of this environment: the calibration's own process count stands for
    the ranks on a node, not the launcher's LOCAL_SIZE."""
    return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "")}


def device_name(procs: int = 1) -> str:
    import torch
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    model = platform.processor() or "cpu"
    try:
        found = re.search(r"model name\s*:\s*(.+)", Path("/proc/cpuinfo").read_text())
        model = found.group(1).strip() if found else model
    except OSError:
        pass
    from launch.engine.distributed import threads_per_rank, usable_cpus
    threads = threads_per_rank(_thread_setting(), usable_cpus(), procs)
    return f"{model}, {procs} process{'es' if procs > 1 else ''} of {threads} thread{'s' if threads > 1 else ''}"


def software() -> str:
    import deepspeed
    import torch
    return f"torch {torch.__version__}, deepspeed {deepspeed.__version__}"


CALIBRATION_ENV = "GPT3D_CALIBRATION"
"""A directory for the profiles instead of $GPT3D_CACHE/calibration (a shared one, or an empty one)."""


def cache_path(device: str, dtype: str) -> Path:
    from data.cache import default_cache_dir
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", f"{device}-{dtype}").strip("-")
    directory = os.environ.get(CALIBRATION_ENV)
    return (Path(directory) if directory else default_cache_dir() / "calibration") / f"{slug}.json"


def gemm_call(shape: Shape, dtype: str) -> Tuple[Callable[[], object], float]:
    """(x (m, k) @ w (k, n) on this process's device, its FLOPs)."""
    import torch
    device, (m, k, n) = _torch_device(), shape
    x = torch.randn(m, k, dtype=getattr(torch, DTYPES[dtype]), device=device)
    w = torch.randn(k, n, dtype=x.dtype, device=device)
    return (lambda: x @ w), 2 * m * k * n


def expert_gemm(shape: Shape, experts: int, dtype: str) -> Tuple[Callable[[], object], float, object, object]:
    """(the forward GEMM of `experts` local experts of `shape` (m rows each, k, n) as the model runs
    it, one call for all of them (model/transformer/grouped_gemm.py: grouped_linear, torch's grouped
    GEMM where it fits, else a GEMM per expert), its FLOPs, its rows (experts x m, k), its weights
    (experts, n, k))."""
    import torch

    from model.transformer.grouped_gemm import expert_rows, grouped_linear
    device, (m, k, n) = _torch_device(), shape
    x = torch.randn(experts * m, k, dtype=getattr(torch, DTYPES[dtype]), device=device)
    weight = torch.randn(experts, n, k, dtype=x.dtype, device=device)
    rows = expert_rows(torch.full((experts,), m, dtype=torch.int64, device=device), [m] * experts)

    def call():
        with torch.no_grad():
            return grouped_linear(x, weight, rows)
    return call, experts * 2 * m * k * n, x, weight


def gemm_rate(shape: Shape, dtype: str) -> float:
    """FLOP/s of x (m, k) @ w (k, n) on this process's device, back to back for at least MIN_SECONDS."""
    call, flops = gemm_call(shape, dtype)
    return back_to_back_rate(call, flops, _synchronize(), MIN_SECONDS)


def expert_gemm_rate(shape: Shape, experts: int, dtype: str) -> float:
    """FLOP/s of `experts` experts' GEMMs of `shape` run together (`expert_gemm`), back to back: the
    rate a rank's routed rows run at (a small expert's GEMM alone fills a fraction of a GPU)."""
    call, flops, _, _ = expert_gemm(shape, experts, dtype)
    return back_to_back_rate(call, flops, _synchronize(), MIN_SECONDS)


def expert_counts(model, cases: Iterable[Case]) -> Dict[Shape, int]:
    """Each expert GEMM shape of the block `cases` (planner.gemm_shapes's "expert") -> the experts
    a rank holds there, E / ep; where cases of different ep share a shape, the fewest (a GPU runs
    fewer small GEMMs at a lower rate: the conservative one)."""
    from launch.analysis.plan_setup import Setup
    from launch.analysis.planner import gemm_shapes
    arch = model.resolved()
    if not arch.moe.enabled:
        return {}
    counts: Dict[Shape, int] = {}
    for tp, ep, b, tokens in cases:
        setup = Setup(gpus=tp * ep, tp=tp, pp=1, micro_batch=b, global_batch=b, cp=model.seq_len // tokens, ep=ep)
        shape = tuple(gemm_shapes(model, setup)["expert"])
        counts[shape] = min(counts.get(shape, arch.moe.num_experts), arch.moe.num_experts // ep)
    return counts


def memory_bandwidth(dtype: str) -> float:
    """Bytes/s of a device-memory copy (read and write), median of 5."""
    import torch
    device = _torch_device()
    src = torch.empty(COPY_BYTES[device.type] // 2, dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    sync = _synchronize()
    seconds = median_seconds(lambda: (dst.copy_(src), sync()), 5, before=sync)
    return 2 * src.numel() * src.element_size() / seconds


def optimizer_seconds_per_param() -> float:
    """Seconds of torch's AdamW update (fp32, foreach, as the run's optimizer) per parameter, median of 5."""
    import torch
    weight = torch.nn.Parameter(torch.zeros(COPY_BYTES[_torch_device().type] // 16, device=_torch_device()))
    weight.grad = torch.ones_like(weight)
    adam = torch.optim.AdamW([weight], lr=1e-3)
    sync = _synchronize()
    return median_seconds(lambda: (adam.step(), sync()), 5, before=sync) / weight.numel()


def host_sync_seconds() -> float:
    """Seconds of a host sync as an MoE block makes one: a small result copied to the host, which
    waits for it, median of 101."""
    import torch
    counts = torch.ones(8, dtype=torch.int64, device=_torch_device())
    return median_seconds(lambda: (counts + 1).tolist(), 101)


def _collective_seconds(call: Callable[[], object], repeats: int) -> float:
    """Median seconds of a collective `call` to its end on the device (gloo's on CPU, NCCL's on a
    GPU), after one warm-up, each call started together (a barrier of every process before it)."""
    import torch.distributed as dist
    sync = _synchronize()
    return median_seconds(lambda: (call(), sync()), repeats, before=lambda: (dist.barrier(), sync()))


def _all_reduce_seconds(tensor, repeats: int, group=None) -> float:
    """Median seconds of an all-reduce of `tensor` in `group` (this process group by default)."""
    import torch.distributed as dist
    return _collective_seconds(lambda: dist.all_reduce(tensor, group=group), repeats)


def link_bandwidth(procs: int, group=None) -> float:
    """Bus bytes/s of a ring all-reduce of 8 MiB in `group` of `procs` processes (this process
    group by default; 2(n-1)/n of the buffer per rank, the planner's ring factor), median of 5."""
    import torch
    buffer = torch.ones(1 << 21, dtype=torch.float32, device=_torch_device())
    return 2 * (procs - 1) / procs * buffer.numel() * buffer.element_size() / _all_reduce_seconds(buffer, 5, group)


def all_to_all_bandwidth(procs: int, group=None) -> float:
    """Bytes/s each rank sends in an all-to-all of 8 MiB in `group` of `procs` processes (this
    process group by default; (n-1)/n of its buffer leaves it, as the planner counts CP's and EP's
    exchanges), median of 5."""
    import torch
    import torch.distributed as dist
    send = torch.ones(1 << 21, dtype=torch.float32, device=_torch_device())
    received = torch.empty_like(send)
    seconds = _collective_seconds(lambda: dist.all_to_all_single(received, send, group=group), 5)
    return (procs - 1) / procs * send.numel() * send.element_size() / seconds


def group_bandwidths(procs: int) -> dict:
    """"all_reduce:K" and "all_to_all:K" (group_bw) for every group size K, 1 < K < procs, that
    divides procs: the processes cut into procs / K groups of K consecutive ranks, every group
    measuring at once (a candidate's groups all communicate together), this rank's group's rate.
    Each rank creates every group, in the same order (torch.distributed.new_group's rule)."""
    import torch.distributed as dist
    rank, measured = dist.get_rank(), {}
    for size in [k for k in range(2, procs) if procs % k == 0]:
        groups = [dist.new_group(list(range(start, start + size))) for start in range(0, procs, size)]
        group = groups[rank // size]
        measured[f"all_reduce:{size}"] = link_bandwidth(size, group)
        measured[f"all_to_all:{size}"] = all_to_all_bandwidth(size, group)
    return measured


def point_to_point_bandwidth() -> float:
    """Bytes/s of 8 MiB sent from each even rank to the next odd one (a pipeline stage's transfer,
    every pair at once), median of 5."""
    import torch
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    buffer = torch.ones(1 << 21, dtype=torch.float32, device=_torch_device())
    peer = rank + 1 if rank % 2 == 0 else rank - 1

    def transfer():
        if peer < world:
            (dist.send if rank % 2 == 0 else dist.recv)(buffer, peer)
    return buffer.numel() * buffer.element_size() / _collective_seconds(transfer, 5)


def link_latency() -> float:
    """Seconds of a one-element all-reduce in this process group, median of 21: what every
    collective costs besides its bytes."""
    import torch
    return _all_reduce_seconds(torch.ones(1, device=_torch_device()), 21)


def _measure(shapes: List[Shape], dtype: str, threads: Optional[int] = None, rank: int = 0, procs: int = 1,
             port: int = 0, results=None, model=None, cases: Sequence[Case] = (), links: bool = True,
             engine: bool = True, experts: Optional[Dict[Shape, int]] = None) -> dict:
    """Every shape's GEMM rate (an expert shape's, `experts`, for that many experts at once), the
    memory bandwidth and the optimizer's rate in this process; with `procs` > 1 also the link
    bandwidth of a group of the processes (gloo on CPU, NCCL on GPUs, one each); with `model`, its
    pieces at `cases` in that group (put on `results`, a queue). `links`, `engine`: also what a
    profile measures only once (the links; the engine's costs, with cases); a later calibration adds
    shapes and cases."""
    import torch
    if threads:
        torch.set_num_threads(threads)
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(rank)
        if results is not None:  # a calibration process of its own: DeepSpeed's engine (the probe) on this
            os.environ["DS_ACCELERATOR"] = "cuda"  # GPU, where launch/plan.py set cpu for the parent
    experts = experts or {}
    measured = {"gemm": {gemm_key(*s): expert_gemm_rate(s, experts[s], dtype) if s in experts else gemm_rate(s, dtype)
                         for s in shapes},
                "memory_bw": memory_bandwidth(dtype), "optimizer_s_per_param": optimizer_seconds_per_param(),
                "host_sync_s": host_sync_seconds()}
    if procs > 1 or cases:
        import torch.distributed as dist
        from launch.engine.distributed import free_port
        port = port or free_port()
        # DeepSpeed's engine (the probe) reads the launcher's variables.
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(procs), LOCAL_WORLD_SIZE=str(procs),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group(BACKENDS[on_gpu], init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=procs)
        if procs > 1 and links:
            measured["link_bw"], measured["link_latency_s"] = link_bandwidth(procs), link_latency()
            measured["all_to_all_bw"], measured["p2p_bw"] = all_to_all_bandwidth(procs), point_to_point_bandwidth()
            measured["group_bw"] = dict(group_bandwidths(procs), **{f"all_reduce:{procs}": measured["link_bw"],
                                                                    f"all_to_all:{procs}": measured["all_to_all_bw"]})
        if cases:
            measured["blocks"] = time_pieces(model, cases, dtype, _torch_device(), _synchronize())
            if engine:
                measured.update(dataclasses.asdict(engine_overheads(procs, dtype, backend=BACKENDS[on_gpu])))
        dist.destroy_process_group()
    if results is not None:
        results.put(measured)
    return measured


BACKENDS = {False: "gloo", True: "nccl"}
"""The calibration's process group on CPU and on GPUs: the training run's own."""


def _measured_at_once(shapes: List[Shape], dtype: str, procs: int, model=None, cases: Sequence[Case] = (),
                      links: bool = True, engine: bool = True, experts: Optional[Dict[Shape, int]] = None) -> dict:
    """`_measure` in `procs` processes started together, each its rank's share of the cores (on GPUs
    its own device); the slowest rate of each (the slowest time of each piece), and their group's
    all-reduce bandwidth."""
    if procs <= 1 and not cases:
        return _measure(shapes, dtype, experts=experts)  # in this process: no process group, nothing left behind
    from launch.engine.distributed import free_port, threads_per_rank, usable_cpus
    threads, port = threads_per_rank(_thread_setting(), usable_cpus(), procs), free_port()
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ranks = [context.Process(target=_measure, args=(shapes, dtype, threads, r, procs, port, results, model, cases,
                                                    links, engine, experts)) for r in range(procs)]
    for process in ranks:
        process.start()
    measured = []
    while len(measured) < procs:
        try:
            measured.append(results.get(timeout=5))
        except queue.Empty:
            failed = [p.exitcode for p in ranks if p.exitcode not in (None, 0)]
            if failed:  # a process that died never answers: its traceback is above
                for process in ranks:
                    process.kill()
                raise RuntimeError(f"a calibration process failed (exit {failed[0]})") from None
    for process in ranks:
        process.join()
    links = {key: pick(r[key] for r in measured) for key, pick in (
        ("link_bw", min), ("link_latency_s", max), ("all_to_all_bw", min), ("p2p_bw", min)) if key in measured[0]}
    groups = {key: min(r["group_bw"][key] for r in measured) for key in measured[0].get("group_bw", {})}
    return {"gemm": {key: min(r["gemm"][key] for r in measured) for key in measured[0]["gemm"]},
            **({"group_bw": groups} if groups else {}),
            "memory_bw": min(r["memory_bw"] for r in measured), **links,
            "optimizer_s_per_param": max(r["optimizer_s_per_param"] for r in measured),
            "host_sync_s": max(r["host_sync_s"] for r in measured),
            "blocks": {key: max(r["blocks"][key] for r in measured) for key in measured[0].get("blocks", {})},
            **{key: max(r[key] for r in measured) for key in ENGINE_COSTS if key in measured[0]}}


ENGINE_COSTS = [f.name for f in dataclasses.fields(EngineOverheads)]


def _runnable(cases: Iterable[Case], procs: int) -> List[Case]:
    """The cases whose TP and EP groups the calibration's processes can form (tp | procs, ep | procs / tp)."""
    return sorted({c for c in cases if procs % c[0] == 0 and (procs // c[0]) % c[1] == 0})


def calibrated_profile(shapes: Iterable[Shape], dtype: str = "bf16", procs: int = 1, model=None,
                       cases: Iterable[Case] = ()) -> DeviceProfile:
    """The cached profile of this device, measured for every GEMM shape and, with `model`, every
    block case (launch/analysis/planner.py: block_case) it lacks, and saved again."""
    import torch
    on_gpu = torch.cuda.is_available()
    procs = min(procs, torch.cuda.device_count()) if on_gpu else procs  # a process per GPU
    cases = list(cases)
    device = device_name(procs)
    path = cache_path(device, dtype)
    profile = DeviceProfile.from_json(path.read_text()) if path.exists() else None
    if profile is None or profile.software != software():
        profile = DeviceProfile(device=device, source="calibrated", dtype=dtype, software=software())
    missing = sorted({tuple(s) for s in shapes} - set(profile.shapes()))
    key = model_key(model) if model is not None else None
    new_cases = [c for c in _runnable(cases, procs) if block_key(key, "head", *c) not in profile.blocks] if key else []
    # Links and the engine's costs are measured once: the links with 2+ processes (a profile of
    # before the group sizes measures them again), the engine's costs with the profile's first cases
    # (one of before the per-tensor costs again, with one case of the engine's process group).
    links = procs > 1 and (profile.link_bw is None or not profile.group_bw)
    engine = key is not None and (not profile.per_step_s or profile.per_tensor_microbatch_s is None)
    if engine and not new_cases:
        new_cases = _runnable(cases, procs)[:1]
    if missing or new_cases or links or profile.memory_bw is None or profile.optimizer_s_per_param is None:
        experts = expert_counts(model, cases) if model is not None else {}
        measured = _measured_at_once(missing, dtype, procs, model, new_cases, links=links, engine=engine,
                                     experts={s: n for s, n in experts.items() if s in missing})
        profile.gemm.update(measured["gemm"])
        profile.blocks.update(measured.get("blocks", {}))
        profile.memory_bw = measured["memory_bw"] if profile.memory_bw is None else profile.memory_bw
        profile.optimizer_s_per_param = profile.optimizer_s_per_param or measured["optimizer_s_per_param"]
        profile.host_sync_s = profile.host_sync_s or measured["host_sync_s"]
        profile.link_bw = measured.get("link_bw", profile.link_bw)
        profile.link_latency_s = measured.get("link_latency_s", profile.link_latency_s)
        profile.all_to_all_bw = measured.get("all_to_all_bw", profile.all_to_all_bw)
        profile.p2p_bw = measured.get("p2p_bw", profile.p2p_bw)
        profile.group_bw = measured.get("group_bw", profile.group_bw)
        for cost in ENGINE_COSTS:
            setattr(profile, cost, measured.get(cost, getattr(profile, cost)))
        profile.save(path)
    return profile
