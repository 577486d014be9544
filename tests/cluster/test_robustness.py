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


def test_an_answer_waits_for_its_writes_but_not_for_ever(tiny_chaotic_dir, tmp_path):
    """A decode engine answers a request once its last blocks are written, so the next turn
    hits them; when the writes crawl (a 2 KB/s storage NIC), it answers after its bound anyway
    and the request is served, not lost; the cluster's stop does not wait for the crawl."""
    import time

    from dualpath.engine.decode import FINISH_WAIT_S
    from dualpath.server.launch import ENGINE_STOP_S
    from dualpath.storage.client import CLOSE_DRAIN_S

    def run(write_cap_mb_s):
        config = ClusterConfig(engine=EngineConfig(dtype="float32", block_size=16,
                                                   num_kv_blocks=256),
                               storage=StorageConfig(root=str(tmp_path / f"kv{write_cap_mb_s}"),
                                                     write_cap_mb_s=write_cap_mb_s),
                               host_pool_blocks=64, num_decode=1)
        prompt = list(range(5, 5 + 70))
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        second = None
        with LocalCluster(tiny_chaotic_dir, config, log_dir=tmp_path / "logs") as cluster:
            began = time.monotonic()
            first = cluster.submit(prompt, params).result(120)
            took_s = time.monotonic() - began
            if write_cap_mb_s is None:
                second = cluster.submit(prompt + first.output_ids + [7] * 20, params).result(120)
            cut = sum(m.get("num_finish_waits_cut", 0) for m in cluster.metrics().values())
            closing = time.monotonic()
        return first, second, took_s, cut, time.monotonic() - closing

    first, second, _, cut, _ = run(None)
    assert second.num_hit_tokens == (70 + 3) // 16 * 16 and cut == 0  # its context, all of it
    first, _, took_s, cut, close_s = run(0.002)
    assert len(first.output_ids) == 4 and cut >= 1 and FINISH_WAIT_S <= took_s < 60
    # the stop drops the writes still queued after its drain: every engine exits by itself
    assert close_s < CLOSE_DRAIN_S + 5 < ENGINE_STOP_S, close_s
