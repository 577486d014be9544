"""Compute-NIC caps bind both ends of a transfer in a real cluster: a decode engine pulled by two
prefill engines at once (DE read path: each PE reads hit KV out of the DE buffer layer by layer)
stays under its cap in every 100 ms window, and its counters show the bytes peers moved through
it, per lane."""

from __future__ import annotations

from multiturn import make_conversations

from dualpath.config import ClusterConfig, EngineConfig, StorageConfig, TrafficConfig
from dualpath.request import SamplingParams
from dualpath.server.launch import LocalCluster

CAP_MB_S = 4.0  # ~0.4 s of pulls; a burst (2 x 8 KB) is well inside 10% of 100 ms
SLACK = 1.10  # the acceptance's 10% per 100 ms window


def test_a_decode_engine_pulled_by_two_prefill_engines_stays_under_its_cap(
        tiny_chaotic_dir, tmp_path):
    traffic = TrafficConfig(compute_send_cap_mb_s=CAP_MB_S, compute_recv_cap_mb_s=CAP_MB_S,
                            chunk_bytes=8 << 10, burst_chunks=2)
    config = ClusterConfig(engine=EngineConfig(dtype="float32", block_size=16, num_kv_blocks=512),
                           storage=StorageConfig(root=str(tmp_path / "kv")), traffic=traffic,
                           host_pool_blocks=256, num_prefill=2, num_decode=1)
    convs = make_conversations(300, first_lengths=[500, 480, 520, 490], append_lengths=[9],
                               seed=3)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    with LocalCluster(tiny_chaotic_dir, config, log_dir=tmp_path / "logs") as cluster:
        firsts = [c.first for c in convs]
        cluster.generate(firsts, params, timeout_s=120)  # their blocks go to the store
        seconds = [c.first + c.appended[0] for c in convs]  # big hits, read on the DE side
        futures = [cluster.submit(p, params, read_path="de") for p in seconds]
        outs = [f.result(timeout=120) for f in futures]
        metrics = cluster.metrics()
    assert all(o.num_hit_tokens >= 464 for o in outs)
    pes = [m for m in metrics.values() if m["role"] == "prefill"]
    (de,) = [m for m in metrics.values() if m["role"] == "decode"]
    assert all(pe["cnic_recv_bytes"] > 0 for pe in pes)  # both PEs pulled from the DE
    pulled = sum(pe["cnic_recv_bytes"] for pe in pes)
    # the DE's NIC was charged for what the PEs read out of it, on the KV-load lane
    assert de["cnic_send_passive_lane_bytes_kv_load"] >= pulled
    assert 0 < de["cnic_send_peak_mb_s_100ms"] <= CAP_MB_S * SLACK
    for pe in pes:
        assert pe["cnic_recv_peak_mb_s_100ms"] <= CAP_MB_S * SLACK
