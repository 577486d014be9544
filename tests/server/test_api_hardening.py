"""A server that runs for weeks (issue 33): what an API client may ask and what it may learn.

One ``LocalCluster`` of a tiny random Llama (1 PE + 1 DE, 8,192 positions so a long request
stays decoding for seconds) serves the whole module; each test puts an app of its own settings
in front of it (uvicorn on a loopback port). Covered: concurrent ``/metrics`` scrapes are each a
full answer and a failing engine query degrades the page instead of a 500; only the allowed
modes may be named per request; the character and token-id limits apply before tokenizing, and
tokenizing runs off the event loop; the API key covers ``/metrics`` and the docs, ``/health``
never shows transfer endpoints to an unauthenticated client; ``cache_salt`` (and the key's
salt) keeps tenants' prefixes apart; a request past ``request_timeout_s`` is aborted on the
engines, answered 504 (or an error event) and its concurrency slot is free again.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx2 as httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dualpath.config_file import ServeConfig
from dualpath.server.api.app import ModelInfo, build_app
from dualpath.server.launch import LocalCluster
from dualpath.server.metrics import ServeMetrics

from .test_api_errors import (
    MODEL,
    assert_openai_error,
    byte_model,
    serving,
    tiny_cluster_config,
    wait_idle,
)

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


class Cluster:
    """The module's cluster and the byte model over it; ``app`` serves an app of given
    settings in front of it."""

    def __init__(self, cluster: LocalCluster, model: ModelInfo) -> None:
        self.cluster, self.model = cluster, model
        self.router = cluster.router

    @contextlib.contextmanager
    def app(self, settings: ServeConfig | None = None, model: ModelInfo | None = None,
            headers: dict[str, str] | None = None) -> Iterator[httpx.Client]:
        """A client of an app with ``settings`` (and ``model``) over this cluster."""
        settings = settings or ServeConfig(default_max_tokens=4)
        app = build_app(self.router, model or self.model, settings, ServeMetrics(self.router))
        with serving(app) as (url, _), httpx.Client(base_url=url, headers=headers or {},
                                                     timeout=30) as client:
            yield client

    def wait_idle(self, timeout_s: float = 10.0) -> dict[str, int]:
        """The router's counters once it holds no request."""
        return wait_idle(self.router, timeout_s)


@pytest.fixture(scope="module")
def cluster(tiny_long_dir, tmp_path_factory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("api-hardening")
    with LocalCluster(tiny_long_dir, tiny_cluster_config(tmp / "kv"),
                      log_dir=tmp / "logs") as local:
        yield Cluster(local, byte_model(tiny_long_dir, local.router))


def completion(client: httpx.Client, prompt: Any, **fields: Any) -> httpx.Response:
    return client.post(COMPLETIONS, json={"model": MODEL, "prompt": prompt, **fields})


def samples(text: str) -> dict[str, list[dict[str, str]]]:
    """The label sets of every sample of a metrics page, by sample name."""
    out: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample.labels)
    return out


def assert_full_metrics(response: httpx.Response, engines: set[str]) -> None:
    """A 200 page with the router's series and every engine's storage counters."""
    assert response.status_code == 200, (response.status_code, response.text[:300])
    found = samples(response.text)
    assert "dualpath:num_requests_running" in found
    storage = {labels["engine"] for labels in found.get("dualpath:storage_total", [])}
    assert storage == engines, (storage, engines)


# -- /metrics -----------------------------------------------------------------------------------


def test_concurrent_metrics_scrapes_are_each_a_full_answer(cluster):
    # before: one of two concurrent scrapes took the other's engine replies: a 500 after 2 s
    engines = set(cluster.router.engines)
    with cluster.app() as client, cf.ThreadPoolExecutor(8) as pool:
        for _ in range(3):
            for response in pool.map(lambda _: client.get("/metrics"), range(8)):
                assert_full_metrics(response, engines)


def test_metrics_without_engine_counters_is_the_router_series_not_a_500(cluster, monkeypatch,
                                                                        caplog):
    # before: an engine that did not answer in time made the whole page a 500
    def late(timeout_s: float = 30.0) -> dict[str, dict]:
        raise TimeoutError("an engine did not answer")

    monkeypatch.setattr(cluster.router, "collect_metrics", late)
    with cluster.app() as client, caplog.at_level(logging.WARNING):
        response = client.get("/metrics")
    assert response.status_code == 200, response.text[:300]
    found = samples(response.text)
    assert "dualpath:num_requests_running" in found
    assert "dualpath:storage_total" not in found
    assert any("engine counters" in r.getMessage() for r in caplog.records), caplog.text


