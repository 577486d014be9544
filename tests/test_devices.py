"""Where a cluster's engines run (``dualpath/devices.py``): ``auto`` resolved, GPUs handed out
round robin through ``CUDA_VISIBLE_DEVICES``, a shared GPU's memory split explicitly; and the
device fields of ``EngineConfig``. Fake GPU counts: no device needed."""

from __future__ import annotations

import pytest

from dualpath.config import EngineConfig
from dualpath.devices import (
    GPU_ENV,
    MEMORY_FRACTION_ENV,
    DevicePlacementError,
    check_kv_fits,
    memory_fraction_from,
    plan_devices,
    ray_gpu_share,
    resolve_device,
    visible_gpu_ids,
)
from dualpath.errors import DualPathError

ENGINES = ["pe0", "de1", "de2"]


def test_auto_is_cuda_only_where_a_gpu_is_visible():
    assert resolve_device("auto", 0) == "cpu"
    assert resolve_device("auto", 2) == "cuda"
    assert resolve_device("cpu", 4) == "cpu"
    assert resolve_device("cuda:1", 2) == "cuda:1"


def test_a_cuda_device_the_host_lacks_is_refused():
    with pytest.raises(DevicePlacementError, match="no CUDA device"):
        resolve_device("cuda", 0)
    with pytest.raises(DevicePlacementError, match="only 2 CUDA"):
        resolve_device("cuda:2", 2)
    assert issubclass(DevicePlacementError, DualPathError)


def test_visible_gpu_ids_follow_the_parents_own_visible_devices():
    assert visible_gpu_ids({}, 3) == ["0", "1", "2"]
    assert visible_gpu_ids({GPU_ENV: "2,5"}, 2) == ["2", "5"]
    assert visible_gpu_ids({GPU_ENV: "GPU-aa, GPU-bb"}, 2) == ["GPU-aa", "GPU-bb"]
    assert visible_gpu_ids({GPU_ENV: "4,6,7"}, 1) == ["4"]  # torch counts what it can use
    assert visible_gpu_ids({GPU_ENV: ""}, 0) == []


def test_engines_take_the_gpus_round_robin_and_split_a_shared_ones_memory():
    plan = plan_devices(ENGINES, "cuda", ["0", "1"])
    assert plan.device == "cuda"
    assert plan.env("pe0") == {GPU_ENV: "0", MEMORY_FRACTION_ENV: "0.5"}
    assert plan.env("de1") == {GPU_ENV: "1", MEMORY_FRACTION_ENV: "1"}
    assert plan.env("de2") == {GPU_ENV: "0", MEMORY_FRACTION_ENV: "0.5"}
    assert plan.engines_per_gpu() == {"0": 2, "1": 1}


def test_each_engine_has_a_gpu_of_its_own_when_there_are_enough():
    plan = plan_devices(ENGINES, "auto", ["3", "5", "6", "7"])
    assert [plan.env(n)[GPU_ENV] for n in ENGINES] == ["3", "5", "6"]
    assert {plan.env(n)[MEMORY_FRACTION_ENV] for n in ENGINES} == {"1"}


def test_engines_on_one_gpu_share_it_evenly():
    plan = plan_devices(ENGINES, "cuda", ["0"])
    assert {n: plan.engines[n].gpu for n in ENGINES} == {n: "0" for n in ENGINES}
    assert all(plan.engines[n].memory_fraction == pytest.approx(1 / 3) for n in ENGINES)
    assert plan.env("pe0")[MEMORY_FRACTION_ENV] == "0.333333"


def test_a_numbered_device_pins_every_engine_to_that_visible_gpu():
    plan = plan_devices(ENGINES, "cuda:1", ["4", "6"])
    assert plan.device == "cuda"  # inside each engine its one visible GPU is cuda:0
    assert {plan.env(n)[GPU_ENV] for n in ENGINES} == {"6"}


