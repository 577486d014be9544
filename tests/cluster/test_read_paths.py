"""With equal storage-NIC caps on every engine, dualpath reads through PE and DE nodes alike,
while basic reads only on the prefill node."""

from __future__ import annotations

from dataclasses import replace

from multiturn import cluster_outputs, make_conversations, node_sum, wipe

from dualpath.config import ClusterConfig, EngineConfig, StorageConfig
from dualpath.request import SamplingParams
from dualpath.server.launch import LocalCluster


def test_dualpath_uses_every_storage_nic(tiny_chaotic_dir, tmp_path):
    store = tmp_path / "kv"
    config = ClusterConfig(
        engine=EngineConfig(dtype="float32", block_size=16, num_kv_blocks=512),
        storage=StorageConfig(root=str(store), read_cap_mb_s=1.0),  # same cap on every node
        host_pool_blocks=256,
    )
    convs = make_conversations(300, first_lengths=[90, 120, 100, 140, 80, 110],
                               append_lengths=[21, 17], seed=11)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    read_bytes = {}
    for mode in ("basic", "dualpath"):
        wipe(store)
        with LocalCluster(tiny_chaotic_dir, replace(config, mode=mode),
                          log_dir=tmp_path / "logs") as cluster:
            before = cluster.metrics()
            outputs, _ = cluster_outputs(cluster, convs, params, mode, "auto")
            after = cluster.metrics()
            read_bytes[mode] = {
                role: node_sum(after, role, "storage_snic_read_bytes")
                - node_sum(before, role, "storage_snic_read_bytes")
                for role in ("prefill", "decode")}
            assert outputs  # every turn of every conversation finished
            paths = {d[3] for d in cluster.router.decisions[-len(convs) * 2:]}
    assert read_bytes["basic"]["prefill"] > 0 and read_bytes["basic"]["decode"] == 0
    assert read_bytes["dualpath"]["prefill"] > 0 and read_bytes["dualpath"]["decode"] > 0
    assert paths == {"pe", "de"}


def test_oracle_moves_no_kv_and_stores_nothing(tiny_chaotic_dir, tmp_path):
    store = tmp_path / "kv"
    config = ClusterConfig(engine=EngineConfig(dtype="float32", block_size=16, num_kv_blocks=256),
                           storage=StorageConfig(root=str(store)), host_pool_blocks=64,
                           num_decode=1)
    convs = make_conversations(300, first_lengths=[70, 90], append_lengths=[21], seed=3)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    with LocalCluster(tiny_chaotic_dir, config, log_dir=tmp_path / "logs") as cluster:
        cluster_outputs(cluster, convs, params, "dualpath", "auto")  # fills the store
        stored_files = sum(1 for _ in store.rglob("*.kvb"))
        before = cluster.metrics()
        outputs, hits = cluster_outputs(cluster, convs, params, "oracle", "auto")
        after = cluster.metrics()
    assert all(len(turn) == 5 for conv in outputs for turn in conv)
    assert sum(hits[0]) > 0  # the hit is known, but nothing is read or moved for it
    for key in ("storage_snic_read_bytes", "cnic_send_bytes", "cnic_recv_bytes", "h2d_bytes",
                "storage_bytes_written"):
        for role in ("prefill", "decode"):
            assert node_sum(after, role, key) == node_sum(before, role, key), (role, key)
    assert sum(1 for _ in store.rglob("*.kvb")) == stored_files


def test_oracle_hits_from_turn_two_on_an_empty_store(tiny_chaotic_dir, tmp_path):
    """The oracle stores nothing, yet its later turns hit what its earlier turns would have
    stored (the hit is known without I/O); the store stays empty; same tokens as dualpath."""
    store = tmp_path / "kv"
    config = ClusterConfig(engine=EngineConfig(dtype="float32", block_size=16, num_kv_blocks=256),
                           storage=StorageConfig(root=str(store)), host_pool_blocks=64,
                           num_decode=1)
    convs = make_conversations(300, first_lengths=[70], append_lengths=[21], seed=4)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    with LocalCluster(tiny_chaotic_dir, config, log_dir=tmp_path / "logs") as cluster:
        _, oracle_hits = cluster_outputs(cluster, convs, params, "oracle", "auto")
        assert not any(store.rglob("*.kvb"))
        _, dualpath_hits = cluster_outputs(cluster, convs, params, "dualpath", "auto")
    assert oracle_hits[0][0] == 0 and all(h > 0 for h in oracle_hits[0][1:])
    assert oracle_hits == dualpath_hits