# -- modes --------------------------------------------------------------------------------------


def test_a_mode_the_server_does_not_allow_is_400_naming_the_allowed_ones(cluster):
    # before: any client could run oracle (answers from leftover KV) or recompute (no cache)
    with cluster.app() as client:
        for mode in ("oracle", "recompute", "basic"):
            error = assert_openai_error(completion(client, [1, 2, 3], dualpath={"mode": mode}),
                                        400, mode, "dualpath")
            assert error["param"] == "dualpath.mode"
        for extra in ({"dualpath": {"mode": "dualpath"}}, {"dualpath": {"read_path": "de"}},
                      {}):
            response = completion(client, [1, 2, 3], **extra)
            assert response.status_code == 200, (extra, response.text)
    with cluster.app(ServeConfig(allowed_modes=("dualpath", "recompute"))) as client:
        assert completion(client, [1, 2, 3], max_tokens=2,
                          dualpath={"mode": "recompute"}).status_code == 200
        assert_openai_error(completion(client, [1, 2, 3], dualpath={"mode": "oracle"}), 400,
                            "dualpath, recompute")


# -- limits before tokenizing, tokenizing off the event loop ------------------------------------


def test_a_prompt_over_the_context_is_refused_before_it_is_tokenized(cluster):
    # before: a text prompt was tokenized in full, on the event loop, and then refused
    calls: list[int] = []

    def counted(text: str) -> list[int]:
        calls.append(len(text))
        return cluster.model.encode(text)

    model = replace(cluster.model, encode=counted, encode_chat=lambda m: counted(str(m)))
    over = cluster.model.max_context + 1
    with cluster.app(model=model) as client:
        assert_openai_error(completion(client, "a" * over), 400, str(over), "characters")
        assert_openai_error(client.post(CHAT, json={"model": MODEL, "messages": [
            {"role": "user", "content": "a" * over}]}), 400, "characters")
        assert_openai_error(completion(client, [1] * over), 400, str(over))
        assert calls == []
        assert completion(client, "a" * 100, max_tokens=1).status_code == 200
        assert calls == [100]


def test_tokenizing_a_long_prompt_does_not_stall_other_requests(cluster):
    # before: /health waited for the whole tokenization (1.5 s here; 1.1 s for a 1 MiB prompt
    # with SmolLM2's tokenizer)
    tokenize_s = 1.5
    started = threading.Event()

    def slow(text: str) -> list[int]:
        if text.startswith("SLOW"):
            started.set()
            end = time.monotonic() + tokenize_s
            while time.monotonic() < end:  # Python work: it holds the GIL between switches
                pass
        return cluster.model.encode(text)

    model = replace(cluster.model, encode=slow)
    with cluster.app(model=model) as client, cf.ThreadPoolExecutor(1) as pool:
        slow_reply = pool.submit(completion, client, "SLOW" + "a" * 500, max_tokens=1)
        assert started.wait(10)
        worst = 0.0
        while not slow_reply.done():
            start = time.monotonic()
            assert client.get("/health").status_code == 200
            worst = max(worst, time.monotonic() - start)
            time.sleep(0.02)
        assert slow_reply.result().status_code == 200
    print(f"longest /health answer while a prompt was tokenized for {tokenize_s} s: "
          f"{worst * 1000:.0f} ms")
    assert worst < tokenize_s / 3, worst


# -- the API key --------------------------------------------------------------------------------


