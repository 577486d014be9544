"""The vLLM adapter workers against a fake vLLM HTTP server (no vLLM): the PE's completion and
its ``Prefilled``, the DE's buffer, DE-path read, streamed decode and their failures and aborts;
and ``VllmInstance``'s command line, environment and missing-python error (nothing started)."""

from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

from dualpath.config import ClusterConfig, EngineConfig, StorageConfig, VllmConfig
from dualpath.integrations.vllm.engines.decode import VllmDecodeWorker
from dualpath.integrations.vllm.engines.http import (
    VllmHttp,
    VllmResponseError,
    VllmStatusError,
    parse_kv_cache_stats,
)
from dualpath.integrations.vllm.engines.instance import (
    PYTHON_ENV,
    VllmInstanceError,
    launch_plan,
    vllm_engine_parts,
    vllm_python,
)
from dualpath.integrations.vllm.engines.prefill import VllmPrefillWorker
from dualpath.integrations.vllm.fence import WorkerFence
from dualpath.integrations.vllm.plan import SEAL_BYTES, seal_of, seal_offset, vllm_salt
from dualpath.kv.hashing import KeySpace
from dualpath.kv.host_pool import HostPool
from dualpath.kv.layout import KVLayout
from dualpath.protocol import (
    Abort,
    Aborted,
    AllocBuffer,
    BufferReady,
    Decode,
    Failed,
    Finished,
    Message,
    Prefill,
    Prefilled,
    Tokens,
    Unfence,
)
from dualpath.request import SamplingParams
from dualpath.storage import open_store
from dualpath.storage.client import StorageClient

BS = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32", block_size=BS)
SPACE = KeySpace("m", LAYOUT.vllm_layout_id, BS)
EOS = 99
METRICS = """# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="fake"} 0.25
vllm:num_requests_running{engine="0",model_name="fake"} 2.0
vllm:num_requests_waiting{engine="0",model_name="fake"} 1.0
vllm:cache_config_info{block_size="4",engine="0",num_gpu_blocks="400",prefix="a{b}"} 1.0
"""


