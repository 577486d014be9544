"""Peers the router must not trust: a real local cluster (1 PE + 2 DE of the tiny model) and
sockets that are not its engines. Sockets without a key, with an unknown key, with one
engine's key under another's identity, and an authenticated peer sending malformed, mistyped,
unknown, mis-addressed, replayed and flooding frames: after each, the router is alive, no
engine was added or dropped, a real request still gets the single-process tokens, and every
counter but the refusal counters returns to zero."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq
from multiturn import wait_for

from dualpath.config import ClusterConfig, EngineConfig, StorageConfig
from dualpath.control_keys import ClusterKeys, EngineKey, KeyPair
from dualpath.control_socket import curve_client
from dualpath.engine.llm_engine import LLMEngine
from dualpath.protocol import (
    BufferReady,
    Finished,
    Heartbeat,
    Hello,
    Join,
    JoinConfig,
    Prefilled,
    Tokens,
    decode,
    encode,
)
from dualpath.request import SamplingParams
from dualpath.server.launch import LocalCluster

pytestmark = pytest.mark.faults

ENGINE = EngineConfig(dtype="float32", block_size=16, num_kv_blocks=256)
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)
PROMPT = [(5 * i + 7) % 290 for i in range(40)]
SPARE = "x9"  # a key the router knows, for no engine it runs: an authenticated stranger
REFUSALS = ("refused_messages", "refused_peers", "dropped_messages")


@pytest.fixture(scope="module")
def want(tiny_llama_dir) -> list[int]:
    return LLMEngine(tiny_llama_dir, ENGINE).generate([PROMPT], PARAMS)[0].output_ids


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    keys = ClusterKeys.generate(["pe0", "de1", "de2", SPARE]).write(tmp / "keys")
    config = ClusterConfig(engine=ENGINE, storage=StorageConfig(root=str(tmp / "kv")),
                           host_pool_blocks=64, control_keys=str(keys))
    with LocalCluster(tiny_llama_dir, config, log_dir=tmp / "logs") as cluster:
        yield cluster


def _peer(cluster, identity: str, key: EngineKey | None) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.setsockopt(zmq.LINGER, 0)
    if key is not None:
        curve_client(sock, key)
    sock.connect(cluster.router.address)
    return sock


def _answers(sock: zmq.Socket, frames: list[bytes], wait_s: float = 0.5) -> list[bytes]:
    """Send every frame; what came back within ``wait_s``."""
    for frame in frames:
        sock.send(frame)
    got, deadline = [], time.monotonic() + wait_s
    while (left := deadline - time.monotonic()) > 0:
        if sock.poll(int(1000 * left)):
            got.append(sock.recv())
    return got


def _still_serving(cluster, want) -> None:
    """Alive, the same engines, the right tokens, nothing held."""
    assert cluster.router.alive
    assert set(cluster.router.engines) == {"pe0", "de1", "de2"}
    assert cluster.submit(PROMPT, PARAMS).result(60).output_ids == want

    def settled():
        counters = cluster.router.counters()
        busy = {k: v for k, v in counters.items()
                if v and k not in (*REFUSALS, "bad_messages", "corrected", "stuck", "moved")}
        return "ok" if not busy else None
    wait_for(settled, timeout_s=10, what="every counter back at zero")
    assert cluster.router.counters()["bad_messages"] == 0


def _hello(name: str = "pe0") -> bytes:
    return encode(Hello(name, "prefill", 0, "127.0.0.1:1"))


def test_a_socket_without_a_key_gets_nothing_through(cluster, want):
    sock = _peer(cluster, "pe0", None)
    try:
        assert _answers(sock, [_hello(), encode(Join("pe0", "prefill", 0)), b"junk"]) == []
    finally:
        sock.close(0)
    _still_serving(cluster, want)


def test_an_unknown_key_is_refused_at_the_handshake(cluster, want):
    before = cluster.router.counters()["refused_peers"]
    stranger = EngineKey("pe0", KeyPair.new(), cluster.router.keys.router.public)
    sock = _peer(cluster, "pe0/join", stranger)
    try:
        assert _answers(sock, [encode(Join("pe0", "prefill", 0))]) == []
    finally:
        sock.close(0)
    assert cluster.router.counters()["refused_peers"] > before
    _still_serving(cluster, want)


def test_one_engines_key_cannot_speak_for_another(cluster, want):
    spare = cluster.router.keys.engine_key(SPARE)
    before = cluster.router.counters()["refused_messages"]
    for identity in ("pe0", "pe0/hb", "pe0/join", "de7"):  # taken, or another name
        sock = _peer(cluster, identity, spare)
        try:
            beat = encode(Heartbeat(identity.split("/")[0], 0, 0, 0))
            join = encode(Join(identity.split("/")[0], "prefill", 0))
            assert _answers(sock, [_hello(identity.split("/")[0]), beat, join]) == []
        finally:
            sock.close(0)
    assert cluster.router.counters()["refused_messages"] > before
    _still_serving(cluster, want)


def test_malformed_mistyped_and_misaddressed_frames_change_nothing(cluster, want):
    sock = _peer(cluster, SPARE, cluster.router.keys.engine_key(SPARE))
    frames = [b"", b"\xc1\xc1", msgpack.packb([1, 2]), msgpack.packb({"type": "nope"}),
              msgpack.packb({"type": "hello", "name": SPARE, "role": "encode", "node_id": 1,
                             "endpoint": "e"}),
              msgpack.packb({"type": "hello", "name": SPARE, "role": "decode", "node_id": "1",
                             "endpoint": "e"}),
              msgpack.packb({"type": "tokens", "items": [[1, 0, [-3]]]}),
              _hello("pe0"),  # speaks for another engine
              encode(Join(SPARE, "decode", 9)),  # a join on the engine socket
              encode(Heartbeat(SPARE, 1, 1, 0))]  # a beat on the engine socket
    try:
        assert _answers(sock, frames) == []
    finally:
        sock.close(0)
    _still_serving(cluster, want)


def test_replayed_and_out_of_order_messages_of_a_stranger_are_dropped(cluster, want):
    out = cluster.submit(PROMPT, PARAMS).result(60)
    assert out.output_ids == want
    sock = _peer(cluster, SPARE, cluster.router.keys.engine_key(SPARE))
    before = cluster.router.counters()["dropped_messages"]
    replay = [encode(m) for wire in range(1, 40) for m in (
        BufferReady(wire, 4096, 3, 0), Prefilled(wire, 5, 0, 40),
        Tokens(((wire, 1, (6, 7)),)), Finished(wire, (5, 6, 7), "length"))]
    try:
        assert _answers(sock, replay[::-1]) == []  # newest first
    finally:
        sock.close(0)
    assert cluster.router.counters()["dropped_messages"] >= before + len(replay)
    _still_serving(cluster, want)


def test_a_flood_of_joins_is_answered_without_stopping_the_router(cluster, want):
    sock = _peer(cluster, f"{SPARE}/join", cluster.router.keys.engine_key(SPARE))
    try:
        started = time.monotonic()
        answers = _answers(sock, [encode(Join(SPARE, "decode", 9))] * 2000, wait_s=3.0)
        assert all(isinstance(decode(a), JoinConfig) for a in answers) and answers
        _still_serving(cluster, want)  # served while the joins were answered
        assert time.monotonic() - started < 30
    finally:
        sock.close(0)
