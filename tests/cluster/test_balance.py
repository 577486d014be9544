"""The scheduler's path choice spreads storage reads over every node's storage NIC.

1 prefill + 2 decode engines with equal storage read caps; the same multi-turn workload under
the DualPath scheduler and under round robin. Max/avg of storage bytes read per node must be
lower with DualPath (the paper, Fig. 13: 1.53 with round robin, 1.18 with DualPath).
"""

from __future__ import annotations

import json

from multiturn import cluster_outputs, make_conversations

from dualpath.config import ClusterConfig, EngineConfig, StorageConfig
from dualpath.request import SamplingParams
from dualpath.server.launch import LocalCluster


def _max_over_avg(values: list[float]) -> float:
    return max(values) / (sum(values) / len(values))


def _node_reads(tiny_model, tmp_path, policy: str) -> dict[int, float]:
    store = tmp_path / policy / "kv"
    config = ClusterConfig(
        engine=EngineConfig(dtype="float32", block_size=16, num_kv_blocks=1024),
        storage=StorageConfig(root=str(store), read_cap_mb_s=2.0),
        host_pool_blocks=512, policy=policy)
    convs = make_conversations(300, first_lengths=[150 + 9 * i for i in range(9)],
                               append_lengths=[17, 23], seed=21)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with LocalCluster(tiny_model, config, log_dir=tmp_path / policy / "logs") as cluster:
        cluster_outputs(cluster, convs, params, "dualpath", "auto")
        metrics = cluster.metrics()
    return {m["node_id"]: m["storage_snic_read_bytes"] for m in metrics.values()}


def test_dualpath_balances_storage_nics_better_than_round_robin(tiny_chaotic_dir, tmp_path):
    reads = {p: _node_reads(tiny_chaotic_dir, tmp_path, p) for p in ("dualpath", "round_robin")}
    ratios = {p: _max_over_avg(list(r.values())) for p, r in reads.items()}
    print(json.dumps({"node_read_bytes": reads, "max_over_avg": ratios}))
    assert all(v > 0 for v in reads["dualpath"].values())  # every node's NIC read
    assert ratios["dualpath"] < ratios["round_robin"]
