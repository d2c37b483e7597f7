"""The GPU path of the layout choice, on a faked CUDA device (torch.cuda patched: name, total
memory, capability, count; no cached calibration): `--layout auto` (auto_layout.rank_layouts) and
`launch/plan.py --search --gpu this` take the device through the one function
(step_prediction.this_device_hardware -> plan_setup.device_hardware), keep every pick within the
device's reported memory less the headroom, match device names whole, and never cost a link as free."""
import json
import math

import pytest

from launch.analysis.plan_setup import GIB, GPUS, usable_memory_bytes
from launch.config.recipe import load_recipe
from launch.errors import REPO_ROOT

RECIPES = REPO_ROOT / "recipes"
H100_NAME = "NVIDIA H100 80GB HBM3"
H100_TOTAL = 81004 * 2 ** 20
"""torch.cuda.get_device_properties on an H100 SXM prints total_memory=81004MB (MiB): 79.1 GiB of its "80 GB"."""


class _Properties:
    def __init__(self, name: str, total: int):
        self.name, self.total_memory, self.major, self.minor, self.multi_processor_count = name, total, 9, 0, 132


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """Patch torch.cuda into one node of `name` GPUs; the calibration cache an empty folder."""
    import torch

    def install(name: str = H100_NAME, total: int = H100_TOTAL, count: int = 8):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: _Properties(name, total))
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setenv("GPT3D_CALIBRATION", str(tmp_path))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(count))
        monkeypatch.setenv("RANK", "0")
        return tmp_path
    return install