def test_a_configured_fraction_is_used_unless_it_overcommits_a_gpu():
    plan = plan_devices(ENGINES, "cuda", ["0"], memory_fraction=0.3)
    assert {plan.env(n)[MEMORY_FRACTION_ENV] for n in ENGINES} == {"0.3"}
    with pytest.raises(DevicePlacementError, match="3 engines on GPU 0"):
        plan_devices(ENGINES, "cuda", ["0"], memory_fraction=0.4)
    assert plan_devices(ENGINES, "cuda", ["0", "1", "2"], memory_fraction=0.9).env("de2") == {
        GPU_ENV: "2", MEMORY_FRACTION_ENV: "0.9"}


def test_cpu_engines_get_no_placement():
    for device, gpus in (("cpu", ["0", "1"]), ("auto", [])):
        plan = plan_devices(ENGINES, device, gpus)
        assert plan.device == "cpu"
        assert plan.env("pe0") == {}
        assert plan.engines_per_gpu() == {}


def test_ray_engines_ask_for_the_share_of_a_gpu_that_lets_them_all_fit():
    assert ray_gpu_share(3, "cuda", 1.0) == ("cuda", pytest.approx(1 / 3), pytest.approx(1 / 3))
    assert ray_gpu_share(3, "auto", 2.0) == ("cuda", 0.5, 0.5)
    assert ray_gpu_share(3, "cuda:1", 8.0) == ("cuda", 1.0, 1.0)  # Ray picks the GPU
    assert ray_gpu_share(3, "auto", 0.0) == ("cpu", None, None)
    assert ray_gpu_share(3, "cuda", 1.0, memory_fraction=0.25)[2] == 0.25
    with pytest.raises(DevicePlacementError, match=r"at most 0\.333"):
        ray_gpu_share(3, "cuda", 1.0, memory_fraction=0.5)
    with pytest.raises(DevicePlacementError):
        ray_gpu_share(3, "cuda", 0.5)  # no whole GPU


def test_an_engine_takes_its_launchers_share_else_the_configs():
    assert memory_fraction_from({MEMORY_FRACTION_ENV: "0.25"}, 0.5) == 0.25
    assert memory_fraction_from({}, 0.5) == 0.5
    assert memory_fraction_from({}, None) is None
    for bad in ("0", "1.5", "half"):
        with pytest.raises(DevicePlacementError, match=MEMORY_FRACTION_ENV):
            memory_fraction_from({MEMORY_FRACTION_ENV: bad}, None)


def test_engine_config_names_a_device_and_a_fraction_it_can_use():
    assert EngineConfig().device == "cpu"  # the library default stays the CPU
    for device in ("cpu", "auto", "cuda", "cuda:3"):
        assert EngineConfig(device=device).device == device
    for device in ("gpu", "cuda:", "cuda:x", "CUDA"):
        with pytest.raises(ValueError, match="device must be"):
            EngineConfig(device=device)
    assert EngineConfig(gpu_memory_fraction=1.0).gpu_memory_fraction == 1.0
    for fraction in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="gpu_memory_fraction"):
            EngineConfig(gpu_memory_fraction=fraction)


CPUINFO = """processor\t: 0
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni
processor\t: 1
flags\t\t: fpu
"""


def test_a_benchmarks_auto_dtype_is_bf16_only_where_the_device_computes_it_natively():
    from dualpath.local_devices import bench_dtype, cpu_flags

    assert "avx512_bf16" in cpu_flags(CPUINFO)  # the first flags line
    assert cpu_flags("processor\t: 0\n") == frozenset()
    no_bf16 = cpu_flags(CPUINFO.replace(" avx512_bf16", ""))
    assert bench_dtype("auto", "cpu", cpu_flags(CPUINFO)) == "bfloat16"
    assert bench_dtype("auto", "cpu", no_bf16) == "float32"
    assert bench_dtype("auto", "cpu", frozenset({"amx_bf16"})) == "bfloat16"
    assert bench_dtype("auto", "cuda", no_bf16) == "bfloat16"
    assert bench_dtype("float32", "cuda") == "float32"  # an explicit dtype stays
    assert bench_dtype("bfloat16", "cpu", no_bf16) == "bfloat16"


