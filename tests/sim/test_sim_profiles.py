"""Model and hardware profiles: derivations reproduce the paper's Table 1."""

import json

import pytest

from dualpath.sim.profiles import get_hardware, get_model
from dualpath.sim.profiles import testbed_profile as load_testbed


def test_kv_bytes_per_token():
    assert get_model("ds660b").kv_bytes_per_token == 40_016
    assert get_model("qwen32b").kv_bytes_per_token == 256 * 1024


def test_cache_compute_ratio_matches_table1():
    ds = get_model("ds660b")
    assert ds.gb_per_pflop(16_384, 429) == pytest.approx(12.2, abs=0.3)
    assert ds.gb_per_pflop(65_536, 429) == pytest.approx(35.1, abs=0.5)
    assert get_model("qwen32b").gb_per_pflop(65_536, 429) == pytest.approx(265.4, rel=0.01)


def test_hardware_and_unknown_names():
    hw = get_hardware("hopper")
    assert hw.gpus_per_node == 8 and hw.storage_ratio == 1.0
    with pytest.raises(ValueError):
        get_hardware("tpu")
    with pytest.raises(ValueError):
        get_model("gpt5")


def test_testbed_loader(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"model": "smol", "cost_model": {"a": 1e-6, "b": 0.1, "c": 1},
                                "summary": {"prefill_tokens_per_s": 900.0,
                                            "read_tokens_per_s": 5e4}}))
    tb = load_testbed(path)
    assert tb.prefill_tokens_per_s == 900.0 and tb.cost_model == (1e-6, 0.1, 1.0)
    path.write_text(json.dumps({"summary": {}}))
    with pytest.raises(ValueError, match="not a dualpath profile"):
        load_testbed(path)
    with pytest.raises(ValueError, match="cannot read"):
        load_testbed(tmp_path / "missing.json")


def test_testbed_config_drives_the_simulator(tmp_path):
    from dataclasses import replace

    from dualpath.sim.cluster import simulate
    from dualpath.sim.config import SimConfig
    from dualpath.workloads.presets import WorkloadConfig

    path = tmp_path / "p.json"
    path.write_text(json.dumps({
        "model": "smol", "cost_model": {"a": 1e-6, "b": 0.5, "c": 2.0},
        "summary": {"prefill_tokens_per_s": 2000.0, "read_tokens_per_s": 2e4,
                    "kv_bytes_per_token": 23_040, "kv_capacity_tokens": 40_000,
                    "decode_step_ms": [20.0, 2.0], "compute_cap_bps": 1.5e9}}))
    cfg = SimConfig(testbed=load_testbed(path), prefill_nodes=1, decode_nodes=2,
                    ep_lockstep=False, workload=WorkloadConfig("tiny", agents=4))
    assert cfg.decode_step_s(3) == pytest.approx(0.026)
    assert cfg.kv_capacity_tokens(1) == 40_000 and cfg.hw().gpus_per_node == 1
    basic, dual = (simulate(replace(cfg, mode=m)) for m in ("basic", "dualpath"))
    assert basic["jct_s"] > 0 and dual["jct_s"] > 0 and dual["reads"]["de"] > 0


def test_decode_read_bytes_sparse_vs_dense():
    ds = get_model("ds660b")
    # DSA: top-k 2,048 latent keys + every indexer key
    assert ds.decode_read_bytes(32_768) == 2048 * 40_016 + 32_768 * 132 * 61
    q = get_model("qwen32b")
    assert q.decode_read_bytes(1000) == 1000 * 256 * 1024


def test_testbed_preset_compares_with_a_real_benchmark(tmp_path):
    from dualpath.sim.presets import run_preset

    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({
        "model": "smol", "cost_model": {"a": 1e-6, "b": 0.5, "c": 2.0}, "machine": {"cpus": 2},
        "summary": {"prefill_tokens_per_s": 2000.0, "read_tokens_per_s": 300.0,
                    "kv_bytes_per_token": 23_040, "kv_capacity_tokens": 40_000,
                    "decode_step_ms": [20.0, 2.0]}}))
    real = tmp_path / "bench.json"
    real.write_text(json.dumps({"workload": {"agents": 4}, "summary": {
        "jct_s": {"basic": 100.0, "dualpath": 60.0}, "dualpath_vs_basic_jct_ratio": 0.6}}))
    out = run_preset("testbed", profile=str(profile), agents=(4,), real=str(real))
    summary = out["summary"]
    assert summary["real_benchmark_ratio"] == 0.6
    assert summary["ratio_rel_error"] == pytest.approx(
        summary["dualpath_vs_basic_jct_ratio"]["4"] / 0.6 - 1)
    # storage-bound (300 tokens/s per node): reading on three nodes must help
    assert summary["dualpath_vs_basic_jct_ratio"]["4"] < 0.9
    with pytest.raises(ValueError, match="agents"):
        run_preset("testbed", profile=str(profile), agents=(8,), real=str(real))
    with pytest.raises(ValueError, match="bench cluster"):
        run_preset("testbed", profile=str(profile), agents=(4,), real=str(tmp_path / "x"))


def test_testbed_prefill_engines_split_the_cores_and_decode_engines_do_not_count():
    from dataclasses import replace

    from dualpath.sim.config import SimConfig
    from dualpath.sim.profiles import TestbedProfile

    testbed = TestbedProfile(prefill_tokens_per_s=1000.0, read_tokens_per_s=100.0,
                             cost_model=(1e-4, 0.5, 2.0), decode_step_ms=(20.0, 2.0), cpus=2)
    one_pe = SimConfig(testbed=testbed, prefill_nodes=1, decode_nodes=2)
    assert one_pe.prefill_cost().b == 0.5 and one_pe.decode_step_s(1) == pytest.approx(0.022)
    four_pe = replace(one_pe, prefill_nodes=4)  # two forwards to a core
    assert four_pe.prefill_cost().b == 1.0 and four_pe.decode_step_s(1) == pytest.approx(0.044)
