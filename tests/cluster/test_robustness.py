"""A dead engine fails only its own requests; stop strings work across the cluster."""

from __future__ import annotations

import signal
import time

import pytest

from dualpath.config import ClusterConfig, EngineConfig, StorageConfig
from dualpath.request import SamplingParams
from dualpath.server.launch import LocalCluster
from dualpath.server.router import RequestFailed


def test_killed_decode_engine_fails_its_request_and_the_cluster_goes_on(tiny_chaotic_dir,
                                                                        tmp_path):
    config = ClusterConfig(engine=EngineConfig(dtype="float32", block_size=16, num_kv_blocks=256),
                           storage=StorageConfig(root=str(tmp_path / "kv")), host_pool_blocks=64)
    with LocalCluster(tiny_chaotic_dir, config, log_dir=tmp_path / "logs") as cluster:
        long = cluster.submit(list(range(5, 60)), SamplingParams(max_tokens=900, ignore_eos=True))
        deadline = time.monotonic() + 30
        while not cluster.router.decisions and time.monotonic() < deadline:
            time.sleep(0.01)  # waiting for the placement to be recorded, not for work
        victim = cluster.router.decisions[0][2]
        cluster.process(victim).send_signal(signal.SIGKILL)
        with pytest.raises(RequestFailed):  # its PE's transfer fails, or the router sees it die
            long.result(timeout=60)
        while victim in cluster.router.engines and time.monotonic() < deadline:
            time.sleep(0.01)  # the watcher notices an exited engine within 0.2 s
        out = cluster.generate([list(range(7, 40))], SamplingParams(max_tokens=5,
                                                                    ignore_eos=True))[0]
        assert len(out.output_ids) == 5 and out.decode_engine != victim
        assert victim not in cluster.metrics()


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