def test_the_demos_gpu_default_cap_carries_the_same_tokens_in_either_dtype():
    """On a GPU the fixed default; on a CPU it stays open for the probe (``probed_cap``)."""
    from dualpath.bench.demo import READ_CAP_FLOAT32_MB_S, DemoOptions, resolved

    bf16 = resolved(DemoOptions(dtype="bfloat16"), "cuda")
    assert (bf16.dtype, bf16.read_cap_mb_s) == ("bfloat16", READ_CAP_FLOAT32_MB_S / 2)
    fp32 = resolved(DemoOptions(dtype="float32"), "cuda")
    assert fp32.read_cap_mb_s == READ_CAP_FLOAT32_MB_S
    assert resolved(DemoOptions(dtype="float32"), "cpu").read_cap_mb_s is None
    assert resolved(DemoOptions(dtype="float32", read_cap_mb_s=80.0), "cpu").read_cap_mb_s == 80
    assert resolved(DemoOptions(), "cuda").dtype == "bfloat16"


def test_the_demos_cpu_cap_puts_kappa_on_its_target_by_the_probed_recompute(tiny_deep_dir):
    """The probe times a real recompute; the cap is where loading a token costs PROBE_KAPPA of
    that time; a given cap is kept and no probe runs."""
    from rich.console import Console

    from dualpath.bench.demo import PROBE_KAPPA, DemoOptions, probed_cap
    from dualpath.bench.recompute_probe import probe_recompute_s_per_token
    from dualpath.bench.report import kv_bytes_per_token
    from dualpath.workloads.demo import DemoSession, DemoTurn

    s_per_token = probe_recompute_s_per_token(tiny_deep_dir, "float32", 100, 16)
    assert 0 < s_per_token < 1
    sessions = [DemoSession("a", (DemoTurn(50, 0, 2), DemoTurn(90, 50, 2))),
                DemoSession("b", (DemoTurn(60, 0, 2), DemoTurn(110, 60, 2)))]
    options = DemoOptions(model=str(tiny_deep_dir), dtype="float32")
    probed = probed_cap(options, tiny_deep_dir, sessions, Console(quiet=True))
    assert probed.read_cap_mb_s is not None and probed.probed_recompute_s_per_token > 0
    load_s = kv_bytes_per_token(tiny_deep_dir, "float32") / (probed.read_cap_mb_s * 1e6)
    kappa = load_s / probed.probed_recompute_s_per_token  # the cap is rounded to 0.1 MB/s
    assert kappa == pytest.approx(PROBE_KAPPA, rel=1e-3, abs=1e-3)
    kept = replace_cap(options, 80.0)
    assert probed_cap(kept, tiny_deep_dir, sessions, Console(quiet=True)) is kept
    with pytest.raises(ValueError, match="1 token"):
        probe_recompute_s_per_token(tiny_deep_dir, "float32", 0, 16)


def replace_cap(options, cap_mb_s):
    from dataclasses import replace

    return replace(options, read_cap_mb_s=cap_mb_s)


def test_vllm_engines_keep_float32_for_the_benchmarks_auto():
    from dualpath.bench.agents.ladder import AgentsOptions

    vllm = AgentsOptions(engine="vllm", modes=("basic",), online_modes=())
    assert vllm.dtype == "float32"
    assert AgentsOptions(engine="dualpath").dtype == "auto"  # resolved by run_bench


def test_a_kv_budget_is_held_to_the_engines_share_unless_blocks_set_it():
    check_kv_fits(200, None, 0.5, 400)  # 200 MiB of a 200 MiB share
    with pytest.raises(DevicePlacementError, match="kv_cache_mb=201"):
        check_kv_fits(201, None, 0.5, 400)
    check_kv_fits(4096, 64, 0.5, 400)  # num_kv_blocks sets the budget; not checked here
