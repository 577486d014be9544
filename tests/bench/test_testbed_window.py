"""The benchmarks' testbed keeps every layer resident on a CPU, a GPU keeps the window."""

from __future__ import annotations

from pathlib import Path

from dualpath.bench.cluster import CPU_LAYER_WINDOW
from dualpath.bench.cluster import testbed_config as make_testbed
from dualpath.config import ClusterConfig, engine_config_for


def _config(device: str, **cluster) -> ClusterConfig:
    return make_testbed(Path("/tmp/store"), "dualpath", dtype="float32", block_size=16,
                          read_cap_mb_s=100.0, compute_cap_mb_s=None, read_deadline_s=60.0,
                          device=device, **cluster)


def test_a_cpu_testbed_keeps_every_layer_of_a_layerwise_prefill_resident():
    config = _config("cpu")
    assert config.prefill_layer_window == CPU_LAYER_WINDOW
    assert engine_config_for(config, "prefill").layer_window == CPU_LAYER_WINDOW


def test_a_gpu_testbed_keeps_the_window_and_a_given_window_stays():
    assert _config("cuda").prefill_layer_window == ClusterConfig().prefill_layer_window == 2
    assert _config("cpu", prefill_layer_window=3).prefill_layer_window == 3
