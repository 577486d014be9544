"""The central correctness test: every mode and read path gives the single-process tokens.

Engines run as separate OS processes (1 prefill + 2 decode), KV crosses between them through
Mooncake, hit KV really comes back from the ``fs`` store from turn 2 on.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from multiturn import cluster_outputs, make_conversations, node_sum, reference_outputs, wipe

from dualpath.config import ClusterConfig, EngineConfig, StorageConfig
from dualpath.request import SamplingParams
from dualpath.server.launch import LocalCluster

RUNS = [("basic", "auto"), ("layerwise", "auto"), ("dualpath", "pe"), ("dualpath", "de"),
        ("dualpath", "auto"), ("dualpath", "split"), ("recompute", "auto")]


def _check_all_runs(model_dir, tmp_path, engine_cfg, convs, params) -> None:
    """Basic on a cluster that keeps every layer resident; the rest on one whose prefill
    engine holds a 2-layer window (the layerwise modes' default)."""
    want = reference_outputs(model_dir, engine_cfg, convs, params)
    store = tmp_path / "kv"
    for cluster_mode in ("basic", "dualpath"):
        runs = [(m, p) for m, p in RUNS if (m == "basic") == (cluster_mode == "basic")]
        config = ClusterConfig(engine=engine_cfg, storage=StorageConfig(root=str(store)),
                               host_pool_blocks=256, mode=cluster_mode)
        with LocalCluster(model_dir, config, log_dir=tmp_path / "logs") as cluster:
            _check_runs(cluster, store, runs, want, convs, params)


def _check_runs(cluster, store, runs, want, convs, params) -> None:
    for mode, read_path in runs:
        wipe(store)
        before = cluster.metrics()
        served = []
        got, hits = cluster_outputs(cluster, convs, params, mode, read_path, served)
        after = cluster.metrics()
        assert got == want, f"{mode}/{read_path} diverged from the single-process runner"
        _check_traffic(mode, read_path, hits, before, after)
        _check_computed(mode, read_path, served)


def _check_computed(mode, read_path, served) -> None:
    """The PE computed exactly the miss: prompt − hit (all of the prompt in recompute)."""
    for out in served:
        miss = len(out.prompt_ids) - out.num_hit_tokens
        assert out.num_computed_tokens == miss, (
            f"{mode}/{read_path}: request {out.req_id} computed {out.num_computed_tokens} "
            f"prompt tokens, its miss is {miss}")
        if mode == "recompute":
            assert out.num_hit_tokens == 0
        _check_timings(mode, read_path, out)


def _check_timings(mode, read_path, out) -> None:
    """The TTFT breakdown: parts measured, none negative beyond clock noise, adding up."""
    t = out.timings
    assert t["prefill_s"] > 0 and t["ttft_s"] >= t["prefill_s"] and t["transfer_s"] > 0
    assert min(t["queue_s"], t["read_s"]) >= 0 and t["other_s"] > -0.01, t
    parts = t["queue_s"] + t["read_s"] + t["prefill_s"] + t["other_s"]
    assert abs(parts - t["ttft_s"]) < 1e-6
    if out.num_hit_tokens and mode not in ("oracle", "recompute") and read_path in ("pe", "de"):
        assert t["read_s"] > 0, (mode, read_path, t)


def _check_traffic(mode, read_path, hits, before, after) -> None:
    def delta(role: str, key: str) -> float:
        return node_sum(after, role, key) - node_sum(before, role, key)

    later_hits = sum(h for conv in hits for h in conv[1:])
    assert delta("prefill", "cnic_send_bytes") > 0  # KV went PE -> DE through Mooncake
    assert delta("decode", "storage_bytes_written") > 0  # the DE persisted full blocks
    if mode == "recompute":
        assert later_hits == 0
        return
    assert later_hits > 0, f"{mode}/{read_path}: turns >= 2 hit nothing"
    if read_path == "split":  # the leading hit blocks on the PE node, the rest on the DE's
        assert delta("decode", "storage_snic_read_bytes") > 0
        assert delta("prefill", "storage_snic_read_bytes") > 0
        assert delta("prefill", "cnic_recv_bytes") > 0
    elif read_path == "de":
        assert delta("decode", "storage_snic_read_bytes") > 0
        assert delta("prefill", "cnic_recv_bytes") > 0  # pulled from the DE buffer
        assert delta("prefill", "storage_snic_read_bytes") == 0
    elif read_path == "pe" or mode in ("basic", "layerwise"):
        assert delta("prefill", "storage_snic_read_bytes") > 0
        assert delta("decode", "storage_snic_read_bytes") == 0


def test_tiny_llama_all_paths_match_single_process(tiny_chaotic_dir, tmp_path):
    engine_cfg = EngineConfig(dtype="float32", block_size=16, num_kv_blocks=512)
    convs = make_conversations(300, first_lengths=[45, 70, 101], append_lengths=[19, 27, 13, 22],
                               seed=5)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    _check_all_runs(tiny_chaotic_dir, tmp_path, engine_cfg, convs, params)


@pytest.mark.slow
def test_smollm2_all_paths_match_single_process(smollm2_dir, tmp_path):
    engine_cfg = EngineConfig(dtype="float32", block_size=64, num_kv_blocks=256)
    convs = make_conversations(49152, first_lengths=[150, 201, 130],
                               append_lengths=[70, 45], seed=9)  # 3 turns: 2 that hit
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    _check_all_runs(smollm2_dir, tmp_path, engine_cfg, convs, params)


def test_quota_batching_and_chunking_keep_tokens(tiny_chaotic_dir, tmp_path):
    """A cost model of 1 ms per new token and a 40 ms quota: long prompts are chunked over
    several forwards and short ones share a forward; tokens stay the single-process ones.
    Every engine process runs with the configured GIL switch interval."""
    import json

    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"cost_model": {"a": 0.0, "b": 1.0, "c": 0.0},
                                   "summary": {"alpha_tokens": 1 << 40, "beta_tokens": 1 << 40}}))
    engine_cfg = EngineConfig(dtype="float32", block_size=16, num_kv_blocks=512,
                              gil_switch_ms=0.7)
    convs = make_conversations(300, first_lengths=[45, 70, 101], append_lengths=[19, 13],
                               seed=5)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = reference_outputs(tiny_chaotic_dir, engine_cfg, convs, params)
    store = tmp_path / "kv"
    config = ClusterConfig(engine=engine_cfg, storage=StorageConfig(root=str(store)),
                           host_pool_blocks=256, profile_path=str(profile), prefill_quota_ms=40)
    for cluster_mode, runs in [("dualpath", [("dualpath", "pe"), ("dualpath", "de")]),
                               ("basic", [("basic", "auto")])]:
        with LocalCluster(tiny_chaotic_dir, replace(config, mode=cluster_mode),
                          log_dir=tmp_path / "logs") as cluster:
            for mode, read_path in runs:
                wipe(store)
                served = []
                got, _ = cluster_outputs(cluster, convs, params, mode, read_path, served)
                assert got == want, f"{mode}/{read_path} diverged under quota batching"
                _check_computed(mode, read_path, served)
            metrics = list(cluster.metrics().values())
            pe = next(m for m in metrics if m["role"] == "prefill")
            assert [m["gil_switch_ms"] for m in metrics] == pytest.approx([0.7] * len(metrics))
        # with a window, later chunks pull their earlier blocks back from the DE buffer
        assert pe["num_chunks"] > pe["num_prefilled"]  # some prompts took several forwards
        assert pe["num_forwards"] < pe["num_chunks"]  # some forwards carried several requests


def test_seeded_sampling_gives_the_single_process_tokens(tiny_chaotic_dir, tmp_path):
    """The PE samples token 0 and the DE the rest: with a seed, the draws are those one engine
    makes (the DE must not restart the PE's random stream)."""
    engine_cfg = EngineConfig(dtype="float32", block_size=16, num_kv_blocks=512)
    convs = make_conversations(300, first_lengths=[45, 70], append_lengths=[19], seed=8)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    want = reference_outputs(tiny_chaotic_dir, engine_cfg, convs, params)
    config = ClusterConfig(engine=engine_cfg, storage=StorageConfig(root=str(tmp_path / "kv")),
                           host_pool_blocks=256)
    with LocalCluster(tiny_chaotic_dir, config, log_dir=tmp_path / "logs") as cluster:
        got, _ = cluster_outputs(cluster, convs, params, "dualpath", "auto")
    assert got == want
    assert want[0][0] != reference_outputs(
        tiny_chaotic_dir, engine_cfg, convs, SamplingParams(max_tokens=12, ignore_eos=True))[0][0]
