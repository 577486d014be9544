"""Stop strings work across the cluster (engine faults: ``test_faults.py``)."""

from __future__ import annotations

from dualpath.config import ClusterConfig, EngineConfig, StorageConfig
from dualpath.request import SamplingParams
from dualpath.server.launch import LocalCluster


def test_stop_string_ends_a_cluster_request(smollm2_dir, tmp_path):
    from dualpath.model.tokenizer import Tokenizer

    config = ClusterConfig(engine=EngineConfig(dtype="float32", num_kv_blocks=64),
                           storage=StorageConfig(root=str(tmp_path / "kv")), host_pool_blocks=32,
                           num_decode=1)
    tok = Tokenizer(smollm2_dir)
    prompt = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    with LocalCluster(smollm2_dir, config, log_dir=tmp_path / "logs") as cluster:
        full = cluster.generate([prompt], SamplingParams(max_tokens=30))[0]
        cut = cluster.generate([prompt], SamplingParams(max_tokens=30, stop=("Paris",)))[0]
    assert "Paris" in tok.decode(full.output_ids)
    assert cut.finish_reason == "stop" and len(cut.output_ids) < len(full.output_ids)
    assert full.output_ids[: len(cut.output_ids)] == cut.output_ids
