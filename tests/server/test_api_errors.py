"""Bad requests to the OpenAI-compatible API: each gets its 4xx in OpenAI's error shape, never
a 5xx, never a dead process, and the server answers normal requests afterwards.

The app runs in this process (uvicorn on a thread, real HTTP on a loopback port) over a real
``LocalCluster`` of a tiny random Llama (1 PE + 1 DE). Tiny models have no tokenizer, so the
API sees UTF-8 bytes as token ids: deterministic, and like a real tokenizer it refuses a lone
surrogate.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest
import uvicorn
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from dualpath.config import ClusterConfig, EngineConfig, StorageConfig
from dualpath.config_file import ServeConfig
from dualpath.model.spec import load_spec
from dualpath.server.api.app import ModelInfo, build_app
from dualpath.server.launch import LocalCluster
from dualpath.server.metrics import ServeMetrics
from dualpath.server.router.client import Router

MODEL = "tiny"
KEY = "sk-test"
MAX_BODY = 16_384
LIMIT = 2  # max_concurrent_requests
AUTH = {"authorization": f"Bearer {KEY}"}


def byte_model(model_dir: Path, router: Router) -> ModelInfo:
    """The tiny model as the API sees it: UTF-8 bytes are the token ids (vocab 300)."""
    spec = load_spec(model_dir)

    def encode(text: str) -> list[int]:
        return list(text.encode("utf-8"))  # UnicodeEncodeError on a lone surrogate

    def decode(ids: list[int]) -> str:
        return bytes(t % 256 for t in ids).decode("utf-8", "replace")

    def encode_chat(messages: list[dict[str, str]]) -> list[int]:
        return encode("".join(f"<{m['role']}>{m['content']}\n" for m in messages))

    context = min(spec.max_position, router.state.capacity.kv_tokens)
    return ModelInfo(MODEL, spec.vocab_size, context, encode, decode, encode_chat,
                     max_token_chars=1)


def tiny_cluster_config(root: Path) -> ClusterConfig:
    """1 PE + 1 DE of the tiny model: enough for the API, light on a small machine."""
    return ClusterConfig(engine=EngineConfig(dtype="float32", block_size=16, num_kv_blocks=256),
                         storage=StorageConfig(root=str(root)), host_pool_blocks=96,
                         num_decode=1)


@contextlib.contextmanager
def serving(app: FastAPI) -> Iterator[tuple[str, threading.Thread]]:
    """Serve ``app`` with uvicorn on a free loopback port (a thread); yield its URL."""
    with uvicorn_serving(app) as (url, _, thread):
        yield url, thread


@contextlib.contextmanager
def uvicorn_serving(app: FastAPI) -> Iterator[tuple[str, uvicorn.Server, threading.Thread]]:
    """Like ``serving``, and the uvicorn server too."""
    # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on such sockets (else ~40 ms a reply)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


class Api:
    """The running app, its cluster and a client that sends the API key."""

    def __init__(self, url: str, thread: threading.Thread, cluster: LocalCluster) -> None:
        self.url, self.thread, self.cluster = url, thread, cluster
        self.client = httpx.Client(base_url=url, headers=AUTH, timeout=20)

    def metric(self, name: str, **labels: str) -> float:
        """One sample of /metrics (0 when absent)."""
        text = self.client.get("/metrics").text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v
                                               for k, v in labels.items()):
                    return sample.value
        return 0.0

    def wait_idle(self, timeout_s: float = 10.0) -> dict[str, int]:
        """The router's counters once it holds no request."""
        return wait_idle(self.cluster.router, timeout_s)


def wait_idle(router: Router, timeout_s: float = 10.0) -> dict[str, int]:
    """``router``'s counters once it holds no request (or after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while (counters := router.counters())["requests"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return counters


@pytest.fixture(scope="module")
def api(tiny_chaotic_dir, tmp_path_factory) -> Iterator[Api]:
    tmp = tmp_path_factory.mktemp("api-errors")
    settings = ServeConfig(api_key=KEY, max_body_bytes=MAX_BODY, max_concurrent_requests=LIMIT,
                           default_max_tokens=4)
    with LocalCluster(tiny_chaotic_dir, tiny_cluster_config(tmp / "kv"),
                      log_dir=tmp / "logs") as cluster:
        router = cluster.router
        app = build_app(router, byte_model(tiny_chaotic_dir, router), settings,
                        ServeMetrics(router))
        with serving(app) as (url, thread):
            api = Api(url, thread, cluster)
            yield api
            api.client.close()


def assert_openai_error(response: httpx.Response, status: int, *fragments: str) -> dict:
    """``response`` is ``status`` with OpenAI's error object naming every fragment."""
    assert response.status_code == status, (response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    for fragment in fragments:
        assert fragment in error["message"], (fragment, error["message"])
    return error


COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]

