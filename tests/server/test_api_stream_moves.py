"""A decode engine lost mid-stream, seen from an OpenAI client: the stream goes on.

A real ``LocalCluster`` (1 PE + 2 DE processes of the tiny 8,192-position Llama, fp32, an ``fs``
store) behind ``dualpath serve``'s app (``build_app``, uvicorn on loopback). A streamed
``/v1/completions`` request with ``return_token_ids`` is cut a hundred tokens in by SIGKILL or
SIGSTOP of the decode engine serving it. The client's stream ends without an error chunk, its
ids joined equal the single-process engine's for the same prompt — greedy, and sampled with a
seed — with no token repeated or missing; and every block the store then holds is its own
chain's KV (``dualpath store verify``).
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator

import httpx2 as httpx
import pytest

from dualpath.config import ClusterConfig, EngineConfig, StorageConfig
from dualpath.config_file import ServeConfig
from dualpath.engine.llm_engine import LLMEngine
from dualpath.request import SamplingParams
from dualpath.server.api.app import build_app
from dualpath.server.launch import LocalCluster, engine_roles
from dualpath.server.metrics import ServeMetrics
from dualpath.storage.verify import verify_fs_root

from .test_api_errors import MODEL, byte_model, serving

pytestmark = pytest.mark.faults

ENGINE = EngineConfig(dtype="float32", block_size=16, num_kv_blocks=512)
PROMPT = list(range(5, 60))
MAX_TOKENS = 1500
SAMPLING = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 1.0, "seed": 7}}
CUT_AFTER = 100  # tokens streamed before the decode engine goes


@pytest.fixture(scope="module")
def wanted(tiny_long_dir) -> dict[str, list[int]]:
    """The single-process engine's output, per sampling."""
    engine = LLMEngine(tiny_long_dir, ENGINE)
    return {name: engine.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS,
                                                           ignore_eos=True, **args))[0].output_ids
            for name, args in SAMPLING.items()}


@pytest.fixture
def cluster(tiny_long_dir, tmp_path) -> Iterator[LocalCluster]:
    config = ClusterConfig(engine=ENGINE, storage=StorageConfig(root=str(tmp_path / "kv")),
                           host_pool_blocks=160, heartbeat_s=0.2, engine_timeout_s=2.0)
    with LocalCluster(tiny_long_dir, config, log_dir=tmp_path / "logs") as cluster:
        yield cluster


def _decoding_engine(cluster: LocalCluster) -> str:
    """The decode engine of the one request decoding now."""
    phases = [state for state in cluster.router.phases().values() if state[0] == "decoding"]
    assert len(phases) == 1, phases
    return phases[0][2]


def _stream_with_fault(url: str, cluster: LocalCluster, sampling: dict, fault: signal.Signals
                       ) -> tuple[list[int], list[dict], str]:
    """Stream the request, signal its decode engine ``CUT_AFTER`` tokens in; returns the ids,
    every chunk and the engine."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True,
            "ignore_eos": True, "return_token_ids": True, **sampling}
    ids: list[int] = []
    chunks: list[dict] = []
    victim = ""
    with httpx.Client(base_url=url, timeout=120) as client, \
            client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            chunks.append(chunk)
            for choice in chunk.get("choices", []):
                ids.extend(choice.get("token_ids") or [])
            if not victim and len(ids) >= CUT_AFTER:
                victim = _decoding_engine(cluster)
                cluster.process(victim).send_signal(fault)
    assert victim, "the stream ended before the fault"
    return ids, chunks, victim


@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["kill", "stop"])
def test_a_stream_survives_its_decode_engine(cluster, tiny_long_dir, tmp_path, wanted,
                                             sampling, fault):
    app = build_app(cluster.router, byte_model(tiny_long_dir, cluster.router), ServeConfig(),
                    ServeMetrics(cluster.router))
    with serving(app) as (url, _):
        try:
            ids, chunks, victim = _stream_with_fault(url, cluster, SAMPLING[sampling], fault)
        finally:  # a stopped engine goes on (and rejoins)
            for name, _, _ in engine_roles(cluster.config):
                cluster.process(name).send_signal(signal.SIGCONT)
    assert all("error" not in chunk for chunk in chunks)
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    assert finish[-1] == "length" and not any(finish[:-1])
    assert len(ids) == MAX_TOKENS
    assert ids == wanted[sampling]  # no repeated, missing or different token
    assert len(cluster.router.decisions) == 2  # placed, then moved once
    assert victim not in cluster.router.engines or fault == signal.SIGSTOP
    report = verify_fs_root(tmp_path / "kv", tiny_long_dir, sample=None)
    assert report.ok and report.num_checked >= (len(PROMPT) + MAX_TOKENS) // 16 - 1, (
        report.to_dict())
