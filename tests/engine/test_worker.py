"""One engine contract: both roles' workers are a ``Worker``, the engine loop drives any
``Worker`` through it alone, and the prefill worker's first token comes from ``LLMEngine``'s own
forward and sampling (the draw a single engine would make)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from dualpath.config import EngineConfig
from dualpath.engine.decode import DecodeWorker
from dualpath.engine.llm_engine import LLMEngine
from dualpath.engine.loop import EngineIdentity, EngineProcess
from dualpath.engine.prefill import PrefillWorker
from dualpath.engine.sampler import Sampler
from dualpath.engine.worker import Worker
from dualpath.errors import RequestError
from dualpath.kv.host_pool import HostPool
from dualpath.protocol import (
    Abort,
    Aborted,
    AllocBuffer,
    Decode,
    Failed,
    GetMetrics,
    Hello,
    Message,
    Metrics,
    Peers,
    Prefill,
    Prefilled,
    Shutdown,
    Tokens,
    decode,
    encode,
)
from dualpath.request import SamplingParams
from dualpath.storage.client import StorageClient
from dualpath.storage.memory import MemoryStore
from dualpath.traffic.manager import TrafficManager

BLOCK = 16
PROMPT = tuple(range(10, 10 + 2 * BLOCK + 5))


@pytest.fixture(scope="module")
def engine(tiny_llama_dir) -> LLMEngine:
    return LLMEngine(tiny_llama_dir, EngineConfig(dtype="float32", block_size=BLOCK,
                                                  num_kv_blocks=32))


def _prefill_worker(engine: LLMEngine) -> PrefillWorker:
    pool = HostPool(engine.layout.full_block_bytes, 8, pin=False)
    storage = StorageClient(MemoryStore(engine.layout.full_block_bytes), BLOCK)
    return PrefillWorker(engine, pool, TrafficManager(None), storage)


def _decode_worker(engine: LLMEngine) -> DecodeWorker:
    pool = HostPool(engine.layout.full_block_bytes, 8, pin=False)
    storage = StorageClient(MemoryStore(engine.layout.full_block_bytes), BLOCK)
    return DecodeWorker(engine, pool, TrafficManager(None), storage)


@pytest.mark.parametrize("make", [_prefill_worker, _decode_worker])
def test_both_roles_workers_are_a_worker_and_answer_an_abort_alike(engine, make):
    worker = make(engine)
    assert isinstance(worker, Worker)
    assert not worker.has_work and worker.work() == [] and worker.held_requests() == ()
    assert worker.handle(Abort(7)) == [Aborted(7)]  # a request it does not know is answered
    assert worker.metrics() and all(isinstance(k, str) for k in worker.metrics())


def test_a_worker_refuses_the_other_roles_messages(engine):
    with pytest.raises(ValueError, match="prefill engine cannot handle 'alloc_buffer'"):
        _prefill_worker(engine).handle(AllocBuffer(1, PROMPT, 3, 0))
    with pytest.raises(ValueError, match="decode engine cannot handle 'prefill'"):
        _decode_worker(engine).handle(Prefill(1, PROMPT, 0, "pe", "no-de", 0, mode="oracle"))


def test_a_decode_without_its_buffer_fails_and_an_aborted_buffer_is_forgotten(engine):
    worker = _decode_worker(engine)
    params = SamplingParams(max_tokens=2)
    (failed,) = worker.handle(Decode(1, 5, 0, params))
    assert isinstance(failed, Failed) and "no prompt buffer" in failed.error
    worker.handle(AllocBuffer(2, PROMPT, 3, 0))
    assert worker.held_requests() == (2,)
    worker.handle(Abort(2))
    (failed,) = worker.handle(Decode(2, 5, 0, params))  # its tokens went with the buffer
    assert isinstance(failed, Failed) and worker.held_requests() == ()


@pytest.mark.parametrize("num_prior", [0, 3])
def test_the_prefill_workers_first_token_is_the_single_engines_draw(engine, tiny_llama_dir,
                                                                      num_prior):
    """Seeded sampling of the first token, a moved stream's too: the draw is output token
    ``num_prior_outputs``, on the logits a single engine computes for the same tokens."""
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=11)
    worker = _prefill_worker(engine)
    worker.handle(Prefill(1, PROMPT, 0, "pe", "no-de", 0, mode="oracle", params=params,
                          num_prior_outputs=num_prior))
    assert worker.has_work
    (done,) = [m for m in worker.work() if isinstance(m, Prefilled)]
    single = LLMEngine(tiny_llama_dir, EngineConfig(dtype="float32", block_size=BLOCK,
                                                    num_kv_blocks=32))
    logits, _ = single.prompt_logits(list(PROMPT))
    want = Sampler().sample(logits[-1:], [params], [0], num_outputs=[num_prior])
    assert done.first_token == want[0] and done.num_computed_tokens == len(PROMPT)
    assert worker.held_requests() == () and worker.free_kv_blocks == 32
    if not num_prior:  # a fresh request: just what generate() draws first
        first = single.generate([list(PROMPT)], params)[0].output_ids[0]
        assert done.first_token == first


def test_a_prefill_with_no_token_of_its_own_is_refused(engine):
    worker = _prefill_worker(engine)
    with pytest.raises(RequestError, match="prior outputs"):
        worker.handle(Prefill(1, PROMPT, 0, "pe", "no-de", 0, mode="oracle",
                              num_prior_outputs=len(PROMPT)))
    assert worker.held_requests() == ()


# -- the loop drives any Worker -----------------------------------------------------------------
class FakeWorker:
    """A worker that echoes: each request message becomes one unit of work that answers
    ``Tokens`` for it; ``Decode`` fails in ``handle``."""

    def __init__(self) -> None:
        self.on_step = lambda num_tokens: None
        self.abandon = lambda: False
        self.name = ""
        self.handled: list[Message] = []
        self.pending: list[int] = []
        self.worked = 0
        self.in_flight = 0  # transfers started that may still land

    def handle(self, msg: Message) -> list[Message]:
        self.handled.append(msg)
        if isinstance(msg, Decode):
            raise RuntimeError("no such buffer")
        if isinstance(msg, Abort):
            self.pending.remove(msg.req_id)
            return [Aborted(msg.req_id)]
        if isinstance(msg, Prefill | AllocBuffer):
            self.pending.append(msg.req_id)
        return []

    @property
    def has_work(self) -> bool:
        return bool(self.pending)

    def work(self) -> list[Message]:
        self.worked += 1
        if not self.pending:
            return []
        req_id = self.pending.pop(0)
        return [Tokens(((req_id, 0, (req_id,)),))]

    def held_requests(self) -> tuple[int, ...]:
        return tuple(self.pending)

    @property
    def free_kv_blocks(self) -> int:
        return 5

    def metrics(self) -> dict[str, object]:
        return {"num_echoes": self.worked}

    def liveness(self) -> tuple[float, float]:
        return 0.0, 0.0

    def fenced_requests(self) -> tuple[int, ...]:
        return ()

    def settled(self) -> bool:
        return not self.in_flight

    @property
    def read_queue_tokens(self) -> int:
        return 0

    def close(self) -> None:
        pass


class FakeSocket:
    """The loop's DEALER socket: an inbox of frames, and what was sent."""

    def __init__(self, inbox: list[Message]) -> None:
        self.inbox = [encode(m) for m in inbox]
        self.sent: list[Message] = []

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.inbox)

    def recv(self) -> bytes:
        return self.inbox.pop(0)

    def send(self, raw: bytes) -> None:
        self.sent.append(decode(raw))

    def close(self, linger: int) -> None:
        pass


