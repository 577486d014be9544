"""Agent sessions on the API: ``X-Session-ID`` / ``x-dynamo-session-id`` / body ``session_id``
and ``agent_hint`` (``dualpath/sessions.py``), on the token-in/token-out route RL trainers use.

A real ``LocalCluster`` of a tiny random Llama (1 PE + 1 DE) behind the app on a loopback port.
Bad sessions and hints get OpenAI-shaped 400s and lose nothing; good ones are counted in
``/metrics`` and documented in the OpenAPI schema; a rollout's second turn (its first turn's
prompt and output plus new tokens, same session) hits what the first stored.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dualpath.config_file import ServeConfig
from dualpath.kv.retention import SessionMark
from dualpath.server.api.app import build_app
from dualpath.server.launch import LocalCluster
from dualpath.server.metrics import ServeMetrics
from dualpath.server.router.sessions import session_key
from dualpath.storage.session_marks import FOLDER, mark_name

from .test_api_errors import MODEL, byte_model, serving, tiny_cluster_config

PROMPT = [17, 200, 5, 91, 240, 33, 128, 7, 250, 64, 12, 199, 3, 141, 59, 77, 18, 230, 41, 9]
BODY = {"model": MODEL, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True}
LOCAL_TOKENS = 32  # a session's turn computing at most this many is prefilled on its DE


@pytest.fixture(scope="module")
def store_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("api-sessions") / "kv"


@pytest.fixture(scope="module")
def api(tiny_chaotic_dir, store_root) -> Iterator[httpx.Client]:
    config = tiny_cluster_config(store_root)  # a capped store: eviction, so session marks
    config = replace(config, storage=replace(config.storage, capacity_gb=1.0),
                     local_prefill_tokens=LOCAL_TOKENS)
    with LocalCluster(tiny_chaotic_dir, config, log_dir=store_root.parent / "logs") as cluster:
        router = cluster.router
        app = build_app(router, byte_model(tiny_chaotic_dir, router), ServeConfig(),
                        ServeMetrics(router))
        with serving(app) as (url, _), httpx.Client(base_url=url, timeout=60) as client:
            yield client


def complete(api: httpx.Client, headers: dict[str, str] | None = None,
             **body: Any) -> httpx.Response:
    return api.post("/v1/completions", json={**BODY, "prompt": PROMPT, **body},
                    headers=headers or {})


def metrics(api: httpx.Client) -> dict[str, float]:
    text = api.get("/metrics").text
    return {f"{s.name}{sorted(s.labels.items())}": s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def count(values: dict[str, float], name: str, label: str, value: str) -> float:
    return values.get(f"dualpath:{name}_total{[(label, value)]}", 0.0)


def test_each_place_a_session_id_comes_from_is_taken_and_counted(api):
    before = metrics(api)
    plain = complete(api).json()["choices"][0]["token_ids"]
    for headers, body in (({"X-Session-ID": "traj-1"}, {}),
                          ({"x-dynamo-session-id": "traj-2"}, {}),
                          ({}, {"session_id": "traj-3"}),
                          ({"X-Session-ID": "traj-4"}, {"session_id": "traj-4"})):
        reply = complete(api, headers, **body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["token_ids"] == plain  # a session changes no token
    after = metrics(api)
    assert count(after, "session_requests", "source", "header") == count(
        before, "session_requests", "source", "header") + 3
    assert count(after, "session_requests", "source", "body") == count(
        before, "session_requests", "source", "body") + 1


@pytest.mark.parametrize("headers,body,param,words", [
    ({"X-Session-ID": "a"}, {"session_id": "b"}, "session_id", "differs between"),
    ({"X-Session-ID": "a", "x-dynamo-session-id": "b"}, {}, "session_id", "differs between"),
    ({"X-Session-ID": "has space"}, {}, "session_id", "visible ASCII"),
    ({}, {"session_id": "x" * 257}, "session_id", "at most 256"),
    ({}, {"agent_hint": {"lease_s": 10}}, "agent_hint", "needs a session"),
    ({}, {"session_id": "s", "agent_hint": {"lease_s": -1}}, "agent_hint.lease_s",
     "greater than or equal to 0"),
    ({}, {"session_id": "s", "agent_hint": {"priority": 101}}, "agent_hint.priority",
     "less than or equal to 100"),
    ({}, {"session_id": "s", "agent_hint": {"ttl": 5}}, "agent_hint.ttl", "Extra inputs"),
    ({}, {"session_id": "s", "agent_hint": {"end_of_session": True, "lease_s": 5}},
     "agent_hint", "no lease_s"),
    ({}, {"session_id": "s", "agent_hint": {"next_turn_in_s": 1e9}},
     "agent_hint.next_turn_in_s", "less than or equal to 86400"),
])
def test_bad_sessions_and_hints_are_400s_in_openais_shape(api, headers, body, param, words):
    reply = complete(api, headers, **body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and words in error["message"], error
    assert error["param"] == param, error
    assert complete(api, headers={"X-Session-ID": "ok"}).status_code == 200  # nothing lost


def test_hints_are_counted_by_name(api):
    before = metrics(api)
    reply = complete(api, {"X-Session-ID": "traj-h"},
                     agent_hint={"priority": 3, "lease_s": 30, "next_turn_in_s": 2.5})
    assert reply.status_code == 200, reply.text
    assert complete(api, {"X-Session-ID": "traj-h"},
                    agent_hint={"end_of_session": True}).status_code == 200
    after = metrics(api)
    for hint in ("priority", "lease_s", "next_turn_in_s", "end_of_session"):
        assert count(after, "agent_hints", "hint", hint) == count(
            before, "agent_hints", "hint", hint) + 1, hint


def test_a_rollouts_next_turn_in_the_same_session_hits_the_first(api):
    """What an RL rollout sends: token ids in, token ids out, one session per trajectory."""
    session = {"X-Session-ID": "rollout-17"}
    first = complete(api, session, prompt=PROMPT, agent_hint={"next_turn_in_s": 1.0}).json()
    tool_output = [44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55]
    context = first["prompt_token_ids"] + first["choices"][0]["token_ids"] + tool_output
    second = complete(api, session, prompt=context, agent_hint={"end_of_session": True}).json()
    assert second["prompt_token_ids"] == context
    assert len(second["choices"][0]["token_ids"]) == BODY["max_tokens"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16  # a full block


def test_each_finished_turn_leaves_its_sessions_mark_on_its_stored_chain(api, store_root):
    session = {"X-Session-ID": "marked-1"}
    path = store_root / FOLDER / mark_name(session_key("marked-1", ""))
    first = complete(api, session, agent_hint={"lease_s": 600}).json()
    leased = SessionMark.from_json(path.read_bytes())
    assert leased.live_until_ns - leased.seen_ns == 600 * 10**9 and not leased.ended
    assert list(store_root.rglob(leased.tip.hex() + ".kvb"))  # the tip is a stored block
    context = first["prompt_token_ids"] + first["choices"][0]["token_ids"] + [1, 2, 3]
    complete(api, session, prompt=context, agent_hint={"end_of_session": True})
    ended = SessionMark.from_json(path.read_bytes())
    assert ended.ended and ended.tip != leased.tip
    assert list(store_root.rglob(ended.tip.hex() + ".kvb"))


def storage_counter(api: httpx.Client, counter: str) -> float:
    return sum(v for k, v in metrics(api).items()
               if k.startswith("dualpath:storage_total") and f"'counter', '{counter}'" in k)


def local_prefills(api: httpx.Client) -> float:
    return metrics(api).get("dualpath:router_local_prefills_total[]", 0.0)


@pytest.mark.parametrize("new_tokens", [40, 3])
def test_a_sessions_next_turn_is_served_where_the_session_is_warm(api, new_tokens):
    """The first turn stores 4 full blocks (60 prompt + 8 output tokens). 40 new tokens (56
    to compute): the next turn goes through the PE and its DE reads the hit from its DRAM
    copy. 3 new tokens (7 to compute): its DE prefills it and takes the hit from its device
    KV, reading nothing. Either way: the tokens of the same prompt served without a
    session."""
    session = {"X-Session-ID": f"warm-{new_tokens}"}
    prompt = [*PROMPT, *range(60, 100)]
    first = complete(api, session, prompt=prompt).json()
    hits, local = storage_counter(api, "warm_hits"), local_prefills(api)
    context = (first["prompt_token_ids"] + first["choices"][0]["token_ids"]
               + list(range(5, 5 + new_tokens)))
    second = complete(api, session, prompt=context).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    if new_tokens > LOCAL_TOKENS:
        assert storage_counter(api, "warm_hits") >= hits + 3 and local_prefills(api) == local
    else:
        assert storage_counter(api, "warm_hits") == hits and local_prefills(api) == local + 1
    plain = complete(api, prompt=context).json()  # no session: through the PE, from storage
    assert plain["choices"][0]["token_ids"] == second["choices"][0]["token_ids"]
    assert local_prefills(api) == local + (new_tokens <= LOCAL_TOKENS)
