"""The launchers put engines on their devices: a local cluster starts each engine process with
its own GPU in ``CUDA_VISIBLE_DEVICES`` (round robin) and its share of a shared GPU's memory,
refusing at once a Mooncake build that cannot move GPU memory; Ray actors ask for the share of
a GPU that lets all fit. Fake GPU ids and stand-in engine processes: no device needed."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dualpath.config import ClusterConfig, EngineConfig
from dualpath.devices import GPU_ENV, MEMORY_FRACTION_ENV
from dualpath.local_devices import resolve_local_device
from dualpath.server import launch
from dualpath.server.launch import LocalCluster, local_device_plan
from dualpath.transfer import mooncake_build
from dualpath.transfer.mooncake_build import CPU_DIST, CUDA_DIST, MooncakeBuildError

PRINT_PLACEMENT = ("import os; print(os.environ.get('CUDA_VISIBLE_DEVICES', '-'), "
                   "os.environ.get('DUALPATH_GPU_MEMORY_FRACTION', '-'))")


def _config(device: str, num_decode: int = 2, **engine) -> ClusterConfig:
    return ClusterConfig(engine=EngineConfig(device=device, **engine), num_decode=num_decode)


@pytest.fixture
def cuda_build(monkeypatch):
    """Mooncake's CUDA build is the one installed (as ``make setup`` leaves a GPU machine)."""
    monkeypatch.setattr(mooncake_build, "installed_builds", lambda: {CUDA_DIST: "0.3.13.post1"})


class _StandIns(LocalCluster):
    """A LocalCluster whose engine processes print where they were placed, then exit."""

    def _engine_argv(self, name: str, role: str, node_id: int) -> list[str]:
        return [sys.executable, "-c", PRINT_PLACEMENT]

    def _engine_env(self, name: str) -> dict[str, str]:
        return launch.engine_env()  # no router: no control-plane key to hand out


def _placements(tmp_path: Path, config: ClusterConfig, gpu_ids: list[str]) -> dict[str, str]:
    """Start the stand-ins; what each engine process saw, by engine name."""
    cluster = _StandIns(tmp_path / "model", config, log_dir=tmp_path / "logs", gpu_ids=gpu_ids)
    cluster.log_dir.mkdir(parents=True)
    cluster.router = SimpleNamespace(address="tcp://127.0.0.1:1", shutdown=lambda: None,
                                     engine_lost=lambda name: None)  # a stand-in, unused
    cluster._start_engines()
    names = [name for name in cluster._names]
    for name in names:
        assert cluster.process(name).wait(timeout=60) == 0
    cluster.stop()
    return {name: (tmp_path / "logs" / f"{name}.log").read_text().strip() for name in names}


def test_each_local_engine_process_gets_its_own_gpu(tmp_path, cuda_build):
    seen = _placements(tmp_path, _config("cuda", num_decode=3), ["0", "1", "2", "3"])
    assert seen == {"pe0": "0 1", "de1": "1 1", "de2": "2 1", "de3": "3 1"}


def test_local_engines_sharing_a_gpu_split_its_memory(tmp_path, cuda_build):
    seen = _placements(tmp_path, _config("cuda"), ["4", "7"])
    assert seen == {"pe0": "4 0.5", "de1": "7 1", "de2": "4 0.5"}


def test_local_cpu_engines_keep_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(GPU_ENV, "9")  # whatever the parent had, engines inherit
    monkeypatch.delenv(MEMORY_FRACTION_ENV, raising=False)
    seen = _placements(tmp_path, _config("cpu", num_decode=1), ["0", "1"])
    assert seen == {"pe0": "9 -", "de1": "9 -"}


def test_the_cluster_config_says_cuda_inside_each_engine(cuda_build):
    config, plan = local_device_plan(_config("cuda:1", gpu_memory_fraction=0.25), ["2", "5"])
    assert config.engine.device == "cuda"  # the one GPU each engine sees is its cuda:0
    assert {plan.env(n)[GPU_ENV] for n in ("pe0", "de1", "de2")} == {"5"}
    assert plan.env("pe0")[MEMORY_FRACTION_ENV] == "0.25"
    config, plan = local_device_plan(_config("auto"), [])
    assert config.engine.device == "cpu" and plan.env("pe0") == {}


def test_a_local_cluster_on_cuda_refuses_the_non_cuda_build_before_starting(tmp_path,
                                                                           monkeypatch):
    monkeypatch.setattr(mooncake_build, "installed_builds", lambda: {CPU_DIST: "0.3.13.post1"})
    with pytest.raises(MooncakeBuildError, match=f"pip install {CUDA_DIST}=="):
        LocalCluster(tmp_path / "model", _config("cuda"), log_dir=tmp_path / "logs",
                     gpu_ids=["0"])
    LocalCluster(tmp_path / "model", _config("cpu"), log_dir=tmp_path / "logs")  # CPU: fine


