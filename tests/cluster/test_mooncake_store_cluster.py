"""A real cluster on the mooncake_store backend: 3-turn chats hit from turn 2 and give the tokens
of the same cluster on the fs store.

Engines (1 prefill + 2 decode, separate OS processes) and the router each join the Mooncake
Store as clients without a segment; a master and one segment holder, started here, hold the
blocks, so they outlive the engines that wrote them.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from multiturn import cluster_outputs, make_conversations, node_sum, wipe

from dualpath.config import ClusterConfig, EngineConfig, StorageConfig
from dualpath.request import SamplingParams
from dualpath.server.launch import LocalCluster

READ_PATHS = ["pe", "de"]
KEY_PREFIX = "cluster-test"


def _runs(cluster: LocalCluster, convs, params, wipe_store) -> dict[str, tuple]:
    """Per read path: outputs, hit tokens per turn, and storage bytes read and written."""
    runs = {}
    for read_path in READ_PATHS:
        wipe_store()
        before = cluster.metrics()
        got, hits = cluster_outputs(cluster, convs, params, "dualpath", read_path)
        after = cluster.metrics()

        def delta(key: str, before=before, after=after) -> float:
            return sum(node_sum(after, role, key) - node_sum(before, role, key)
                       for role in ("prefill", "decode"))

        runs[read_path] = (got, hits, delta("storage_snic_read_bytes"),
                           delta("storage_bytes_written"))
    return runs


def test_mooncake_store_cluster_hits_from_turn_2_with_fs_tokens(tiny_chaotic_dir, tmp_path):
    pytest.importorskip("mooncake.store", reason="the mooncake package is not installed")
    from dualpath.storage.mooncake_service import local_mooncake
    from dualpath.storage.mooncake_store import connect

    engine_cfg = EngineConfig(dtype="float32", block_size=16, num_kv_blocks=512)
    convs = make_conversations(300, first_lengths=[45, 70, 101], append_lengths=[19, 27],
                               seed=5)  # three turns each
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    fs_root = tmp_path / "kv"
    config = ClusterConfig(engine=engine_cfg, storage=StorageConfig(root=str(fs_root)),
                           host_pool_blocks=256)
    with LocalCluster(tiny_chaotic_dir, config, log_dir=tmp_path / "fs-logs") as cluster:
        fs_runs = _runs(cluster, convs, params, lambda: wipe(fs_root))

    with local_mooncake(256, log_dir=tmp_path / "mooncake-logs") as master:
        storage = StorageConfig(backend="mooncake_store", mooncake_master=master,
                                mooncake_key_prefix=KEY_PREFIX)
        admin = connect(master)

        def wipe_mooncake() -> None:
            admin.remove_by_regex(f"^{re.escape(KEY_PREFIX)}/", True)

        try:
            with LocalCluster(tiny_chaotic_dir, replace(config, storage=storage),
                              log_dir=tmp_path / "mooncake-cluster-logs") as cluster:
                mooncake_runs = _runs(cluster, convs, params, wipe_mooncake)
        finally:
            admin.close()

    for read_path in READ_PATHS:
        got, hits, read_bytes, written_bytes = mooncake_runs[read_path]
        assert got == fs_runs[read_path][0], f"{read_path}: tokens differ from the fs store's"
        assert all(h[0] == 0 for h in hits), f"{read_path}: turn 1 hit a wiped store"
        for turn in (1, 2):
            assert sum(h[turn] for h in hits) > 0, f"{read_path}: turn {turn + 1} hit nothing"
        assert written_bytes > 0 and read_bytes > 0