# -- the fake vLLM ------------------------------------------------------------------------------
class FakeVllm:
    """A vLLM OpenAI server stand-in: records completion bodies and answers as told.

    ``answer``: the JSON of a non-streamed completion; ``status``: its HTTP status; ``chunks``:
    a streamed completion's ``(token_ids, finish_reason)`` chunks; ``gate_after``: the stream
    waits on ``gate`` after that many chunks; ``break_after``: the connection is cut after that
    many chunks (no ``[DONE]``); ``hang``: a non-streamed call waits on ``gate``.
    """

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.answer: dict[str, Any] = {}
        self.status = 200
        self.chunks: list[tuple[list[int], str | None]] = []
        self.gate = threading.Event()
        self.gate_after: int | None = None
        self.break_after: int | None = None
        self.hang = False
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                pages = {"/health": "", "/v1/models": json.dumps({"data": [{"id": "fake"}]}),
                         "/metrics": METRICS}
                self._send(200 if self.path in pages else 404, pages.get(self.path, ""))

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.bodies.append(body)
                if fake.status != 200:
                    self._send(fake.status, '{"error": "boom"}')
                elif body.get("stream"):
                    self._stream()
                else:
                    if fake.hang:
                        fake.gate.wait(10)
                    self._send(200, json.dumps(fake.answer))

            def _send(self, status: int, text: str) -> None:
                data = text.encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _stream(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for i, (tokens, reason) in enumerate(fake.chunks):
                    if i == fake.break_after:
                        return  # cut off: no [DONE]
                    if i == fake.gate_after:
                        fake.gate.wait(10)
                    chunk = {"choices": [{"index": 0, "text": "", "token_ids": tokens,
                                          "finish_reason": reason}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.gate.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake():
    server = FakeVllm()
    yield server
    server.close()


def pump(worker: Any, want: type[Message], timeout_s: float = 5.0) -> list[Message]:
    """Run ``work`` until a message of type ``want`` comes; every message so far."""
    out: list[Message] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out += worker.work()
        if any(isinstance(m, want) for m in out):
            return out
        time.sleep(0.005)
    raise AssertionError(f"no {want.__name__} in {timeout_s} s; got {out}")


# -- prefill ------------------------------------------------------------------------------------
def prefill(req_id: int = 7, **kw: Any) -> Prefill:
    values: dict[str, Any] = dict(
        prompt_ids=tuple(range(1, 11)), num_hit_blocks=2, read_path="pe",
        de_endpoint="10.0.0.2:1234", de_buffer_addr=4096,
        params=SamplingParams(max_tokens=8, temperature=0.5, top_p=0.9, seed=3, min_tokens=2),
        cache_salt="tenant")
    values.update(kw)
    return Prefill(req_id, **values)


def test_prefill_sends_the_contract_body_and_maps_cached_tokens(fake):
    fake.answer = {"choices": [{"token_ids": [42], "text": "x"}],
                   "usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 4}}}
    worker = VllmPrefillWorker(VllmHttp(fake.url, 5), "fake", BS, block_bytes=1000)
    assert worker.handle(prefill()) == []
    assert worker.held_requests() == (7,) and worker.read_queue_tokens == 2 * BS
    out = pump(worker, Prefilled)
    [done] = out
    assert isinstance(done, Prefilled)
    assert (done.req_id, done.first_token, done.num_hit_blocks) == (7, 42, 1)  # 4 // 4
    assert done.num_computed_tokens == 6 and done.forward_s > 0
    assert worker.held_requests() == () and worker.read_queue_tokens == 0
    assert fake.bodies == [{
        "model": "fake", "prompt": list(range(1, 11)), "max_tokens": 1, "temperature": 0.5,
        "top_p": 0.9, "seed": 3, "min_tokens": 1, "return_token_ids": True, "stream": False,
        "cache_salt": vllm_salt("tenant"),  # vLLM gets the digest, the connector the salt
        "kv_transfer_params": {"dualpath": {
            "role": "prefill", "req_id": 7, "read_path": "pe", "num_hit_blocks": 2,
            "num_pe_read_blocks": 0, "de_endpoint": "10.0.0.2:1234", "de_buffer_addr": 4096,
            "num_blocks": 3, "mode": "layerwise", "cache_salt": "tenant",
            "fence_path": worker.fence_table().path}}}]
    assert worker.metrics()["vllm_requests"] == 1
    # the node's storage-NIC bytes: the PE-path hit blocks its instance used (1 of 2 asked)
    assert worker.metrics()["storage_snic_read_bytes"] == 1000
    worker.close()


def test_prefill_without_salt_seed_or_cached_tokens(fake):
    fake.answer = {"choices": [{"token_ids": [5]}], "usage": {"prompt_tokens": 10}}
    worker = VllmPrefillWorker(VllmHttp(fake.url, 5), "fake", BS)
    worker.handle(prefill(cache_salt="", params=SamplingParams(), read_path="de"))
    [done] = pump(worker, Prefilled)
    assert isinstance(done, Prefilled)
    assert (done.first_token, done.num_hit_blocks, done.num_computed_tokens) == (5, 0, 10)
    body = fake.bodies[0]
    assert "cache_salt" not in body and "seed" not in body and body["min_tokens"] == 0
    assert worker.read_queue_tokens == 0  # nothing read on the PE side on the DE path
    assert worker.metrics()["storage_snic_read_bytes"] == 0
    worker.close()


def test_prefill_http_error_fails_the_request_naming_the_instance(fake):
    fake.status = 500
    worker = VllmPrefillWorker(VllmHttp(fake.url, 5), "fake", BS)
    worker.handle(prefill())
    [failed] = pump(worker, Failed)
    assert isinstance(failed, Failed) and failed.req_id == 7
    assert failed.error.startswith(f"vllm prefill instance {fake.url}: ")
    assert "HTTP 500" in failed.error
    assert worker.held_requests() == () and worker.metrics()["vllm_failures"] == 1
    worker.close()


def test_prefill_connection_refused_fails_the_request():
    url = "http://127.0.0.1:9"  # discard: nothing listens
    worker = VllmPrefillWorker(VllmHttp(url, 5), "fake", BS)
    worker.handle(prefill())
    [failed] = pump(worker, Failed)
    assert isinstance(failed, Failed) and url in failed.error
    worker.close()


def test_prefill_abort_mid_call_closes_it_and_answers_aborted(fake):
    fake.hang = True
    worker = VllmPrefillWorker(VllmHttp(fake.url, 30), "fake", BS)
    worker.handle(prefill())
    deadline = time.monotonic() + 5
    while not fake.bodies and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker.handle(Abort(7)) == [Aborted(7)]
    assert worker.held_requests() == () and worker.read_queue_tokens == 0
    deadline = time.monotonic() + 2  # the closed call's thread ends now, not at the gate
    while not worker.has_work and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker.has_work
    assert worker.work() == []  # its late end is dropped
    worker.close()


def test_an_abort_is_answered_only_once_no_step_of_the_instance_may_still_push(fake):
    """The instance's worker is mid-step (it began a step before the abort): ``Aborted``
    waits until that step has ended; a step begun after the revocation drops the request's
    pushes, and a failed call is answered the same way."""
    fake.hang = True
    worker = VllmPrefillWorker(VllmHttp(fake.url, 30), "fake", BS)
    worker.name = "pe-fence-test"
    worker.handle(prefill(7))
    instance = WorkerFence()  # vLLM's worker process, played here
    instance.begin(worker.fence_table().path)  # a step under way, pushing request 7
    assert worker.handle(Abort(7)) == [] and worker.held_requests() == (7,)
    assert not worker.settled() and worker.work() == []
    later = WorkerFence()
    later.begin(worker.fence_table().path)  # the next step has seen the revocation
    assert later.revoked(7) and not later.revoked(8)
    assert worker.work() == []  # the first step still runs
    instance.end()
    assert worker.work() == [Aborted(7)] and worker.settled()
    assert worker.held_requests() == ()
    later.end()
    fake.hang, fake.status = False, 500
    later.begin(worker.fence_table().path)
    worker.handle(prefill(8))
    deadline = time.monotonic() + 5
    while worker.settled() and time.monotonic() < deadline:  # until the call has failed
        assert not [m for m in worker.work() if isinstance(m, Failed)]
        time.sleep(0.01)
    assert worker.held_requests() == (8,)  # failed, not yet settled
    later.end()
    [failed] = worker.work()
    assert isinstance(failed, Failed) and failed.req_id == 8
    path = worker.fence_table().path
    for fence in (instance, later):
        fence.close()
    worker.close()
    assert not os.path.exists(path)


def test_prefill_worker_reports_free_blocks_from_metrics(fake):
    worker = VllmPrefillWorker(VllmHttp(fake.url, 5), "fake", BS)
    worker.free_kv_blocks  # noqa: B018 (starts the refresh)
    deadline = time.monotonic() + 5
    while worker.free_kv_blocks == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker.free_kv_blocks == 300  # 400 blocks, a quarter used
    worker.close()


# -- decode -------------------------------------------------------------------------------------
@pytest.fixture
def de(fake, tmp_path):
    storage_config = StorageConfig(root=str(tmp_path / "store"), read_deadline_s=5.0)
    store = open_store(storage_config, LAYOUT)
    storage = StorageClient(store, BS, storage_config)
    pool = HostPool(LAYOUT.full_block_bytes + SEAL_BYTES, 8, pin=False,
                    shm_path=str(tmp_path / "pool.shm"))
    worker = VllmDecodeWorker(VllmHttp(fake.url, 5), "fake", LAYOUT, SPACE, pool, storage,
                              eos_token_ids=frozenset({EOS}))
    worker.store = store  # for the tests
    yield worker
    worker.close()
    storage.close()
    pool.close()


PROMPT = tuple(range(1, 11))  # two full blocks and two tokens


def block_bytes(k: int) -> bytes:
    """Stored block k: layer i filled with 16 * k + i."""
    return b"".join(bytes([16 * k + i]) * LAYOUT.layer_block_bytes
                    for i in range(LAYOUT.num_layers))


def store_blocks(worker: VllmDecodeWorker, salt: str = "") -> None:
    keys = SPACE.salted(salt).keys(PROMPT)
    assert worker.storage.write(keys, [bytearray(block_bytes(k)) for k in range(len(keys))])


def alloc(worker: VllmDecodeWorker, num_read: int = 2, salt: str = "") -> BufferReady:
    out = worker.handle(AllocBuffer(3, PROMPT, 3, num_read, cache_salt=salt))
    if not out:
        out = pump(worker, BufferReady)
    [ready] = out
    assert isinstance(ready, BufferReady)
    return ready


def test_alloc_buffer_reads_the_de_path_hit_into_the_layer_major_buffer(de):
    store_blocks(de, "s")
    ready = alloc(de, salt="s")
    assert (ready.req_id, ready.num_blocks, ready.num_loaded_blocks) == (3, 3, 2)
    pool, lb = de.host_pool, LAYOUT.layer_block_bytes
    start = ready.buffer_addr - pool.base_address
    region = bytes(pool.slab[start : start + 3 * LAYOUT.full_block_bytes].numpy())
    for i in range(LAYOUT.num_layers):
        for b in range(2):
            at = (i * 3 + b) * lb
            assert region[at : at + lb] == bytes([16 * b + i]) * lb
    assert de.held_requests() == (3,) and pool.num_free == 5


def test_a_new_buffer_is_unsealed_whatever_its_slots_held(de):
    """The decode instance copies a buffer in only under this request's seal, which the
    prefill writes last: a reused buffer's old seal must not pass for it."""
    de.host_pool.slab.fill_(0xFF)
    ready = alloc(de, num_read=0)
    start = ready.buffer_addr - de.host_pool.base_address
    at = start + seal_offset(ready.num_blocks, LAYOUT.full_block_bytes)
    assert bytes(de.host_pool.slab[at : at + SEAL_BYTES].numpy()) == bytes(SEAL_BYTES)
    assert de.host_pool.slab[at + SEAL_BYTES] == 0xFF  # nothing past it


def test_a_pool_without_room_for_the_seal_is_refused(tmp_path, fake):
    pool = HostPool(LAYOUT.full_block_bytes, 2, pin=False, shm_path=str(tmp_path / "p.shm"))
    with pytest.raises(ValueError, match="seal"):
        VllmDecodeWorker(VllmHttp(fake.url, 5), "fake", LAYOUT, SPACE, pool, None)  # type: ignore[arg-type]
    pool.close()


def test_a_damaged_block_loads_fewer(de):
    store_blocks(de)
    path = de.store.path_for(SPACE.keys(PROMPT)[1])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # the payload's last byte: the checksum no longer matches
    path.write_bytes(bytes(data))
    assert alloc(de).num_loaded_blocks == 1


def test_no_read_is_ready_at_once(de):
    ready = de.handle(AllocBuffer(3, PROMPT, 3, 0))
    assert isinstance(ready[0], BufferReady) and ready[0].num_loaded_blocks == 0


def test_decode_streams_tokens_frees_the_buffer_after_the_first_chunk_and_finishes(de, fake):
    store_blocks(de)
    ready = alloc(de)
    fake.chunks = [([11], None), ([12, 13], None), ([14], "stop")]
    fake.gate_after = 1
    params = SamplingParams(max_tokens=10, temperature=0.0, stop=("end",), min_tokens=3)
    assert de.handle(Decode(3, first_token=50, num_stored_blocks=2, params=params)) == []
    out = pump(de, Tokens)
    assert out == [Tokens(((3, 1, (11,)),))]  # the first token (index 0) came from the PE
    assert de.host_pool.num_free == 8  # copied in by the instance: the buffer is free
    assert de.held_requests() == (3,)
    fake.gate.set()
    out = pump(de, Finished)
    tokens = [item for m in out if isinstance(m, Tokens) for item in m.items]
    assert tokens == [(3, 2, (12, 13)), (3, 4, (14,))] or tokens == [(3, 2, (12, 13, 14))] \
        or [t for _, _, ts in tokens for t in ts] == [12, 13, 14]
    assert out[-1] == Finished(3, (50, 11, 12, 13, 14), "stop")
    assert de.held_requests() == ()
    body = fake.bodies[0]
    assert body == {
        "model": "fake", "prompt": [*PROMPT, 50], "max_tokens": 9, "temperature": 0.0,
        "top_p": 1.0, "stop": ["end"], "ignore_eos": False, "min_tokens": 2,
        "return_token_ids": True, "stream": True,
        "kv_transfer_params": {"dualpath": {
            "role": "decode", "req_id": 3, "shm_path": de.host_pool.shm_path,
            "buffer_offset": ready.buffer_addr - de.host_pool.base_address, "num_blocks": 3,
            "num_tokens": 10, "num_stored_blocks": 2, "cache_salt": ""}}}


def test_decode_of_a_moved_stream_streams_from_the_first_token(de, fake):
    de.handle(AllocBuffer(3, PROMPT, 3, 0))  # the last 2 of PROMPT are prior outputs
    fake.chunks = [([21], "length")]
    params = SamplingParams(max_tokens=4)
    de.handle(Decode(3, 60, 0, params, num_prior_outputs=2))
    out = pump(de, Finished)
    tokens = [item for m in out if isinstance(m, Tokens) for item in m.items]
    assert tokens == [(3, 2, (60, 21))]
    assert out[-1] == Finished(3, (9, 10, 60, 21), "length")
    assert fake.bodies[0]["max_tokens"] == 1


def test_max_tokens_one_finishes_without_a_call(de, fake):
    de.handle(AllocBuffer(3, PROMPT, 3, 0))
    out = de.handle(Decode(3, 50, 0, SamplingParams(max_tokens=1)))
    assert out == [Finished(3, (50,), "length")]
    assert fake.bodies == [] and de.host_pool.num_free == 8 and de.held_requests() == ()


def _prefilled(worker: VllmDecodeWorker, req_id: int, salt: str = "",
               seal: bool = True) -> None:
    """Allocate ``req_id``'s buffer and fill it as the prefill's pushes would: layer i of
    block k holds ``16 * k + i`` (``block_bytes``), sealed last."""
    [ready] = worker.handle(AllocBuffer(req_id, PROMPT, 3, 0, cache_salt=salt))
    pool, lb = worker.host_pool, LAYOUT.layer_block_bytes
    start = ready.buffer_addr - pool.base_address
    for i in range(LAYOUT.num_layers):
        for b in range(3):
            at = start + (i * 3 + b) * lb
            pool.slab[at : at + lb] = 16 * b + i
    if seal:
        at = start + seal_offset(3, LAYOUT.full_block_bytes)
        pool.slab[at : at + SEAL_BYTES] = torch.frombuffer(bytearray(seal_of(req_id)),
                                                          dtype=torch.uint8)


def _written(worker: VllmDecodeWorker, timeout_s: float = 5.0) -> None:
    """Wait until the worker's writes landed and their buffers went back to the pool."""
    deadline = time.monotonic() + timeout_s
    while worker.host_pool.num_free < 8 and time.monotonic() < deadline:
        worker.work()
        time.sleep(0.005)


def test_a_request_ending_on_its_first_token_stores_its_prompt_from_the_buffer(de, fake):
    """It never reaches the decode instance, whose connector persists a prompt's full blocks
    otherwise: the worker stores those not yet stored, from the sealed buffer, in the store's
    block format (a block's layers in order), then frees the buffer."""
    _prefilled(de, 3, salt="s")
    out = de.handle(Decode(3, 50, 0, SamplingParams(max_tokens=1)))
    assert out == [Finished(3, (50,), "length")] and fake.bodies == []
    _written(de)
    keys = SPACE.salted("s").keys(PROMPT)
    assert de.storage.exists_prefix(keys) == 2 and de.num_persisted_blocks == 2
    back = [bytearray(LAYOUT.full_block_bytes) for _ in keys]
    assert de.storage.read(keys, back) == [True, True]
    assert [bytes(b) for b in back] == [block_bytes(0), block_bytes(1)]
    assert de.host_pool.num_free == 8 and de.held_requests() == ()
    _prefilled(de, 4)  # the leading block stored already: only the second is written
    assert de.handle(Decode(4, EOS, 1, SamplingParams())) == [Finished(4, (EOS,), "stop")]
    _written(de)
    assert de.num_persisted_blocks == 3 and de.storage.exists_prefix(SPACE.keys(PROMPT)) == 0
    assert de.storage.exists_prefix(SPACE.keys(PROMPT)[1:]) == 1


def test_an_unsealed_buffer_of_a_first_token_end_stores_nothing(de, fake):
    """No seal: a push did not land, the bytes may be incomplete; nothing is stored."""
    _prefilled(de, 3, seal=False)
    assert de.handle(Decode(3, 50, 0, SamplingParams(max_tokens=1))) == [
        Finished(3, (50,), "length")]
    assert de.storage.exists_prefix(SPACE.keys(PROMPT)) == 0
    assert (de.num_persisted_blocks, de.num_unsealed_ends) == (0, 1)
    assert de.host_pool.num_free == 8


def test_eos_first_token_finishes_without_a_call_unless_ignored(de, fake):
    de.handle(AllocBuffer(3, PROMPT, 3, 0))
    assert de.handle(Decode(3, EOS, 0, SamplingParams())) == [Finished(3, (EOS,), "stop")]
    de.handle(AllocBuffer(4, PROMPT, 3, 0))
    fake.chunks = [([1], "length")]
    assert de.handle(Decode(4, EOS, 0, SamplingParams(max_tokens=2, ignore_eos=True))) == []
    assert pump(de, Finished)[-1] == Finished(4, (EOS, 1), "length")
    assert fake.bodies[0]["ignore_eos"] is True


def test_a_broken_stream_fails_the_request(de, fake):
    de.handle(AllocBuffer(3, PROMPT, 3, 0))
    fake.chunks = [([11], None), ([12], None), ([13], "stop")]
    fake.break_after = 2
    de.handle(Decode(3, 50, 0, SamplingParams()))
    out = pump(de, Failed)
    failed = out[-1]
    assert isinstance(failed, Failed) and failed.req_id == 3
    assert failed.error.startswith(f"vllm decode instance {fake.url}: ")
    assert "[DONE]" in failed.error
    assert de.host_pool.num_free == 8 and de.held_requests() == ()


def test_an_http_error_frees_the_buffer_and_fails(de, fake):
    de.handle(AllocBuffer(3, PROMPT, 3, 0))
    fake.status = 503
    de.handle(Decode(3, 50, 0, SamplingParams()))
    failed = pump(de, Failed)[-1]
    assert isinstance(failed, Failed) and "HTTP 503" in failed.error
    assert de.host_pool.num_free == 8


def test_abort_mid_stream_closes_it_and_fences_the_buffer_until_unfenced(de, fake):
    de.handle(AllocBuffer(3, PROMPT, 3, 0))
    fake.chunks = [([11], None), ([12], "stop")]
    fake.gate_after = 0  # nothing streams: the buffer is still held
    de.handle(Decode(3, 50, 0, SamplingParams()))
    deadline = time.monotonic() + 5
    while not fake.bodies and time.monotonic() < deadline:
        time.sleep(0.01)
    assert de.handle(Abort(3, fenced=True)) == [Aborted(3)]
    assert de.held_requests() == () and de.host_pool.num_free == 5
    time.sleep(0.3)  # no timer frees it
    out = de.work()
    assert not any(isinstance(m, Finished | Failed) for m in out)
    assert de.host_pool.num_free == 5 and de.fenced_requests() == (3,)
    de.handle(Unfence((3, 99)))  # 99: not held, ignored
    assert de.host_pool.num_free == 8 and de.fenced_requests() == ()


def test_close_closes_the_open_streams(de, fake):
    de.handle(AllocBuffer(3, PROMPT, 3, 0))
    fake.chunks, fake.gate_after = [([11], None), ([12], "stop")], 1
    de.handle(Decode(3, 50, 0, SamplingParams()))
    pump(de, Tokens)
    [job] = de._streams.values()
    de.close()
    assert job.call.closed


def test_decode_without_a_buffer_fails(de):
    [failed] = de.handle(Decode(3, 50, 0, SamplingParams()))
    assert isinstance(failed, Failed) and "no prompt buffer" in failed.error


def test_allocs_wait_fifo_for_a_contiguous_run(de):
    de.handle(AllocBuffer(1, PROMPT, 6, 0))
    assert de.handle(AllocBuffer(2, PROMPT, 3, 0)) == []  # 2 free: waits
    assert de.held_requests() == (1, 2)
    out = de.handle(Abort(1))
    assert out[0] == Aborted(1) and isinstance(out[1], BufferReady) and out[1].req_id == 2


def test_the_decode_pool_must_be_shared(fake, tmp_path):
    pool = HostPool(LAYOUT.full_block_bytes, 2, pin=False)
    with pytest.raises(ValueError, match="shm_path"):
        VllmDecodeWorker(VllmHttp(fake.url), "fake", LAYOUT, SPACE, pool, None)  # type: ignore[arg-type]


# -- the HTTP client ----------------------------------------------------------------------------
def test_http_client_probes(fake):
    http = VllmHttp(fake.url, 5)
    assert http.healthy() and http.model_name() == "fake"
    stats = http.kv_cache_stats()
    assert (stats.num_blocks, stats.usage_frac, stats.num_running, stats.num_waiting) == \
        (400, 0.25, 2, 1)
    assert not VllmHttp("http://127.0.0.1:9", 5).healthy()
    fake.status = 400
    with pytest.raises(VllmStatusError, match=fake.url) as info:
        http.completions({"prompt": [1]})
    assert info.value.status == 400


def test_stream_without_done_is_an_error(fake):
    fake.chunks, fake.break_after = [([1], None), ([2], None)], 1
    with pytest.raises(VllmResponseError, match="DONE"):
        list(VllmHttp(fake.url, 5).stream_completions({"prompt": [1]}))


def test_metrics_parse_ignores_other_lines():
    stats = parse_kv_cache_stats("# nothing\nvllm:other 3\n")
    assert stats.num_blocks is None and stats.free_blocks == 0


# -- the instance's launch ----------------------------------------------------------------------
def fake_model(tmp_path: Path) -> Path:
    folder = tmp_path / "SmolTest"
    folder.mkdir()
    folder.joinpath("config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
        "vocab_size": 100, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16", "eos_token_id": 2}))
    folder.joinpath("model.safetensors").write_bytes(b"weights")
    return folder


def test_launch_plan_builds_the_serve_command_and_environment(tmp_path):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    config = ClusterConfig(engine=EngineConfig(block_size=64),
                           storage=StorageConfig(root="/kv"),
                           vllm=VllmConfig(python=str(python), kv_cache_gb=2.5, max_model_len=1024,
                                           extra_args=("--enforce-eager",)))
    model = fake_model(tmp_path)
    plan = launch_plan(model, config, "decode", "10.1.2.3", "de0", port=8123,
                       log_path=tmp_path / "de0.vllm.log", root=Path("/proj"),
                       environ={"PYTHONPATH": "/x", "OMP_NUM_THREADS": "3",
                                "VLLM_CPU_KVCACHE_SPACE": "4"})
    cmd = list(plan.command)
    assert cmd[:3] == [str(python), "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert flags["--model"] == str(model) and flags["--port"] == "8123"
    assert flags["--host"] == "127.0.0.1" and flags["--block-size"] == "64"
    assert flags["--dtype"] == "bfloat16" and flags["--max-model-len"] == "1024"
    assert "--enable-prompt-tokens-details" in cmd and cmd[-1] == "--enforce-eager"
    kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "DualPathConnector" and kv["kv_role"] == "kv_consumer"
    extra = kv["kv_connector_extra_config"]
    assert extra["role"] == "decode" and extra["root"] == "/kv" and extra["host"] == "10.1.2.3"
    assert extra["model_id"].startswith("SmolTest")
    # the budget byte-exact (2.5 GiB, not the whole GiB VLLM_CPU_KVCACHE_SPACE takes), and no
    # inherited VLLM_CPU_KVCACHE_SPACE: vLLM-CPU would replace the flag with it
    assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(int(2.5 * 2**30))
    assert "VLLM_CPU_KVCACHE_SPACE" not in plan.env
    assert "--enable-prefix-caching" in cmd and "--no-enable-prefix-caching" not in cmd
    assert plan.env["PYTHONPATH"].split(":") == ["/proj", "/x"]
    assert plan.env["OMP_NUM_THREADS"] == "3"  # the caller's kept
    assert plan.url == "http://127.0.0.1:8123"


def test_launch_plan_carries_a_bounded_budget_and_the_prefix_cache_switch(tmp_path):
    """``kv_cache_bytes`` reaches vLLM byte for byte (the bench's bounded budget); vLLM's
    prefix cache is on by default, with or without the connector, and off when asked."""
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    model = fake_model(tmp_path)

    def command(plain: bool = False, **vllm: object) -> list[str]:
        config = ClusterConfig(vllm=VllmConfig(python=str(python), **vllm))
        return list(launch_plan(model, config, "prefill", "127.0.0.1", port=8124, plain=plain,
                                log_path=tmp_path / "pe.log", environ={}).command)

    bounded = command(kv_cache_bytes=17_694_720, kv_cache_gb=3)
    assert bounded[bounded.index("--kv-cache-memory-bytes") + 1] == "17694720"
    assert "--enable-prefix-caching" in bounded and "--kv-transfer-config" in bounded
    off = command(prefix_caching=False)
    assert "--no-enable-prefix-caching" in off and "--enable-prefix-caching" not in off
    assert "--enable-prefix-caching" in command(plain=True, prefix_caching=False)
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        VllmConfig(kv_cache_bytes=0)


def test_missing_peers_python_names_make_peers(tmp_path):
    with pytest.raises(VllmInstanceError, match="make peers"):
        vllm_python(VllmConfig(), root=tmp_path, environ={})
    with pytest.raises(VllmInstanceError, match="nowhere"):
        vllm_python(VllmConfig(), root=tmp_path, environ={PYTHON_ENV: str(tmp_path / "nowhere")})
    (tmp_path / ".venv-peers" / "bin").mkdir(parents=True)
    python = tmp_path / ".venv-peers" / "bin" / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    assert vllm_python(VllmConfig(), root=tmp_path, environ={}) == python


# -- the engine process's seam ------------------------------------------------------------------
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_an_engine_process_in_vllm_mode_loads_no_model_and_drives_the_instance(fake, tmp_path,
                                                                              role):
    from dualpath.control_keys import ClusterKeys
    from dualpath.engine.loop import EngineIdentity, EngineProcess
    from dualpath.engine.worker import Worker
    from dualpath.vocab import EngineKind

    config = ClusterConfig(engine=EngineConfig(block_size=BS),
                           storage=StorageConfig(root=str(tmp_path / "store")),
                           host_pool_blocks=8, save_staging_blocks=2,
                           engine_kind=EngineKind.VLLM, vllm=VllmConfig(request_timeout_s=5))
    key = ClusterKeys.generate(["e0"]).engine_key("e0")
    parts = vllm_engine_parts(fake_model(tmp_path), config, role, "e0", url=fake.url)
    proc = EngineProcess(EngineIdentity("e0", role, 0), parts, "tcp://127.0.0.1:1", key)
    try:
        assert proc.engine is None and proc.vllm is not None and not proc.vllm.owned
        worker = proc.worker
        assert isinstance(worker, Worker) and worker.model == "fake"
        shm = proc.host_pool.shm_path
        if role == "decode":
            assert isinstance(worker, VllmDecodeWorker) and shm and Path(shm).exists()
            assert proc.host_pool.num_slots == 8 and worker.max_position == 256
            assert worker.key_space.layout_id.startswith("vllm-LBHNC-bfloat16-L2-")
        else:
            assert isinstance(worker, VllmPrefillWorker) and shm is None
            worker.handle(prefill(params=SamplingParams()))
            assert proc._state().read_queue_tokens == 2 * BS  # the worker's own ledger
        beat = proc._state()
        assert beat.progress_age_s < 60 and beat.inbox_age_s < 60
    finally:
        proc.close()
    assert not shm or not Path(shm).exists()


HEALTH_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *a): pass
print("fake vllm up", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def fake_python(tmp_path: Path, body: str) -> Path:
    """A stand-in for the peers' python: a shell script that sees the serve command line."""
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\nwhile [ $# -gt 0 ]; do [ \"$1\" = --port ] && PORT=$2; "
                      f"shift; done\n{body}\n")
    script.chmod(0o755)
    return script


def started(tmp_path: Path, body: str, timeout_s: float = 20) -> Any:
    from dualpath.integrations.vllm.engines.instance import VllmInstance

    vllm = VllmConfig(python=str(fake_python(tmp_path, body)), start_timeout_s=timeout_s)
    plan = launch_plan(fake_model(tmp_path), ClusterConfig(vllm=vllm), "prefill", "127.0.0.1",
                       "pe0", log_path=tmp_path / "pe0.vllm.log")
    return VllmInstance.start(plan, vllm)


def test_an_instance_starts_waits_for_health_and_stops_its_group(tmp_path):
    import sys

    server = tmp_path / "server.py"
    server.write_text(HEALTH_SERVER)
    instance = started(tmp_path, f"exec {sys.executable} {server} $PORT")
    assert instance.owned and instance.alive() and instance.http.healthy()
    assert "fake vllm up" in instance.log_tail()
    instance.close()
    assert not instance.alive() and not instance.http.healthy()
    instance.close()  # idempotent


def test_an_instance_that_exits_fails_its_start_with_its_log(tmp_path):
    with pytest.raises(VllmInstanceError, match=r"(?s)exited with 3.*no model here"):
        started(tmp_path, "echo no model here; exit 3")


def test_an_instance_never_healthy_is_stopped_at_the_timeout(tmp_path):
    with pytest.raises(VllmInstanceError, match=r"(?s)not healthy after.*waiting"):
        started(tmp_path, "echo waiting; exec sleep 60", timeout_s=1)


DYING_SERVER = """
import http.server, os, sys, threading, time
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
        if self.path == "/die":  # as a SIGKILLed vLLM: its sockets close, then it is reaped
            threading.Thread(target=die, daemon=True).start()
    def log_message(self, *a): pass
def die():
    server.socket.close()
    time.sleep(float(sys.argv[2]))
    os._exit(9)
server = http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H)
server.serve_forever()
"""


@pytest.mark.parametrize("linger_s", [1.0, 60.0])
def test_a_failure_waits_for_an_instance_whose_sockets_closed_to_exit(tmp_path, linger_s):
    """The window that moved a stream twice: the instance's sockets are closed (the call broke)
    but its process is not reaped yet. Without a wait the engine would tell the router the call
    failed, and the router could place the stream back on this engine."""
    import sys

    server = tmp_path / "dying.py"
    server.write_text(DYING_SERVER)
    instance = started(tmp_path, f"exec {sys.executable} {server} $PORT {linger_s}")
    parts = vllm_engine_parts(tmp_path / "SmolTest", ClusterConfig(), "prefill", "pe0",
                              url=instance.url)  # the model folder ``started`` wrote
    parts.instance = instance
    try:
        started_s = time.monotonic()
        assert parts.failure(5.0) is None  # healthy: no wait at all
        assert time.monotonic() - started_s < 2.0
        instance.http._get("/die")
        deadline = time.monotonic() + 5
        while instance.http.healthy() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert parts.failure() is None  # not reaped yet: no wait, no failure seen
        started_s = time.monotonic()
        failure = parts.failure(3.0)
        waited_s = time.monotonic() - started_s
        if linger_s < 3.0:
            assert failure is not None and "exited with 9" in failure
            assert waited_s < 3.0
        else:  # a server that stopped answering but lives on: the wait is bounded
            assert failure is None and 3.0 <= waited_s < 4.5
    finally:
        instance.close()
        parts.host_pool.close()


def test_the_engine_exits_when_its_vllm_child_dies(fake, tmp_path, monkeypatch):
    import subprocess

    from dualpath.control_keys import ClusterKeys
    from dualpath.engine import loop
    from dualpath.integrations.vllm.engines.instance import VllmInstance
    from dualpath.vocab import EngineKind

    config = ClusterConfig(engine=EngineConfig(block_size=BS),
                           storage=StorageConfig(root=str(tmp_path / "store")),
                           host_pool_blocks=8, save_staging_blocks=2,
                           engine_kind=EngineKind.VLLM, vllm=VllmConfig(request_timeout_s=5))
    key = ClusterKeys.generate(["pe0"]).engine_key("pe0")
    parts = vllm_engine_parts(fake_model(tmp_path), config, "prefill", "pe0", url=fake.url)
    proc = loop.EngineProcess(loop.EngineIdentity("pe0", "prefill", 0), parts,
                              "tcp://127.0.0.1:1", key)
    child = subprocess.Popen(["true"], start_new_session=True)
    child.wait()
    parts.instance = VllmInstance(proc.vllm.http, child, tmp_path / "none.log")
    assert proc.serve() == loop.VLLM_GONE_EXIT
