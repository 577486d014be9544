"""An engine process sets up its device before its model loads (``engine/device_setup.py``):
``auto`` resolved, Mooncake's build checked, a shared GPU's memory share applied with the KV
budget checked against it. Fake CUDA calls here; the ``gpu`` test runs a real engine process's
setup on a real device."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from dualpath.config import EngineConfig
from dualpath.devices import MEMORY_FRACTION_ENV, DevicePlacementError
from dualpath.engine import device_setup
from dualpath.engine.device_setup import prepare_engine_device
from dualpath.transfer import mooncake_build
from dualpath.transfer.mooncake_build import CPU_DIST, MooncakeBuildError

GIB_MIB = 1024


@pytest.fixture
def fake_cuda(monkeypatch):
    """One fake 80 GiB GPU, the CUDA build of Mooncake; records the fraction set."""
    calls: dict = {"checked": [], "fraction": []}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: SimpleNamespace(total_memory=80 * GIB_MIB << 20))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, index: calls["fraction"].append((fraction, index)))
    monkeypatch.setattr(device_setup, "require_mooncake_for", calls["checked"].append)
    return calls


def test_a_cpu_engine_touches_no_cuda(monkeypatch):
    def fail(*_a, **_k):
        raise AssertionError("a CPU engine sets up no GPU")
    for name in ("device_count", "get_device_properties", "set_per_process_memory_fraction"):
        monkeypatch.setattr(torch.cuda, name, fail)
    monkeypatch.setattr(device_setup, "require_mooncake_for", fail)
    assert prepare_engine_device(EngineConfig(), env={MEMORY_FRACTION_ENV: "0.5"}) == "cpu"


def test_auto_without_a_gpu_is_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert prepare_engine_device(EngineConfig(device="auto"), env={}) == "cpu"


def test_an_engine_on_a_shared_gpu_takes_its_launchers_share(fake_cuda):
    engine = EngineConfig(device="auto", kv_cache_mb=4096)
    assert prepare_engine_device(engine, env={MEMORY_FRACTION_ENV: "0.5"}) == "cuda"
    assert fake_cuda["checked"] == ["cuda"]
    assert fake_cuda["fraction"] == [(0.5, 0)]


def test_an_engine_alone_sets_no_cap_unless_its_config_does(fake_cuda):
    assert prepare_engine_device(EngineConfig(device="cuda"), env={}) == "cuda"
    assert fake_cuda["fraction"] == []
    prepare_engine_device(EngineConfig(device="cuda:0", gpu_memory_fraction=0.75), env={})
    assert fake_cuda["fraction"] == [(0.75, 0)]


def test_a_kv_budget_larger_than_the_share_fails_at_start(fake_cuda):
    engine = EngineConfig(device="cuda", kv_cache_mb=30 * GIB_MIB)
    with pytest.raises(DevicePlacementError, match="kv_cache_mb=30720 does not fit"):
        prepare_engine_device(engine, env={MEMORY_FRACTION_ENV: "0.333333"})
    assert fake_cuda["fraction"] == []
    blocks = EngineConfig(device="cuda", kv_cache_mb=30 * GIB_MIB, num_kv_blocks=64)
    prepare_engine_device(blocks, env={MEMORY_FRACTION_ENV: "0.333333"})  # blocks set it


def test_an_engine_on_cuda_with_the_non_cuda_build_fails_before_touching_the_gpu(
        monkeypatch, fake_cuda):
    monkeypatch.setattr(device_setup, "require_mooncake_for",
                        mooncake_build.require_mooncake_for)
    monkeypatch.setattr(mooncake_build, "installed_builds", lambda: {CPU_DIST: "0.3.13.post1"})
    with pytest.raises(MooncakeBuildError, match="mooncake-transfer-engine=="):
        prepare_engine_device(EngineConfig(device="cuda"), env={MEMORY_FRACTION_ENV: "0.5"})
    assert fake_cuda["fraction"] == []


SHARE_PROBE = textwrap.dedent("""
    import torch
    from dualpath.config import EngineConfig
    from dualpath.engine.device_setup import prepare_engine_device

    assert prepare_engine_device(EngineConfig(device="auto", kv_cache_mb=64)) == "cuda"
    total = torch.cuda.get_device_properties(0).total_memory
    torch.empty(int(0.2 * total), dtype=torch.uint8, device="cuda")  # within the quarter
    try:
        torch.empty(int(0.3 * total), dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError:
        print("capped")
""")


@pytest.mark.gpu
def test_an_engine_process_on_a_shared_gpu_is_held_to_its_share():
    """In its own process (the cap would hold for the rest of this one): a quarter of the GPU,
    as the launcher gives each of four engines sharing it; the Mooncake check passes only
    with the CUDA build installed."""
    env = {**os.environ, MEMORY_FRACTION_ENV: "0.25", "CUDA_VISIBLE_DEVICES":
           os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}
    out = subprocess.run([sys.executable, "-c", SHARE_PROBE], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "capped"


def test_an_engine_process_on_cuda_with_the_non_cuda_build_fails_at_start(monkeypatch,
                                                                           tmp_path):
    """Where the engine process builds its transfer backend: before its model or Mooncake."""
    from dualpath.config import ClusterConfig
    from dualpath.engine.parts import native_engine_parts

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(mooncake_build, "installed_builds", lambda: {CPU_DIST: "0.3.13.post1"})
    config = ClusterConfig(engine=EngineConfig(device="cuda"))
    with pytest.raises(MooncakeBuildError, match="mooncake-transfer-engine=="):
        native_engine_parts(tmp_path / "no-model", config, "prefill", "pe0")
