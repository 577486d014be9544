"""Per-tenant ``cache_salt``: a request hits only blocks stored by requests of the same salt,
on both read paths, with the single-process tokens whatever the salt; the store then verifies
(salted roots counted, every block's KV compared)."""

from __future__ import annotations

from multiturn import assert_store_verified

from dualpath.config import ClusterConfig, EngineConfig, StorageConfig
from dualpath.engine.llm_engine import LLMEngine
from dualpath.request import SamplingParams
from dualpath.server.launch import LocalCluster

ENGINE = EngineConfig(dtype="float32", block_size=16, num_kv_blocks=256)
PARAMS = SamplingParams(max_tokens=20, ignore_eos=True)
FIRST = [(7 * i + 3) % 290 for i in range(70)]


def test_a_salt_hits_only_its_own_blocks(tiny_llama_dir, tmp_path):
    first_out = LLMEngine(tiny_llama_dir, ENGINE).generate([FIRST], PARAMS)[0].output_ids
    second = FIRST + first_out + [11, 12, 13]
    want = LLMEngine(tiny_llama_dir, ENGINE).generate([second], PARAMS)[0].output_ids
    config = ClusterConfig(engine=ENGINE, storage=StorageConfig(root=str(tmp_path / "kv")),
                           host_pool_blocks=64)
    with LocalCluster(tiny_llama_dir, config, log_dir=tmp_path / "logs") as cluster:
        out = cluster.submit(FIRST, PARAMS, cache_salt="tenant-a").result(60)
        assert out.output_ids == first_out and out.num_hit_tokens == 0
        stored = (len(second) - 1) // 16 * 16
        for salt, path, hit in [("tenant-b", "pe", 0), ("", "de", 0), ("tenant-a", "pe", 80),
                                ("tenant-a", "de", stored)]:
            # tenant-a's first turn stored 5 blocks (90 tokens computed); its second turn
            # (pe) stored the rest of the second prompt's blocks
            got = cluster.submit(second, PARAMS, read_path=path, cache_salt=salt).result(60)
            assert got.output_ids == want, (salt, path)
            assert got.num_hit_tokens == hit, (salt, path, got.num_hit_tokens)
    assert_store_verified(tiny_llama_dir, tmp_path / "kv")
