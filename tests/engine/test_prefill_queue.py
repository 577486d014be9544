"""The prefill engine's queue: which accepted request its next forward computes.

A real ``PrefillWorker`` on a tiny model. Requests in ``oracle`` mode move no KV, so they are
ready at once; a PE-path request reads through a store whose reads finish only when the test
says. The queue is FIFO in placement order (the router's wire ids), and a request still reading
is passed over rather than waited for.
"""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from dualpath.config import EngineConfig
from dualpath.engine.llm_engine import LLMEngine
from dualpath.engine.prefill import PrefillWorker
from dualpath.kv.host_pool import HostPool
from dualpath.protocol import Failed, Prefill, Prefilled
from dualpath.scheduler.batch import AttentionCostModel
from dualpath.storage.client import ReadFuture
from dualpath.traffic.manager import TrafficManager

BLOCK = 16


class GatedStore:
    """A storage client whose reads finish when :meth:`finish` is called."""

    def __init__(self) -> None:
        self.reads: list[ReadFuture] = []

    def submit_read(self, keys, buffers, keep=None) -> ReadFuture:
        future = ReadFuture()
        future.io_done = Future()
        future.set_running_or_notify_cancel()
        future.io_done.set_running_or_notify_cancel()
        future.num_blocks = len(keys)  # type: ignore[attr-defined]
        self.reads.append(future)
        return future

    def finish(self) -> None:
        for read in self.reads:
            if not read.done():
                read.set_result([True] * read.num_blocks)  # type: ignore[attr-defined]
                read.io_done.set_result(None)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir) -> LLMEngine:
    return LLMEngine(tiny_llama_dir, EngineConfig(dtype="float32", block_size=BLOCK,
                                                  num_kv_blocks=32))


@pytest.fixture
def worker(engine) -> tuple[PrefillWorker, GatedStore]:
    store = GatedStore()
    pool = HostPool(engine.layout.full_block_bytes, 8, pin=False)
    return PrefillWorker(engine, pool, TrafficManager(None), store), store  # type: ignore[arg-type]


def _prefill(req_id: int, mode: str = "oracle", read_path: str = "pe",
             num_hit_blocks: int = 0) -> Prefill:
    prompt = tuple(range(1 + req_id, 1 + req_id + 2 * BLOCK + 3))
    return Prefill(req_id, prompt, num_hit_blocks, read_path, "no-de", 0, mode=mode)


def _prefilled(messages) -> list[int]:
    return [m.req_id for m in messages if isinstance(m, Prefilled)]


def test_a_request_still_reading_is_passed_over(worker):
    w, store = worker
    w.accept(_prefill(1, mode="layerwise", read_path="pe", num_hit_blocks=2))  # reads 2 blocks
    w.accept(_prefill(2))
    assert len(store.reads) == 1 and not store.reads[0].done()
    assert w.has_work, "the oracle request behind the read is ready, the PE must not idle"
    assert _prefilled(w.run_next()) == [2]
    assert w.held_requests() == (1,)
    assert not w.has_work  # only the request still reading is left
    store.finish()
    assert w.has_work


def test_requests_are_computed_in_placement_order(worker):
    """A DE-path request reaches the PE only once its DE buffer is filled: it takes the place
    the router gave it (its wire id), ahead of requests placed after it."""
    w, _ = worker
    for req_id in (4, 7, 5):
        w.accept(_prefill(req_id))
    assert w.held_requests() == (4, 5, 7)
    order = []
    while w.has_work:
        order += _prefilled(w.run_next())
    assert order == [4, 5, 7]


def test_a_request_being_chunked_goes_on_before_an_older_one_whose_read_ended(tiny_llama_dir):
    """The PE cache holds one prompt. The oracle request starts (chunked: 20 tokens a forward)
    while the older one still reads; when that read ends, the chunked one must finish first,
    or the older one finds no cache room and fails."""
    engine = LLMEngine(tiny_llama_dir, EngineConfig(dtype="float32", block_size=BLOCK,
                                                    num_kv_blocks=4))
    store = GatedStore()
    pool = HostPool(engine.layout.full_block_bytes, 8, pin=False)
    w = PrefillWorker(engine, pool, TrafficManager(None), store,  # type: ignore[arg-type]
                      cost_model=AttentionCostModel(a=0.0, b=1.0), quota_ms=20.0)
    w.accept(_prefill(1, mode="layerwise", read_path="pe", num_hit_blocks=2))
    w.accept(_prefill(2))
    assert w.run_next() == []  # the first 20 of request 2's 35 tokens
    store.finish()
    out = w.run_next()
    assert not [m for m in out if isinstance(m, Failed)], out
    assert _prefilled(out) == [2] and w.held_requests() == (1,)
