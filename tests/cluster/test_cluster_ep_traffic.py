"""The EP traffic generator in a real local cluster (1 PE + 2 DEs): the decode engines exchange
their all-to-all bytes on the high lane and the greedy tokens do not change; the lone PE has no
peers and sends nothing; a decode engine killed mid-exchange leaves the other one serving."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from multiturn import wait_for

from dualpath.config import ClusterConfig, EngineConfig, StorageConfig, TrafficConfig
from dualpath.engine.llm_engine import LLMEngine
from dualpath.request import SamplingParams
from dualpath.server.launch import LocalCluster
from dualpath.server.router.client import RequestFailed

ENGINE = EngineConfig(dtype="float32", block_size=16, num_kv_blocks=256)
EP_BYTES = 48 << 10  # the testbed value ep_traffic.py derives (per 200 MB/s of compute cap)
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)
LONG = SamplingParams(max_tokens=600, ignore_eos=True)  # decodes for a few seconds
PROMPTS = [[(7 * i + 13 * j) % 290 + 3 for j in range(30 + 9 * i)] for i in range(6)]


def config(tmp_path: Path) -> ClusterConfig:
    # capped compute NICs, so the receiving side counts the bytes peers granted it
    traffic = TrafficConfig(compute_send_cap_mb_s=400.0, compute_recv_cap_mb_s=400.0,
                            ep_bytes_per_token=EP_BYTES)
    return ClusterConfig(engine=ENGINE, storage=StorageConfig(root=str(tmp_path / "kv")),
                         traffic=traffic, host_pool_blocks=64, heartbeat_s=0.2,
                         engine_timeout_s=2.0, router_timeout_s=6.0)


@pytest.fixture(scope="module")
def want(tiny_chaotic_dir) -> dict[str, list[list[int]]]:
    engine = LLMEngine(tiny_chaotic_dir, ENGINE)
    return {"short": [o.output_ids for o in engine.generate(PROMPTS, PARAMS)],
            "long": [o.output_ids for o in engine.generate(PROMPTS[:4], LONG)]}


def decoding(cluster: LocalCluster) -> set[str]:
    """The decode engines with a request in the decoding phase."""
    return {de for phase, _, de in cluster.router.phases().values() if phase == "decoding"}


def test_decode_engines_exchange_on_the_high_lane_and_tokens_do_not_change(
        tiny_chaotic_dir, tmp_path, want):
    with LocalCluster(tiny_chaotic_dir, config(tmp_path), log_dir=tmp_path / "logs") as cluster:
        wait_for(lambda: all(m["ep_peers"] == 1 for m in cluster.metrics().values()
                             if m["role"] == "decode"), what="the DEs to know each other")
        outputs = cluster.generate(PROMPTS, PARAMS, timeout_s=120)
        metrics = cluster.metrics()
        nics = {name: info.nic_address for name, info in cluster.router.engines.items()}
    assert [o.output_ids for o in outputs] == want["short"]
    des = sorted(n for n, m in metrics.items() if m["role"] == "decode")
    assert {o.decode_engine for o in outputs} == set(des)  # both decoded, so both exchanged
    for name, other in zip(des, reversed(des), strict=True):
        m = metrics[name]
        assert m["ep_bytes_sent"] > 0 and m["ep_failed_exchanges"] == 0
        assert m["ep_bytes_sent"] == m["ep_tokens"] * EP_BYTES  # all of it to its one peer
        assert m["lane_bytes_high"] == m["ep_bytes_sent"]  # the high lane carries only EP
        if nics[other]:  # the peer's capped NIC grants what lands there, and counts it
            received = metrics[other]["cnic_recv_passive_lane_bytes_high"]
            assert received == pytest.approx(m["ep_bytes_sent"], rel=0.05)
    pe = next(m for m in metrics.values() if m["role"] == "prefill")
    assert pe["ep_peers"] == 0 and pe["ep_bytes_sent"] == 0 and pe["lane_bytes_high"] == 0


def test_a_decode_engine_killed_while_ep_is_on_leaves_the_other_serving(
        tiny_chaotic_dir, tmp_path, want):
    with LocalCluster(tiny_chaotic_dir, config(tmp_path), log_dir=tmp_path / "logs") as cluster:
        long = [cluster.submit(p, LONG) for p in PROMPTS[:4]]
        busy = wait_for(lambda: len(decoding(cluster)) == 2 and decoding(cluster),
                        what="both DEs decoding")
        wait_for(lambda: all(cluster.metrics()[de]["ep_exchanges"] for de in busy),
                 what="both DEs exchanging")
        victim, survivor = sorted(busy)
        sent_before = cluster.metrics()[survivor]["ep_bytes_sent"]
        cluster.process(victim).send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        for i, future in enumerate(long):
            try:
                out = future.result(120)
            except RequestFailed as exc:  # it was decoding on the killed engine
                assert "while decoding" in str(exc)
                continue
            assert out.decode_engine == survivor and out.output_ids == want["long"][i]
        outputs = cluster.generate(PROMPTS, PARAMS, timeout_s=60)
        served_s = time.monotonic() - killed_at
        m = cluster.metrics()[survivor]
    assert [o.output_ids for o in outputs] == want["short"]
    assert {o.decode_engine for o in outputs} == {survivor}
    print(f"survivor after the kill: {m['ep_failed_exchanges']} failed exchanges, "
          f"{m['ep_bytes_sent'] - sent_before} B sent, wait {m['ep_wait_s_total']:.3f} s; "
          f"served everything {served_s:.1f} s after the kill")
    assert m["ep_peers"] == 0  # the router's Peers no longer lists the dead engine
    assert m["ep_failed_exchanges"] <= 2  # at most a step or two hit it before it was dropped
    assert served_s < 60