# (path, body: a dict sent as JSON or raw bytes, status, fragments of the message)
BAD_REQUESTS = {
    "invalid JSON": (COMPLETIONS, b'{"model": "tiny", "prompt": ', 400, ("not valid JSON",)),
    "JSON not an object": (CHAT, b"[1, 2]", 400, ()),
    "missing model": (COMPLETIONS, {"prompt": "hi"}, 400, ("model",)),
    "missing prompt": (COMPLETIONS, {"model": MODEL}, 400, ("prompt",)),
    "missing messages": (CHAT, {"model": MODEL}, 400, ("messages",)),
    "mistyped max_tokens": (COMPLETIONS, {"model": MODEL, "prompt": "hi", "max_tokens": "many"},
                            400, ("max_tokens",)),
    "mistyped messages": (CHAT, {"model": MODEL, "messages": "hello"}, 400, ("messages",)),
    "unknown role": (CHAT, {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]},
                     400, ("role",)),
    "image content": (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, ("content",)),
    "unknown model": (COMPLETIONS, {"model": "gpt-9", "prompt": "hi"}, 404, ("gpt-9", MODEL)),
    "unknown model (chat)": (CHAT, {"model": "gpt-9", "messages": USER}, 404, ("gpt-9",)),
    "empty messages": (CHAT, {"model": MODEL, "messages": []}, 400, ("messages",)),
    "empty prompt": (COMPLETIONS, {"model": MODEL, "prompt": ""}, 400, ("empty",)),
    "empty token list": (COMPLETIONS, {"model": MODEL, "prompt": []}, 400, ("empty",)),
    "two prompts": (COMPLETIONS, {"model": MODEL, "prompt": ["a", "b"]}, 400, ("one prompt",)),
    "prompt over the context": (COMPLETIONS, {"model": MODEL, "prompt": "a" * 1100}, 400,
                                ("1024", "1100")),
    "chat over the context": (CHAT, {"model": MODEL, "messages": [
        {"role": "user", "content": "a" * 1100}]}, 400, ("1024", "1100 characters")),
    "chat over the context once rendered": (CHAT, {"model": MODEL, "messages": [
        {"role": "user", "content": "a" * 1020}]}, 400, ("1024", "1027")),
    "token ids over the context": (COMPLETIONS, {"model": MODEL, "prompt": [1] * 1025}, 400,
                                   ("1024", "1025 tokens")),
    "prompt + max_tokens over the context": (
        COMPLETIONS, {"model": MODEL, "prompt": "a" * 1000, "max_tokens": 100}, 400,
        ("1024", "1000 prompt tokens", "100 completion tokens")),
    "negative max_tokens": (COMPLETIONS, {"model": MODEL, "prompt": "hi", "max_tokens": -1},
                            400, ("max_tokens",)),
    "zero max_tokens": (COMPLETIONS, {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400,
                        ("max_tokens",)),
    "huge max_tokens": (COMPLETIONS, {"model": MODEL, "prompt": "hi", "max_tokens": 10**30},
                        400, ("1024",)),
    "huge max_completion_tokens": (CHAT, {"model": MODEL, "messages": USER,
                                          "max_completion_tokens": 10**9}, 400, ("1024",)),
    "n=2": (CHAT, {"model": MODEL, "messages": USER, "n": 2}, 400, ("n",)),
    "token id out of vocab": (COMPLETIONS, {"model": MODEL, "prompt": [1, 2, 300]}, 400,
                              ("[0, 300)",)),
    "negative token id": (COMPLETIONS, {"model": MODEL, "prompt": [-1]}, 400, ("[0, 300)",)),
    "five stop strings": (COMPLETIONS, {"model": MODEL, "prompt": "hi",
                                        "stop": ["a", "b", "c", "d", "e"]}, 400, ("stop",)),
    "empty stop string": (CHAT, {"model": MODEL, "messages": USER, "stop": [""]}, 400,
                          ("stop",)),
    "temperature 3": (CHAT, {"model": MODEL, "messages": USER, "temperature": 3}, 400,
                      ("temperature",)),
    "top_p 0": (COMPLETIONS, {"model": MODEL, "prompt": "hi", "top_p": 0}, 400, ("top_p",)),
    "seed over 64 bits": (COMPLETIONS, {"model": MODEL, "prompt": "hi", "seed": 2**64}, 400,
                          ("seed",)),
    "negative min_tokens": (COMPLETIONS, {"model": MODEL, "prompt": "hi", "min_tokens": -1},
                            400, ("min_tokens",)),
    "logprobs": (CHAT, {"model": MODEL, "messages": USER, "logprobs": True}, 400,
                 ("logprobs",)),
    "echo": (COMPLETIONS, {"model": MODEL, "prompt": "hi", "echo": True}, 400, ("echo",)),
    "unknown dualpath mode": (COMPLETIONS, {"model": MODEL, "prompt": "hi",
                                            "dualpath": {"mode": "warp"}}, 400, ("mode",)),
    "unknown dualpath option": (COMPLETIONS, {"model": MODEL, "prompt": "hi",
                                              "dualpath": {"speed": 2}}, 400, ("speed",)),
    # JSON can escape a lone surrogate; no tokenizer and no msgpack message can carry it
    "lone surrogate in the prompt": (COMPLETIONS, b'{"model": "tiny", "prompt": "a\\ud800"}',
                                     400, ("prompt",)),
    "lone surrogate in a stop string": (
        COMPLETIONS, b'{"model": "tiny", "prompt": "hi", "max_tokens": 2, "stop": ["\\ud800"]}',
        400, ("stop",)),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_gets_its_4xx_in_openai_shape(api, case):
    path, body, status, fragments = BAD_REQUESTS[case]
    if isinstance(body, bytes):
        response = api.client.post(path, content=body,
                                   headers={"content-type": "application/json"})
    else:
        response = api.client.post(path, json=body)
    assert_openai_error(response, status, *fragments)


def test_wrong_or_missing_api_key_is_401(api):
    body = {"model": MODEL, "messages": USER}
    for headers in ({"authorization": "Bearer sk-wrong"}, {"authorization": KEY}, {}):
        with httpx.Client(base_url=api.url, headers=headers) as client:
            error = assert_openai_error(client.post(CHAT, json=body), 401, "API key")
            assert error["code"] == "invalid_api_key"
            assert_openai_error(client.get("/v1/models"), 401)
    assert api.client.get("/health").status_code == 200  # not behind the key


def test_body_over_max_body_bytes_is_413_and_one_without_length_411(api):
    body = {"model": MODEL, "prompt": "a" * (MAX_BODY + 10)}
    assert_openai_error(api.client.post(COMPLETIONS, json=body), 413, str(MAX_BODY))
    chunked = iter([json.dumps({"model": MODEL, "prompt": "hi"}).encode()])  # no Content-Length
    assert_openai_error(api.client.post(COMPLETIONS, content=chunked,
                                        headers={"content-type": "application/json"}), 411)


def test_unknown_path_and_method_get_openai_errors(api):
    assert_openai_error(api.client.get("/v1/nothing"), 404)
    assert_openai_error(api.client.get(CHAT), 405)


def test_more_than_max_concurrent_requests_is_429(api):
    hold = {"model": MODEL, "prompt": "hold", "max_tokens": 1000, "ignore_eos": True,
            "stream": True}
    readers = []  # a dropped line iterator closes its response: keep them
    with contextlib.ExitStack() as held:
        for _ in range(LIMIT):  # each stream holds a slot until it is closed
            response = held.enter_context(api.client.stream("POST", COMPLETIONS, json=hold))
            assert response.status_code == 200
            readers.append(response.iter_lines())
            assert next(readers[-1]).startswith("data: ")
        error = assert_openai_error(api.client.post(CHAT, json={"model": MODEL,
                                                                 "messages": USER}),
                                    429, str(LIMIT))
        assert error["type"] == "rate_limit_error"
    assert api.wait_idle()["requests"] == 0  # closing the streams aborted both
    deadline = time.monotonic() + 10
    while (response := api.client.post(CHAT, json={"model": MODEL, "messages": USER,
                                                   "max_tokens": 2})).status_code == 429:
        assert time.monotonic() < deadline, "the slots were never given back"
        time.sleep(0.05)
    assert response.status_code == 200


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_client_that_goes_away_aborts_its_request(api, stream):
    body = {"model": MODEL, "prompt": "go away", "max_tokens": 1000, "ignore_eos": True,
            "stream": stream}
    aborted = api.metric("dualpath:requests_total", outcome="aborted")
    finished = api.metric("dualpath:requests_total", outcome="finished")
    if stream:
        with api.client.stream("POST", COMPLETIONS, json=body) as response:
            lines = response.iter_lines()
            for _ in range(3):
                next(lines)
    else:
        with pytest.raises(httpx.ReadTimeout):
            api.client.post(COMPLETIONS, json=body, timeout=0.5)
    assert api.wait_idle(5.0)["requests"] == 0
    assert api.metric("dualpath:requests_total", outcome="aborted") == aborted + 1
    assert api.metric("dualpath:requests_total", outcome="finished") == finished


def test_a_temperature_or_top_p_near_zero_samples_greedily(api):
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True}
    greedy = api.client.post(COMPLETIONS, json={**body, "temperature": 0})
    assert greedy.status_code == 200
    for extreme in ({"temperature": 5e-324}, {"temperature": 1.0, "top_p": 5e-324}):
        response = api.client.post(COMPLETIONS, json={**body, **extreme})
        assert response.status_code == 200, (extreme, response.text)  # not NaN on the engines
        assert response.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


def test_after_bad_requests_the_server_still_serves(api):
    chat = api.client.post(CHAT, json={"model": MODEL, "messages": USER, "max_tokens": 3,
                                        "ignore_eos": True})
    assert chat.status_code == 200
    assert chat.json()["usage"]["completion_tokens"] == 3
    text = api.client.post(COMPLETIONS, json={"model": MODEL, "prompt": [1, 2, 3]})
    assert text.status_code == 200 and text.json()["choices"][0]["finish_reason"]
    assert api.client.get("/v1/models").json()["data"][0]["id"] == MODEL
    assert api.client.get("/health").status_code == 200
    assert api.thread.is_alive()
    for name in api.cluster.router.engines:
        assert api.cluster.process(name).poll() is None, f"engine {name} died"
    counters = api.wait_idle()
    assert counters["requests"] == 0 and counters["bad_messages"] == 0