def test_the_default_device_stays_the_cpu_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert resolve_local_device("auto") == "cpu"
    assert local_device_plan(_config("auto"))[0].engine.device == "cpu"


def test_auto_finds_the_gpus_torch_sees(monkeypatch, cuda_build):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv(GPU_ENV, "3,6")
    assert resolve_local_device("auto") == "cuda"
    assert launch.local_gpu_ids() == ["3", "6"]
    config, plan = local_device_plan(_config("auto"))
    assert config.engine.device == "cuda"
    assert [plan.env(n)[GPU_ENV] for n in ("pe0", "de1", "de2")] == ["3", "6", "3"]


def test_cpu_placement_never_asks_torch_for_gpus(monkeypatch):
    def fail() -> int:
        raise AssertionError("a CPU cluster does not count GPUs")
    monkeypatch.setattr(torch.cuda, "device_count", fail)
    assert resolve_local_device("cpu") == "cpu"
    assert local_device_plan(_config("cpu"))[1].device == "cpu"


class _CudaStandIns(_StandIns):
    """Stand-ins that report the CUDA devices torch sees inside each engine process."""

    def _engine_argv(self, name: str, role: str, node_id: int) -> list[str]:
        return [sys.executable, "-c", "import torch; print(torch.cuda.device_count(), "
                "torch.cuda.get_device_properties(0).uuid)"]


@pytest.mark.gpu
def test_each_local_engine_process_sees_one_gpu(tmp_path):
    """On the real GPUs, with the real Mooncake build: each engine sees exactly one GPU (its
    cuda:0), and three engines spread over up to three GPUs."""
    cluster = _CudaStandIns(tmp_path / "model", _config("cuda"), log_dir=tmp_path / "logs")
    cluster.log_dir.mkdir(parents=True)
    cluster.router = SimpleNamespace(address="tcp://127.0.0.1:1", shutdown=lambda: None,
                                     engine_lost=lambda name: None)
    cluster._start_engines()
    for name in ("pe0", "de1", "de2"):
        assert cluster.process(name).wait(timeout=120) == 0
    cluster.stop()
    seen = [(tmp_path / "logs" / f"{n}.log").read_text().split() for n in ("pe0", "de1", "de2")]
    assert [count for count, _ in seen] == ["1", "1", "1"]
    gpus = min(3, torch.cuda.device_count())
    assert len({uuid for _, uuid in seen}) == gpus


# -- Ray ---------------------------------------------------------------------------------------


class _FakeRemote:
    """Records the options an actor was asked for."""

    def __init__(self) -> None:
        self.options_seen: list[dict] = []

    def options(self, **options):
        self.options_seen.append(options)
        return SimpleNamespace(remote=lambda log_path: SimpleNamespace(log=log_path))


def _ray_actor_options(monkeypatch, tmp_path, config: ClusterConfig, gpus: float) -> tuple:
    launch_ray = pytest.importorskip("dualpath.server.launch_ray")
    monkeypatch.setattr(launch_ray.ray, "cluster_resources", lambda: {"GPU": gpus})
    remote = _FakeRemote()
    monkeypatch.setattr(launch_ray, "_REMOTE_ENGINE", remote)
    cluster = launch_ray.RayCluster(tmp_path / "model", config, log_dir=tmp_path)
    cluster._place_devices()
    key = SimpleNamespace(to_json=lambda: "{}")
    cluster.router = SimpleNamespace(keys=SimpleNamespace(engine_key=lambda name: key))
    for name, _, node_id in launch.engine_roles(cluster.config):
        cluster._create_actor(name, node_id)
    return cluster.config, remote.options_seen


def test_ray_engines_on_one_gpu_ask_for_a_third_of_it_each(monkeypatch, tmp_path):
    config, seen = _ray_actor_options(monkeypatch, tmp_path, _config("cuda"), 1.0)
    assert config.engine.device == "cuda"
    assert [o["num_gpus"] for o in seen] == [pytest.approx(1 / 3)] * 3
    assert {o["runtime_env"]["env_vars"][MEMORY_FRACTION_ENV] for o in seen} == {"0.333333"}


def test_ray_engines_on_enough_gpus_ask_for_a_whole_one(monkeypatch, tmp_path):
    config, seen = _ray_actor_options(monkeypatch, tmp_path, _config("auto"), 4.0)
    assert config.engine.device == "cuda"
    assert [o["num_gpus"] for o in seen] == [1.0] * 3


def test_ray_cpu_engines_ask_for_no_gpu(monkeypatch, tmp_path):
    config, seen = _ray_actor_options(monkeypatch, tmp_path, _config("auto"), 0.0)
    assert config.engine.device == "cpu"
    assert all("num_gpus" not in o for o in seen)
    assert all(MEMORY_FRACTION_ENV not in o["runtime_env"]["env_vars"] for o in seen)
