"""Fuzzing the OpenAI-compatible API: over a thousand generated requests, not one 5xx.

Bodies are generated from the request schemas (``api/schema.py``): mostly structurally
plausible completions and chat requests whose fields are now valid, now mistyped or out of
range (lone surrogates, NaN, huge integers, unknown modes, unknown keys …), plus raw junk bodies
and a few GET endpoints. Every answer is either a 2xx with a well-formed body (whole or SSE) or
a 4xx in OpenAI's error shape; afterwards the server, its engines and the router are healthy
and a normal request is answered. A request generated valid must be served (200). Valid
generations are kept to a few tokens (``default_max_tokens=4``, generated ``max_tokens`` small
or far out of range): 1,500 requests take about 25 s on two cores. Meanwhile two threads
scrape ``/metrics`` back to back, and every scrape must be a whole page (the engines' counters
too): concurrent scrapes once took each other's engine replies (a 500 after 2 s).
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

import httpx2 as httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dualpath.config_file import ServeConfig
from dualpath.server.api.app import build_app
from dualpath.server.launch import LocalCluster
from dualpath.server.metrics import ServeMetrics

from .test_api_errors import MODEL, assert_openai_error, byte_model, serving, tiny_cluster_config
from .test_api_hardening import assert_full_metrics

EXAMPLES = 1500  # one request each
MIN_REQUESTS = 1000

# -- valid requests, and what a client might send instead ---------------------------------------

SURROGATES = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, categories=["Cs"])
# st.text() drops surrogates whatever its alphabet: join the characters ourselves
ODD_TEXT = st.lists(st.one_of(SURROGATES, st.characters()), min_size=1, max_size=8).map("".join)
TEXT = st.one_of(st.text(max_size=30), ODD_TEXT)
JUNK_SCALAR = st.one_of(st.none(), st.booleans(), st.integers(), TEXT,
                        st.floats(allow_nan=True, allow_infinity=True))
JUNK = st.one_of(JUNK_SCALAR, st.lists(JUNK_SCALAR, max_size=3),
                 st.dictionaries(TEXT, JUNK_SCALAR, max_size=2))
WORDS = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12)  # no lone surrogates
TOKEN_IDS = st.lists(st.integers(0, 299), min_size=1, max_size=40)
MODES = ["basic", "layerwise", "dualpath", "oracle", "recompute"]
# basic keeps every layer resident: a cluster whose PEs hold a layer window refuses it (a 400);
# the fuzzed server allows every mode (by default only dualpath and the cluster's own)
SERVED_MODES = [m for m in MODES if m != "basic"]
READ_PATHS = ["auto", "pe", "de", "split"]
ROLES = ["system", "developer", "user", "assistant", "tool"]

# every optional field of _Sampling with values a request may carry; generations stay tiny
SAMPLING = {
    "max_tokens": st.integers(1, 4),
    "temperature": st.floats(0.0, 2.0),
    "top_p": st.floats(0.0, 1.0, exclude_min=True),
    "n": st.just(1),
    "stop": st.one_of(st.none(), WORDS, st.lists(WORDS, max_size=4)),
    "seed": st.integers(-(2**63), 2**64 - 1),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "logprobs": st.sampled_from([False, None]),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 8),
    "dualpath": st.fixed_dictionaries({}, optional={"mode": st.sampled_from(SERVED_MODES),
                                                    "read_path": st.sampled_from(READ_PATHS)}),
    "cache_salt": st.one_of(st.none(), WORDS),
    "user": TEXT,  # accepted and ignored
}
PART = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)})
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(ROLES),
     "content": st.one_of(st.text(max_size=40), st.none(), st.lists(PART, max_size=2))},
    optional={"name": WORDS})
COMPLETION = st.fixed_dictionaries(
    {"model": st.just(MODEL),
     "prompt": st.one_of(st.text(min_size=1, max_size=40), TOKEN_IDS,
                         st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=1),
                         st.lists(TOKEN_IDS, min_size=1, max_size=1))},
    optional={**SAMPLING, "echo": st.just(False)})
CHAT = st.fixed_dictionaries(
    {"model": st.just(MODEL), "messages": st.lists(MESSAGE, min_size=1, max_size=3)},
    optional={**SAMPLING, "max_completion_tokens": st.integers(1, 4)})

SOME_OUT_OF_VOCAB = st.lists(st.one_of(st.integers(min_value=300), st.integers(max_value=-1),
                                      st.integers(0, 299)), min_size=1, max_size=4)
BAD_TOKENS = st.one_of(st.integers(max_value=0), st.integers(min_value=1025),
                       st.floats(-10, 10).filter(lambda x: not x.is_integer()), JUNK)
BAD = {  # per field: values out of range or mistyped (or, by chance, valid after all)
    "model": st.one_of(ODD_TEXT, TEXT),
    "prompt": st.one_of(SOME_OUT_OF_VOCAB, ODD_TEXT, SOME_OUT_OF_VOCAB.map(lambda ids: [ids]),
                        st.sampled_from(["", [], [[]], ["a", "b"], [[1], [2]], "a" * 1100]),
                        JUNK),
    "messages": st.one_of(st.just([]), st.lists(st.fixed_dictionaries(
        {"role": st.one_of(st.sampled_from(ROLES), TEXT), "content": JUNK}), max_size=2), JUNK),
    "max_tokens": BAD_TOKENS,
    "max_completion_tokens": BAD_TOKENS,
    "temperature": st.one_of(st.floats(min_value=2.0, exclude_min=True),
                             st.floats(max_value=0.0, exclude_max=True),
                             st.floats(allow_nan=True), JUNK),
    "top_p": st.one_of(st.floats(max_value=0.0), st.floats(min_value=1.0, exclude_min=True),
                       JUNK),
    "stop": st.one_of(st.lists(ODD_TEXT, min_size=1, max_size=4), ODD_TEXT,
                      st.lists(WORDS, min_size=5, max_size=6), st.just([""]), JUNK),
    "seed": st.one_of(st.integers(max_value=-(2**63) - 1), st.integers(min_value=2**64), JUNK),
    "cache_salt": st.one_of(ODD_TEXT, st.text(min_size=257, max_size=300), JUNK),
    "dualpath": st.one_of(st.fixed_dictionaries({}, optional={
        "mode": st.one_of(st.sampled_from(MODES), TEXT), "read_path": JUNK,
        "speed": st.integers()}), JUNK),
}


@st.composite
def schema_body(draw: st.DrawFn, path: str) -> tuple[dict, bool]:
    """A valid body, or one with a few fields mistyped, out of range, missing or unknown."""
    body = draw(COMPLETION if path == "/v1/completions" else CHAT)
    changes = draw(st.sampled_from([0, 1, 0, 1, 1, 2]))  # about 1 in 3 valid, most others 1 change
    core = ["prompt" if "prompt" in body else "messages", "stop", "max_tokens", "model"]
    fields = core + sorted({*body, *BAD, *SAMPLING, "frobnicate"} - set(core))
    for _ in range(changes):
        key = draw(st.sampled_from(fields))  # biased to the first: the core fields
        if draw(st.booleans()) and draw(st.booleans()) and draw(st.booleans()):
            body.pop(key, None)
        else:
            body[key] = draw(BAD.get(key, JUNK))
    return body, changes == 0


@st.composite
def post(draw: st.DrawFn) -> tuple[str, str, bytes, dict[str, str], bool]:
    """A POST to a generation endpoint: a generated body (whole or cut short), or junk bytes."""
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    body, valid = draw(schema_body(path))
    raw = json.dumps(body, allow_nan=True).encode()  # ASCII: surrogates stay \\u escapes
    kind = draw(st.sampled_from(["whole"] * 8 + ["cut", "junk"]))
    if kind == "cut":
        raw = raw[: draw(st.integers(0, len(raw) - 1))]
    elif kind == "junk":
        raw = draw(st.binary(max_size=300))
    content_type = "application/json"
    if draw(st.integers(0, 9)) == 0:
        content_type = draw(st.sampled_from(["text/plain", "application/x-www-form-urlencoded"]))
    return "POST", path, raw, {"content-type": content_type}, valid and kind == "whole" and (
        content_type == "application/json")


GET = st.tuples(st.sampled_from(["GET"] * 6 + ["DELETE", "PUT"]),
                st.sampled_from(["/v1/models", "/health", "/version", "/metrics",
                                 "/openapi.json", "/v1/completions", "/v1/nothing", "/"]),
                st.just(b""), st.just({}), st.just(False))
REQUEST = st.one_of(post(), post(), post(), post(), post(), post(), post(), post(), post(), GET)


def token_limit(raw: bytes) -> int:
    """A bound on the tokens a served request may generate: the server's default of 4, or
    more where the request asked for more (a junk draw can be any integer)."""
    body = json.loads(raw)
    limits = [body.get(k) for k in ("max_completion_tokens", "max_tokens")]
    return max([4] + [v for v in limits if type(v) is int])


def check_answer(method: str, raw: bytes, valid: bool, response: httpx.Response) -> None:
    """A 2xx with a well-formed body, or a 4xx in OpenAI's error shape; never a 5xx; a valid
    request is served."""
    status = response.status_code
    assert status < 500, (status, raw[:300], response.text[:300])
    assert status == 200 or not valid, (status, raw[:300], response.text[:300])
    if status >= 400:
        assert_openai_error(response, status)
        return
    if method != "POST":
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line.removeprefix("data: ") for line in response.text.splitlines() if line]
        assert events and events[-1] == "[DONE]", raw[:300]
        *chunks, last = [json.loads(e) for e in events[:-1]]
        assert all("choices" in c or "usage" in c for c in chunks)
        assert "choices" in last or "usage" in last or (not valid and "error" in last), last
    else:
        answer = response.json()
        assert answer["choices"][0]["finish_reason"] in ("stop", "length")
        assert 0 <= answer["usage"]["completion_tokens"] <= token_limit(raw)


def test_fuzzed_requests_never_get_a_5xx(tiny_chaotic_dir, tmp_path):
    statuses: Counter[int] = Counter()
    with LocalCluster(tiny_chaotic_dir, tiny_cluster_config(tmp_path / "kv"),
                      log_dir=tmp_path / "logs") as cluster:
        router = cluster.router
        app = build_app(router, byte_model(tiny_chaotic_dir, router),
                        ServeConfig(default_max_tokens=4, allowed_modes=tuple(MODES)),
                        ServeMetrics(router))
        with serving(app) as (url, thread), httpx.Client(base_url=url, timeout=10) as client, \
                Scrapers(url, set(router.engines)) as scrapers:

            @settings(max_examples=EXAMPLES, deadline=None, database=None,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                             HealthCheck.filter_too_much])
            @given(REQUEST)
            def one_request(request: tuple[str, str, bytes, dict[str, str], bool]) -> None:
                method, path, raw, headers, valid = request
                response = client.request(method, path, content=raw, headers=headers)
                statuses[response.status_code] += 1
                check_answer(method, raw, valid, response)

            start = time.monotonic()
            one_request()
            elapsed = time.monotonic() - start
            scrapes = scrapers.stop()

            normal = client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "still there?"}],
                "max_tokens": 3, "ignore_eos": True})
            assert normal.status_code == 200
            assert normal.json()["usage"]["completion_tokens"] == 3
            assert thread.is_alive()
            for name in router.engines:
                assert cluster.process(name).poll() is None, f"engine {name} died"
            deadline = time.monotonic() + 10
            while (counters := router.counters())["requests"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert counters["requests"] == 0 and counters["bad_messages"] == 0, counters
    total = sum(statuses.values())
    figures = {"requests": total, "seconds": round(elapsed, 1), "scrapes": scrapes,
               "statuses": dict(sorted(statuses.items()))}
    (tmp_path / "fuzz.json").write_text(json.dumps(figures))
    print(f"fuzz: {figures}")
    assert total >= MIN_REQUESTS
    assert statuses[200] > 0 and any(400 <= s < 500 for s in statuses)  # both kinds ran
    assert scrapes >= 10


class Scrapers:
    """Two threads scraping ``/metrics`` until stopped; each page must be whole."""

    def __init__(self, url: str, engines: set[str]) -> None:
        self.url, self.engines = url, engines
        self.done = threading.Event()
        self.count = 0
        self.lock = threading.Lock()
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._scrape, daemon=True) for _ in range(2)]

    def __enter__(self) -> Scrapers:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()

    def _scrape(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as client:
            while not self.done.is_set():
                try:
                    assert_full_metrics(client.get("/metrics"), self.engines)
                    with self.lock:
                        self.count += 1
                except Exception as exc:  # every failure is reported by stop()
                    self.failures.append(repr(exc)[:300])
                self.done.wait(0.02)  # some room for the fuzzed requests

    def stop(self) -> int:
        """Stop scraping: the number of whole pages (any other answer fails the test)."""
        self.done.set()
        for thread in self.threads:
            thread.join(30)
        assert not self.failures, self.failures[:3]
        return self.count
