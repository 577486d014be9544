"""Conditional disaggregation on a decode engine: a local ``Decode`` copies only the hit blocks
its buffer read, prefills the rest of the prompt in its own decode steps, samples the first
token itself and streams the whole output — the tokens a single engine generates for the
prompt, whether the hit came from storage, from nothing, or from fewer blocks than asked."""

from __future__ import annotations

import time

import pytest

from dualpath.config import EngineConfig
from dualpath.engine.decode import DecodeWorker
from dualpath.engine.llm_engine import LLMEngine
from dualpath.kv.host_pool import HostPool
from dualpath.protocol import (
    Abort,
    AllocBuffer,
    BufferReady,
    Decode,
    Failed,
    Finished,
    Message,
    Tokens,
)
from dualpath.request import SamplingParams
from dualpath.storage.client import StorageClient
from dualpath.storage.memory import MemoryStore
from dualpath.traffic.manager import TrafficManager

BLOCK = 16
PROMPT = tuple(range(10, 10 + 3 * BLOCK + 5))  # three full blocks and a partial one
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


def _engine(model_dir) -> LLMEngine:
    return LLMEngine(model_dir, EngineConfig(dtype="float32", block_size=BLOCK,
                                             num_kv_blocks=32))


@pytest.fixture(scope="module")
def store(tiny_llama_dir) -> MemoryStore:
    return MemoryStore(_engine(tiny_llama_dir).layout.full_block_bytes)


def _worker(model_dir, store: MemoryStore) -> DecodeWorker:
    engine = _engine(model_dir)
    pool = HostPool(engine.layout.full_block_bytes, 12, pin=False)
    return DecodeWorker(engine, pool, TrafficManager(None), StorageClient(store, BLOCK),
                        staging_blocks=4)


def _until(worker: DecodeWorker, want: type, timeout_s: float = 60.0) -> list[Message]:
    """Run the worker (its storage threads report in ``work``) until a ``want`` comes."""
    out: list[Message] = []
    deadline = time.monotonic() + timeout_s
    while not any(isinstance(m, want) for m in out):
        assert time.monotonic() < deadline, f"no {want.__name__} in {timeout_s} s: {out}"
        out += worker.work()
        time.sleep(0.001)
    return out


def _streamed(messages: list[Message], req_id: int) -> list[int]:
    tokens: list[int] = []
    for msg in messages:
        if isinstance(msg, Tokens):
            for rid, first, items in msg.items:
                if rid == req_id:
                    assert first == len(tokens), "a gap or a repeat in the stream"
                    tokens.extend(items)
    return tokens


def _serve_locally(worker: DecodeWorker, req_id: int, num_read_blocks: int,
                   num_stored: int | None = None) -> tuple[BufferReady, list[int], Finished]:
    out = worker.handle(AllocBuffer(req_id, PROMPT, -(-len(PROMPT) // BLOCK), num_read_blocks,
                                    local=True))
    if not any(isinstance(m, BufferReady) for m in out):
        out = _until(worker, BufferReady)
    ready = next(m for m in out if isinstance(m, BufferReady))
    stored = ready.num_loaded_blocks if num_stored is None else num_stored
    out = worker.handle(Decode(req_id, 0, stored, PARAMS, local=True))
    out += _until(worker, Finished)
    done = next(m for m in out if isinstance(m, Finished))
    return ready, _streamed(out, req_id), done


def test_a_local_prefill_from_nothing_then_from_the_blocks_it_stored_gives_the_same_tokens(
        tiny_llama_dir, store):
    want = _engine(tiny_llama_dir).generate([list(PROMPT)], PARAMS)[0].output_ids
    first = _worker(tiny_llama_dir, store)
    ready, streamed, done = _serve_locally(first, 1, num_read_blocks=0)
    assert ready.num_loaded_blocks == 0
    assert list(done.output_ids) == want and streamed == want  # it streamed the first token too
    assert first.num_saved_blocks >= 3  # its prompt's full blocks are in storage now
    second = _worker(tiny_llama_dir, store)  # another engine: its hit comes from storage
    ready, streamed, done = _serve_locally(second, 2, num_read_blocks=3)
    assert ready.num_loaded_blocks == 3
    assert list(done.output_ids) == want and streamed == want
    # fewer blocks than were read count: the engine computes the rest, same tokens
    _, _, done = _serve_locally(_worker(tiny_llama_dir, store), 3, num_read_blocks=3,
                                num_stored=1)
    assert list(done.output_ids) == want
    assert second.held_requests() == () and second.free_kv_blocks == 32
    assert second.host_pool.num_free == 12


def test_a_local_decode_with_no_token_to_compute_or_prior_outputs_is_refused(tiny_llama_dir,
                                                                              store):
    worker = _worker(tiny_llama_dir, store)
    worker.handle(AllocBuffer(1, PROMPT[: 2 * BLOCK], 2, 0))
    (failed,) = worker.handle(Decode(1, 0, 2, PARAMS, local=True))
    assert isinstance(failed, Failed) and "local prefill" in failed.error
    worker.handle(AllocBuffer(2, PROMPT, 4, 0))
    (failed,) = worker.handle(Decode(2, 0, 0, PARAMS, local=True, num_prior_outputs=2))
    assert isinstance(failed, Failed)


def test_a_local_turn_takes_the_blocks_its_engine_still_holds_and_reads_none(tiny_llama_dir):
    """The engine that served the prompt before still has its blocks in its prefix cache:
    the next local turn takes them from there (its store is empty: nothing to read) and
    generates the same tokens; an aborted local allocation gives its blocks back."""
    want = _engine(tiny_llama_dir).generate([list(PROMPT)], PARAMS)[0].output_ids
    worker = _worker(tiny_llama_dir, MemoryStore(_engine(tiny_llama_dir).layout
                                                 .full_block_bytes))
    _serve_locally(worker, 1, num_read_blocks=0)
    store = worker.storage.backend
    assert store.delete(list(store.stored_keys())) >= 3  # nothing left to read
    ready, streamed, done = _serve_locally(worker, 2, num_read_blocks=3)
    assert ready.num_loaded_blocks == 3 and worker.num_cached_hit_blocks == 3
    assert list(done.output_ids) == want and streamed == want
    worker.handle(AllocBuffer(3, PROMPT, 4, 3, local=True))
    assert worker.free_kv_blocks < 32  # its three blocks are held for it
    worker.handle(Abort(3))
    assert worker.free_kv_blocks == 32 and worker.held_requests() == ()
