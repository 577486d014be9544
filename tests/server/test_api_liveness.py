"""``/health`` follows the router thread and the engines, and ``dualpath serve`` stops when its
router thread dies (issue 33).

A cluster of its own (1 PE + 1 DE of a tiny random Llama) goes through the faults in turn: a
router thread that is stuck answers no query (503 within the probe's limit, not after its 10 s
wait), a decode engine that died leaves a role unserved (503), and a router thread that ended
makes ``/health`` a 503 at once, generations 503, ``/metrics`` the request-level series, and
``RouterWatch`` stops the HTTP server (``serve`` then exits with status 1).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx2 as httpx
import pytest

from dualpath.config_file import ServeConfig
from dualpath.server.api.app import build_app
from dualpath.server.api.health import HEALTH_TIMEOUT_S
from dualpath.server.launch import LocalCluster
from dualpath.server.metrics import ServeMetrics
from dualpath.server.serve import RouterWatch

from .test_api_errors import MODEL, assert_openai_error, byte_model, tiny_cluster_config
from .test_api_errors import uvicorn_serving as serving


@pytest.fixture
def local(tiny_chaotic_dir, tmp_path) -> Iterator[LocalCluster]:
    with LocalCluster(tiny_chaotic_dir, tiny_cluster_config(tmp_path / "kv"),
                      log_dir=tmp_path / "logs") as cluster:
        engines = list(cluster.router.engines)
        try:
            yield cluster
        finally:  # engines whose router died would wait out their router timeout
            for name in engines:
                if cluster.process(name).poll() is None:
                    cluster.process(name).kill()


def timed_health(client: httpx.Client) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    response = client.get("/health")
    return response, time.monotonic() - start


def test_health_follows_the_router_thread_and_the_engines_and_serve_stops_without_router(
        local, tiny_chaotic_dir):
    router = local.router
    app = build_app(router, byte_model(tiny_chaotic_dir, router), ServeConfig(),
                    ServeMetrics(router))
    with serving(app) as (url, server, thread), httpx.Client(base_url=url, timeout=30) as client:
        health = client.get("/health")
        assert health.status_code == 200, health.text
        assert {e["role"] for e in health.json()["engines"]} == {"prefill", "decode"}

        # a stuck router thread: before, /health read the engine table and said 200
        release = threading.Event()
        router._inbox.put(lambda: release.wait(HEALTH_TIMEOUT_S + 1.5))
        try:
            response, took = timed_health(client)
            assert_openai_error(response, 503, "does not answer")
            assert took < HEALTH_TIMEOUT_S + 1.0, took
        finally:
            release.set()
        deadline = time.monotonic() + 10
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "/health never recovered"
            time.sleep(0.1)

        # a decode engine gone: the decode role is unserved
        local.process("de1").kill()
        deadline = time.monotonic() + 10
        while (response := client.get("/health")).status_code == 200:
            assert time.monotonic() < deadline, "/health kept saying 200 without a decode engine"
            time.sleep(0.1)
        assert_openai_error(response, 503, "decode")
        assert "pe0" in {e["name"] for e in response.json()["engines"]}  # who is still in

        # the router thread ended: before, /health said 200 (engines still registered)
        router.shutdown(notify_engines=False)
        assert not router.alive
        response, took = timed_health(client)
        assert_openai_error(response, 503, "router thread")
        assert took < 1.0, took
        start = time.monotonic()
        metrics = client.get("/metrics")
        assert metrics.status_code == 200 and time.monotonic() - start < 2.0
        assert "dualpath:requests_total" in metrics.text
        assert "dualpath:num_requests_running" not in metrics.text
        assert_openai_error(client.post("/v1/completions", json={"model": MODEL, "prompt": [1]}),
                            503)

        with RouterWatch(router, server, interval_s=0.05) as watch:
            thread.join(15)
        assert watch.died and not thread.is_alive()