def test_the_api_key_covers_metrics_and_the_docs_and_health_shows_no_endpoints(cluster):
    # before: /metrics, /docs, /openapi.json and /redoc answered without the key, and /health
    # listed every engine's transfer endpoint to anyone
    settings = ServeConfig(api_key="sk-a", api_keys=("sk-b",))
    with cluster.app(settings) as client:
        for path in ("/metrics", "/docs", "/openapi.json", "/redoc", "/v1/models"):
            for headers in ({}, {"authorization": "Bearer sk-c"}, {"authorization": "sk-a"}):
                assert_openai_error(client.get(path, headers=headers), 401, "API key")
            for key in ("sk-a", "sk-b"):
                response = client.get(path, headers={"authorization": f"Bearer {key}"})
                assert response.status_code == 200, (path, response.text[:200])
        open_health = client.get("/health")
        assert open_health.status_code == 200 and open_health.json() == {"status": "ok"}
        health = client.get("/health", headers={"authorization": "Bearer sk-b"}).json()
        assert {e["name"] for e in health["engines"]} == set(cluster.router.engines)
        assert all(e["heartbeat_age_s"] < 5 for e in health["engines"])
    with cluster.app() as client:  # no key: details for everyone, but no endpoint
        health = client.get("/health").json()
        assert {e["name"] for e in health["engines"]} == set(cluster.router.engines)
        assert "endpoint" not in json.dumps(health)
        schema = client.get("/openapi.json").json()  # the request bodies are documented
        body = schema["paths"][COMPLETIONS]["post"]["requestBody"]
        ref = body["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
        assert "cache_salt" in schema["components"]["schemas"][ref]["properties"]


# -- cache salts --------------------------------------------------------------------------------


def cached(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cache_salt_hits_only_blocks_stored_under_the_same_salt(cluster):
    # before: cache_salt was ignored; a second tenant learnt from cached_tokens that someone
    # had sent the same 80-token prefix
    prompt = [(7 * i + 3) % 251 for i in range(80)]
    with cluster.app() as client:
        assert cached(completion(client, prompt, max_tokens=2, cache_salt="tenant-a")) == 0
        assert cached(completion(client, prompt, max_tokens=2, cache_salt="tenant-b")) == 0
        assert cached(completion(client, prompt, max_tokens=2)) == 0
        assert cached(completion(client, prompt, max_tokens=2, cache_salt="tenant-a")) == 64
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 70}],
                "max_tokens": 2}
        assert cached(client.post(CHAT, json={**chat, "cache_salt": "s"})) == 0
        assert cached(client.post(CHAT, json={**chat, "cache_salt": "t"})) == 0
        assert cached(client.post(CHAT, json={**chat, "cache_salt": "s"})) == 64
        for bad in ("a" * 257, 7, ["a"]):
            assert_openai_error(completion(client, [1], cache_salt=bad), 400, "cache_salt")
        response = client.post(COMPLETIONS, content=b'{"model": "tiny", "prompt": [1], '
                               b'"cache_salt": "\\ud800"}',
                               headers={"content-type": "application/json"})
        assert_openai_error(response, 400, "cache_salt")


def test_salt_by_api_key_keeps_tenants_with_different_keys_apart(cluster):
    # before: no such setting (ServeConfig refused salt_by_api_key)
    prompt = [(11 * i + 5) % 253 for i in range(80)]
    settings = ServeConfig(api_keys=("sk-one", "sk-two"), salt_by_api_key=True)
    one, two = ({"authorization": f"Bearer {k}"} for k in ("sk-one", "sk-two"))
    with cluster.app(settings) as client:
        assert cached(client.post(COMPLETIONS, headers=one, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 2})) == 0
        assert cached(client.post(COMPLETIONS, headers=two, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 2})) == 0
        assert cached(client.post(COMPLETIONS, headers=one, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 2})) == 64
        assert cached(client.post(COMPLETIONS, headers=two, json={  # a client salt beside it
            "model": MODEL, "prompt": prompt, "max_tokens": 2, "cache_salt": "x"})) == 0


# -- the request deadline -----------------------------------------------------------------------


def test_a_request_past_the_deadline_is_aborted_answered_504_and_frees_its_slot(cluster):
    # before: no deadline: the request held its slot until the engines finished (200)
    settings = ServeConfig(request_timeout_s=0.5, max_concurrent_requests=1)
    long = {"max_tokens": 4000, "ignore_eos": True}
    with cluster.app(settings) as client:
        start = time.monotonic()
        response = completion(client, [1, 2, 3], **long)
        took = time.monotonic() - start
        error = assert_openai_error(response, 504, "0.5 s")
        assert error["type"] == "timeout_error" and took < 3.0, took
        assert cluster.wait_idle()["requests"] == 0  # aborted on the engines
        with client.stream("POST", COMPLETIONS, json={"model": MODEL, "prompt": [4, 5],
                                                      "stream": True, **long}) as stream:
            assert stream.status_code == 200
            events = [line.removeprefix("data: ") for line in stream.iter_lines() if line]
        assert events[-1] == "[DONE]", events[-3:]
        assert json.loads(events[-2])["error"]["type"] == "timeout_error"
        assert all("choices" in json.loads(e) for e in events[:-2])
        assert cluster.wait_idle()["requests"] == 0
        short = completion(client, [1, 2, 3], max_tokens=2)  # the slot is free again
        assert short.status_code == 200, short.text
        assert completion(client, [6], max_tokens=2).status_code == 200