def _process(worker: Worker, inbox: list[Message]) -> EngineProcess:
    """An engine process around ``worker``, without a model, a backend or a router."""
    proc = EngineProcess.__new__(EngineProcess)
    proc.identity = EngineIdentity("pe0", "prefill", 0)
    proc.worker = worker
    proc.socket = FakeSocket(inbox)
    proc.backend = SimpleNamespace(endpoint="ep-pe0")
    proc.traffic = SimpleNamespace(close=lambda: None, metrics=lambda: {}, nic_address=None)
    proc.storage = SimpleNamespace(close=lambda: None, metrics=lambda: {}, read_queue_tokens=0,
                                   warm=None)
    proc.host_pool = SimpleNamespace(close=lambda: None, num_free=8)
    proc.parts = SimpleNamespace(failure=lambda wait_s=0.0: None, close=lambda: None,
                                 instance=None)
    proc.ep = None
    proc.engine = None
    proc.config = SimpleNamespace(engine_timeout_s=1.0)
    proc._peer_endpoints = set()
    proc._running, proc._router_gone = True, False
    proc.incarnation = "a1"
    proc._inbox_read = (0.0, ())
    proc._rejoin, proc._rejoining = threading.Event(), False
    proc._heart = threading.Thread(target=lambda: None)
    return proc


def test_the_engine_loop_drives_any_worker_through_the_contract():
    worker = FakeWorker()
    inbox: list[Message] = [Prefill(1, (5, 6), 0, "pe", "no-de", 0), AllocBuffer(2, (7,), 1, 0),
                            Abort(2), Decode(3, 9, 0, SamplingParams()), Peers(), GetMetrics(),
                            Shutdown()]
    proc = _process(worker, inbox)
    assert proc.serve() == 0
    sent = proc.socket.sent
    assert [type(m).__name__ for m in sent] == ["Hello", "Aborted", "Failed", "Metrics",
                                                "Tokens"]
    assert sent[2] == Failed(3, "RuntimeError: no such buffer")  # a request fails, not the loop
    metrics = sent[3]
    assert isinstance(metrics, Metrics) and metrics.values["num_echoes"] == 0
    assert metrics.values["role"] == "prefill"
    # the loop's own messages never reach the worker; the request messages all do, in order
    assert [m.type for m in worker.handled] == ["prefill", "alloc_buffer", "abort", "decode"]
    assert sent[4] == Tokens(((1, 0, (1,)),)) and worker.held_requests() == ()


def test_a_forgotten_engine_aborts_through_the_worker():
    worker = FakeWorker()
    proc = _process(worker, [])
    worker.handle(Prefill(4, (5, 6), 0, "pe", "no-de", 0))
    worker.in_flight = 1  # a transfer it started may still land
    proc._rejoin.set()
    proc._drop_everything()
    assert worker.handled[-1] == Abort(4, fenced=True) and worker.held_requests() == ()
    assert proc.socket.sent == [Aborted(4)]  # the answer goes out: it lifts the PE's fence
    proc._hello_once_settled()
    assert len(proc.socket.sent) == 1  # no hello while a transfer may still land
    worker.in_flight = 0
    proc._hello_once_settled()
    proc._hello_once_settled()
    assert proc.socket.sent[1:] == [Hello("pe0", "prefill", 0, "ep-pe0", incarnation="a1")]
    assert proc._state().free_kv_blocks == 5  # the heartbeat reports the worker's room
