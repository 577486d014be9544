"""``--device`` reaches every engine of the benches' and the demo's clusters (``bench agents``,
``bench cluster``, ``demo``, ``serve``), and the default (``auto``) stays the CPU on a machine
without a GPU. Parsed options only: nothing is started, no device needed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dualpath.bench import cluster as bench_cluster
from dualpath.bench import demo
from dualpath.bench.agents.command import options_from
from dualpath.bench.agents.ladder import cluster_config
from dualpath.bench.agents.run import serve_overrides
from dualpath.cli import parse
from dualpath.devices import DevicePlacementError
from dualpath.server.serve import serve_config

STORE = Path("/nonexistent/kv")


@pytest.fixture
def gpus(monkeypatch):
    """Pretend torch sees this many GPUs."""
    def pretend(count: int) -> None:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    return pretend


def _parse(*argv: str):
    """The options dataclass of the command line ``argv``."""
    return parse(list(argv))[1]


@pytest.mark.parametrize("mode", ["basic", "round_robin", "dualpath", "oracle"])
def test_bench_agents_device_reaches_every_modes_engines(mode):
    options = options_from(_parse("bench", "agents", "--device", "cuda"))
    assert options.device == "cuda"
    assert cluster_config(options, mode, STORE).engine.device == "cuda"


def test_bench_agents_via_http_hands_the_device_to_serve():
    options = options_from(_parse("bench", "agents", "--device", "cuda:0", "--via", "http"))
    assert "engine.device=\"cuda:0\"" in serve_overrides(cluster_config(options, "basic", STORE))


def test_bench_agents_and_the_demo_default_to_auto_which_is_the_cpu_without_a_gpu(gpus):
    from dualpath.local_devices import resolve_local_device

    gpus(0)
    assert options_from(_parse("bench", "agents")).device == "auto"
    assert (_parse("demo")).device == "auto"
    assert resolve_local_device("auto") == "cpu"
    gpus(1)
    assert resolve_local_device("auto") == "cuda"


def test_bench_cluster_device_reaches_its_engines(gpus):
    gpus(2)
    for argv in (("--device", "cuda"), ("--set", "device=cuda"), ()):
        args = _parse("bench", "cluster", *argv)
        config = bench_cluster._config(args, STORE, args.engine_config(), "dualpath")
        assert config.engine.device == "cuda", argv  # () : auto, and this host has GPUs


def test_bench_cluster_stays_on_the_cpu_without_a_gpu(gpus):
    gpus(0)
    args = _parse("bench", "cluster")
    assert bench_cluster._config(args, STORE, args.engine_config(), "basic").engine.device == "cpu"
    with pytest.raises(DevicePlacementError, match="no CUDA device"):
        _parse("bench", "cluster", "--device", "cuda").engine_config()


def test_the_demos_device_reaches_its_engines():
    options = (_parse("demo", "--device", "cuda"))
    for mode in ("basic", "dualpath"):
        assert demo._config(options, mode, STORE).engine.device == "cuda"


def test_serve_device_flag_sets_the_engines_device_and_the_default_is_the_configs():
    assert serve_config(_parse("serve", "--device", "cuda")).cluster.engine.device == "cuda"
    assert serve_config(_parse("serve")).cluster.engine.device == "cpu"
    args = _parse("serve", "--set", "engine.device=\"cuda:1\"")
    assert serve_config(args).cluster.engine.device == "cuda:1"


def test_every_engine_command_takes_the_same_device_flag(gpus):
    gpus(1)
    for command in (("generate", "hi"), ("bench", "engine", "--json", "x.json"),
                    ("profile", "--json", "x.json")):
        assert _parse(*command, "--device", "cuda:0").engine_config().device == "cuda:0"
        assert _parse(*command, "--device", "cpu").engine_config().device == "cpu"
