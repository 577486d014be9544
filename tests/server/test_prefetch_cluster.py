"""Prefetch during tool time on a real cluster (1 PE + 1 DE of a tiny Llama, separate
processes): a decode engine whose DRAM budget holds one session lets session A go when session
B's turn arrives, says so in its heartbeat, and the router, told A is back in 30 s, has the
engine read A's chain back from storage; A's next turn then reads its hit from DRAM, and its
tokens are those of the same prompt read from storage. Turns go through the prefill engine
(``local_prefill_tokens = 0``): prefilled on its decode engine, A's turn would take its hit
from that engine's device KV, which still holds it, and read nothing."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace

import pytest

from dualpath.request import SamplingParams
from dualpath.server.launch import LocalCluster
from dualpath.sessions import AgentHint, Session

from .test_api_errors import tiny_cluster_config

GEN = 4
PARAMS = SamplingParams(max_tokens=GEN, ignore_eos=True)
# the tiny model's KV: 3 layers x K and V x 2 heads x 16 dims x 4 bytes = 768 bytes a token,
# 12,288 a 16-token block; a budget of 6 blocks holds one session of 4 (64 tokens), not two
BUDGET_MB = 6 * 12_288 / 1e6


@pytest.fixture(scope="module")
def cluster(tiny_chaotic_dir, tmp_path_factory) -> Iterator[LocalCluster]:
    tmp = tmp_path_factory.mktemp("prefetch")
    config = tiny_cluster_config(tmp / "kv")
    config = replace(config, local_prefill_tokens=0,
                     storage=replace(config.storage, capacity_gb=1.0,
                                     warm_session_mb=BUDGET_MB))
    with LocalCluster(tiny_chaotic_dir, config, log_dir=tmp / "logs") as started:
        yield started


def counter(cluster: LocalCluster, name: str) -> int:
    return sum(int(m.get(f"storage_{name}", 0) or 0) for m in cluster.metrics().values())


def wait_for(cluster: LocalCluster, name: str, at_least: int, timeout_s: float = 20.0) -> int:
    deadline = time.monotonic() + timeout_s
    while (value := counter(cluster, name)) < at_least and time.monotonic() < deadline:
        time.sleep(0.2)
    return value


def test_a_session_pushed_out_of_dram_is_prefetched_back_before_its_next_turn(cluster):
    a = Session("agent-a", "header", AgentHint(next_turn_in_s=30.0))
    b = Session("agent-b", "header")
    prompt_a = [(7 * i + 3) % 290 + 5 for i in range(64)]
    prompt_b = [(11 * i + 1) % 290 + 5 for i in range(64)]
    first = cluster.submit(prompt_a, PARAMS, session=a).result(60)
    assert counter(cluster, "warm_kept_blocks") >= 4
    cluster.submit(prompt_b, PARAMS, session=b).result(60)  # B's blocks push A's out
    assert wait_for(cluster, "warm_sessions_dropped", 1) >= 1
    assert wait_for(cluster, "prefetch_blocks_read", 4) >= 4  # A read back from storage
    hits_before = counter(cluster, "warm_hits")
    context = prompt_a + first.output_ids + [9, 10, 11]
    second = cluster.submit(context, PARAMS, session=a).result(60)
    assert counter(cluster, "warm_hits") >= hits_before + 4
    assert counter(cluster, "warm_prefetch_used") >= 1
    plain = cluster.submit(context, PARAMS).result(60)  # the same prompt, from storage
    assert second.output_ids == plain.output_ids and second.num_hit_tokens >= 64