def _search(capsys, *args) -> dict:
    from launch.plan import main
    assert main([*args, "--search", "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _auto(recipe_name: str, world: int, fixed: dict):
    from launch.autotune.auto_layout import rank_layouts
    recipe = load_recipe(RECIPES / recipe_name, [])
    return rank_layouts(recipe, world, fixed, recipe.model.vocab_size, 8, on_cpu=False)


@pytest.mark.slow  # two whole searches of llama2-7b and qwen3 on a faked H100 node: 14 s (the device path's other checks stay fast)
def test_layout_auto_on_h100s_picks_what_plan_search_picks_and_it_fits(fake_gpu, capsys):
    """llama2-7b on 8 faked H100s, the recipe's recompute and schedule kept (plan.py --search keeps
    them): the pick is plan.py --search --gpu this's first row, with the same step time, and its
    predicted memory is within the reported 79.1 GiB less the headroom."""
    fake_gpu()
    budget = usable_memory_bytes(H100_TOTAL)
    assert 70 * GIB < budget < H100_TOTAL
    ranked, cost_model, said = _auto("llama2-7b.yaml", 8, {"recompute": "full", "schedule": "1f1b"})
    searched = _search(capsys, "--recipe", str(RECIPES / "llama2-7b.yaml"), "--gpus", "8", "--gpu", "this")
    assert searched["memory_budget_bytes"] == budget
    first = searched["search"][0]
    assert all(r["memory_per_device_bytes"] <= budget for r in ranked)
    assert ranked[0]["memory_per_device_bytes"] <= budget
    pick = lambda r: tuple(r[k] for k in ("tp", "pp", "cp", "ep", "micro_batch", "recompute", "schedule"))  # noqa: E731
    assert pick(ranked[0]) == pick(first)
    assert ranked[0]["step_time_s"] == pytest.approx(first["step_time_s"], rel=1e-12)
    assert cost_model.startswith("datasheet, 50% of 989 TFLOP/s")


@pytest.mark.slow  # every pp and ep of 32 GPUs at tp 1 and cp 1 (all 1,848 candidates: about a minute)
def test_qwen3_on_32_h100s_picks_a_layout_that_fits(fake_gpu):
    fake_gpu()
    ranked, _, _ = _auto("qwen3-30b-a3b.yaml", 32, {"tp": 1, "cp": 1, "recompute": "full", "schedule": "1f1b"})
    assert ranked and ranked[0]["memory_per_device_bytes"] <= usable_memory_bytes(H100_TOTAL)


def test_qwen3_at_pp_1_on_32_h100s_needs_experts_split_to_fit(fake_gpu):
    """qwen3-30b-a3b on 32 faked H100s at tp 1, pp 1: a rank holding all 128 experts of 48 blocks
    does not fit 80 GB, so the pick splits them (the recipe's own layout is ep 8 at 40.3 GiB)."""
    fake_gpu()
    ranked, _, _ = _auto("qwen3-30b-a3b.yaml", 32, {"tp": 1, "pp": 1, "cp": 1, "recompute": "full",
                                                     "schedule": "1f1b"})
    budget = usable_memory_bytes(H100_TOTAL)
    assert ranked and all(r["memory_per_device_bytes"] <= budget for r in ranked)
    assert ranked[0]["ep"] > 1


def test_device_names_match_whole(fake_gpu):
    """A GH200 is not an H200 (no datasheet: not planned without a calibration); an H100 PCIe gets
    the PCIe card's 756 TFLOP/s and 2.0 TB/s, not the SXM's 989 and 3.35."""
    from launch.autotune.step_prediction import this_device_hardware
    fake_gpu("NVIDIA GH200 480GB", 480 * GIB)
    hardware, why_not = this_device_hardware("bf16", 8)
    assert hardware is None and "no calibration of 'NVIDIA GH200 480GB'" in why_not
    fake_gpu("NVIDIA H100 PCIe", 81559 * 2 ** 20)
    hardware, _ = this_device_hardware("bf16", 8)
    assert hardware.peak_flops == 756e12 and hardware.profile.memory_bw == 2.0e12
    assert hardware.intra_node_bw < GPUS["H100"].intra_node_bw  # no NVLink switch between PCIe cards
    for name, label in (("NVIDIA H200", "H200"), ("NVIDIA H200 NVL", "H200-NVL"), ("NVIDIA H100 NVL", "H100-NVL"),
                        ("NVIDIA A100-SXM4-40GB", "A100-40GB"), ("AMD Instinct MI300X", "MI300X")):
        fake_gpu(name, 80 * GIB)
        hardware, _ = this_device_hardware("bf16", 8)
        assert hardware.peak_flops == GPUS[label].peak_flops and hardware.profile.memory_bw == GPUS[label].memory_bw


def test_an_unknown_device_gets_finite_links_and_says_so(fake_gpu, capsys):
    """'NVIDIA Future GPU' with a cached calibration of its GEMMs and memory but no links: its links
    are the stated conservative default (never infinite), and plan.py --gpu this prints one line."""
    from launch.analysis.device_profile import DeviceProfile, gemm_key
    from launch.autotune.calibrate import cache_path
    from launch.autotune.step_prediction import this_device_hardware
    name = "NVIDIA Future GPU"
    fake_gpu(name, 100 * GIB)
    DeviceProfile(device=name, source="calibrated", gemm={gemm_key(4096, 4096, 4096): 600e12},
                  memory_bw=4e12).save(cache_path(name, "bf16"))
    hardware, _ = this_device_hardware("bf16", 8)
    assert math.isfinite(hardware.intra_node_bw) and math.isfinite(hardware.inter_node_bw)
    assert 0 < hardware.inter_node_bw <= hardware.intra_node_bw <= 64e9
    assert hardware.memory_bytes == usable_memory_bytes(100 * GIB)
    assert len(hardware.notes) == 1 and "no datasheet entry" in hardware.notes[0]
    from launch.plan import main
    assert main(["--recipe", str(RECIPES / "tiny.yaml"), "--gpus", "16", "--tp", "2", "--precision", "bf16",
                 "--gpu", "this"]) == 0
    out = capsys.readouterr().out
    assert sum("no datasheet entry" in line for line in out.splitlines()) == 1


def test_near_ties_go_to_the_conventional_layout():
    """Within the model's 20% the pick is the layout with TP in a node and fewer axes; outside it,
    the fastest; and the candidates it could not separate are named."""
    from launch.analysis.plan_report import ties_line
    from launch.analysis.planner import MODEL_ERROR, pick_first

    def plan(tp, pp, seconds, in_node=True):
        return {"tp": tp, "pp": pp, "cp": 1, "ep": 1, "micro_batch": 1, "recompute": "none", "schedule": "1f1b",
                "step_time_s": seconds, "memory_per_device_bytes": 1, "groups_within_node": {"tp": in_node}}
    fast, plain, across = plan(2, 4, 1.00), plan(1, 1, 1.15), plan(1, 2, 1.30)
    ordered, ties = pick_first([fast, plain, across])
    assert MODEL_ERROR == 0.20 and ordered == [plain, fast, across] and ties == [fast]
    line = ties_line(ordered[0], ties)
    assert "within 20%" in line and "tp 2 cp 1 pp 4" in line
    ordered, ties = pick_first([plan(2, 1, 1.00), plan(1, 1, 1.25)])
    assert ordered[0]["tp"] == 2 and ties == []
    ordered, _ = pick_first([plan(16, 1, 1.00, in_node=False), plan(8, 2, 1.05)])
    assert ordered[0]["tp"] == 8  # TP inside a node before fewer axes
