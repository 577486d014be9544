"""The engines' side of write fences and liveness, on real workers with an in-process transfer
backend: a DE keeps a fenced buffer out of its pool until ``Unfence`` (no timer frees it); a
prefill forward stops sending the moment its engine is dropped and answers only once what it
sent has settled; without a cost model a prompt is computed in chunks of
``max_num_batched_tokens``; a vLLM call that has received nothing is work not moving."""

from __future__ import annotations

import time

import pytest

from dualpath.config import EngineConfig, TrafficConfig
from dualpath.engine.decode import DecodeWorker
from dualpath.engine.llm_engine import LLMEngine
from dualpath.engine.prefill import PrefillWorker
from dualpath.integrations.vllm.engines.prefill import PRIOR_S_PER_TOKEN, VllmPrefillWorker
from dualpath.kv.host_pool import HostPool
from dualpath.protocol import Abort, Aborted, AllocBuffer, BufferReady, Failed, Prefill, Unfence
from dualpath.request import SamplingParams
from dualpath.storage.client import StorageClient
from dualpath.storage.memory import MemoryStore
from dualpath.traffic.manager import TrafficManager
from dualpath.transfer.local import LocalBackend

BLOCK = 16
PROMPT = tuple(range(10, 10 + 5 * BLOCK + 3))  # 6 blocks


def engine_of(model_dir, **overrides) -> LLMEngine:
    config = dict(dtype="float32", block_size=BLOCK, num_kv_blocks=32)
    return LLMEngine(model_dir, EngineConfig(**{**config, **overrides}))


class Pair:
    """A prefill and a decode worker whose traffic managers reach each other in-process."""

    def __init__(self, model_dir, pe_traffic: TrafficConfig | None = None,
                 **prefill_config) -> None:
        self.pe_engine = engine_of(model_dir, **prefill_config)
        self.de_engine = engine_of(model_dir)
        layout = self.de_engine.layout
        self.pe_backend, self.de_backend = LocalBackend(), LocalBackend()
        self.pe = PrefillWorker(self.pe_engine, HostPool(layout.full_block_bytes, 8, pin=False),
                                TrafficManager(self.pe_backend, pe_traffic),
                                self._storage(layout))
        self.de = DecodeWorker(self.de_engine, HostPool(layout.full_block_bytes, 8, pin=False),
                               TrafficManager(self.de_backend), self._storage(layout))
        cache = self.pe_engine.runner.cache.data
        self.pe_backend.register(cache.data_ptr(), cache.numel() * cache.element_size())
        self.de_backend.register(self.de.host_pool.base_address, self.de.host_pool.nbytes)

    @staticmethod
    def _storage(layout) -> StorageClient:
        return StorageClient(MemoryStore(layout.full_block_bytes), BLOCK)

    def buffer(self, req_id: int) -> BufferReady:
        (ready,) = self.de.handle(AllocBuffer(req_id, PROMPT, -(-len(PROMPT) // BLOCK), 0))
        assert isinstance(ready, BufferReady)
        return ready

    def prefill(self, ready: BufferReady) -> Prefill:
        return Prefill(ready.req_id, PROMPT, 0, "pe", self.de_backend.endpoint,
                       ready.buffer_addr, params=SamplingParams(max_tokens=2))


def test_a_fenced_buffer_stays_out_of_the_pool_until_unfenced(tiny_llama_dir):
    pair = Pair(tiny_llama_dir)
    de, slots = pair.de, pair.de.host_pool.num_slots
    pair.buffer(1)
    assert de.handle(Abort(1, fenced=True)) == [Aborted(1)]
    assert de.fenced_requests() == (1,) and de.held_requests() == ()
    waiting = AllocBuffer(2, PROMPT, 6, 0)  # needs the room the fenced buffer holds
    assert de.handle(waiting) == []
    time.sleep(0.2)
    assert de.work() == [] and de.host_pool.num_free == slots - 6  # no timer frees it
    (ready,) = de.handle(Unfence((1,)))
    assert isinstance(ready, BufferReady) and ready.req_id == 2
    de.handle(Abort(2))  # not fenced: back to the pool at once
    assert de.host_pool.num_free == slots and de.fenced_requests() == ()


@pytest.mark.parametrize("group_bytes", [0, TrafficConfig().layer_group_bytes])
def test_a_dropped_prefill_engine_stops_sending_at_the_next_layer(tiny_llama_dir, group_bytes):
    """The engine is dropped after layer 0. Layer by layer: layer 0's KV went out, nothing
    after it. In groups (the tiny model's layers make one): the group never ended, so nothing
    went out. The request fails only once what was sent has settled."""
    pair = Pair(tiny_llama_dir, TrafficConfig(layer_group_bytes=group_bytes))
    ready = pair.buffer(1)
    layers_done = []
    pair.pe.abandon = lambda: len(layers_done) > 0  # dropped once layer 0 has computed
    original = pair.pe._hooks

    def watched(job, bsz):
        hooks = original(job, bsz)
        forward = hooks.after_layer
        hooks.after_layer = lambda i: (forward(i), layers_done.append(i))
        return hooks

    pair.pe._hooks = watched
    buffer = pair.de.host_pool.region(pair.de.buffers.slots[1][0], 6)
    buffer[:] = 0
    pair.pe.handle(pair.prefill(ready))
    (failed,) = pair.pe.work()
    assert isinstance(failed, Failed) and "dropped this engine" in failed.error
    assert layers_done == [0] and pair.pe.held_requests() == ()
    layer_bytes = pair.de.layout.layer_block_bytes * 6 if group_bytes == 0 else 0
    assert bool(buffer[:layer_bytes].any()) == (group_bytes == 0)
    assert not buffer[layer_bytes:].any()
    assert pair.pe.free_kv_blocks == 32 and pair.pe.settled()


def test_without_a_cost_model_a_prompt_is_prefilled_in_chunks(tiny_llama_dir):
    pair = Pair(tiny_llama_dir, max_num_batched_tokens=2 * BLOCK + 5)  # chunks of 2 blocks
    ready = pair.buffer(1)
    pair.pe.handle(pair.prefill(ready))
    forwards = 0
    while pair.pe.held_requests():
        out = pair.pe.work()
        forwards += 1
    assert forwards == 3 and pair.pe.metrics()["num_chunks"] == 3
    assert out[-1].first_token == engine_of(tiny_llama_dir).generate(
        [list(PROMPT)], SamplingParams(max_tokens=1))[0].output_ids[0]


def test_without_a_cost_model_short_prompts_share_a_forward_within_the_token_budget(
        tiny_llama_dir):
    """Three 19-token prompts under a 45-token budget: the first two share a forward, the
    third (which would make 57) takes the next; each gets its own first token."""
    pair = Pair(tiny_llama_dir, max_num_batched_tokens=45)
    prompts = {req_id: tuple(range(7 * req_id, 7 * req_id + BLOCK + 3)) for req_id in (1, 2, 3)}
    for req_id, prompt in prompts.items():
        (ready,) = pair.de.handle(AllocBuffer(req_id, prompt, 2, 0))
        pair.pe.handle(Prefill(req_id, prompt, 0, "pe", pair.de_backend.endpoint,
                               ready.buffer_addr, params=SamplingParams(max_tokens=2)))
    firsts = {}
    while pair.pe.held_requests():
        firsts.update({m.req_id: m.first_token for m in pair.pe.work()
                       if hasattr(m, "first_token")})
    metrics = pair.pe.metrics()
    assert metrics["num_prefilled"] == 3 and metrics["num_forwards"] == 2
    reference = engine_of(tiny_llama_dir).generate([list(p) for p in prompts.values()],
                                                   SamplingParams(max_tokens=1))
    assert firsts == {r: out.output_ids[0] for r, out in zip(prompts, reference, strict=True)}


def test_a_vllm_call_that_has_received_nothing_is_work_not_moving():
    worker = VllmPrefillWorker.__new__(VllmPrefillWorker)
    worker._calls, worker._s_per_token = {}, None
    now = time.monotonic()
    progress_s, budget_s = worker.liveness()
    assert progress_s >= now and budget_s == 0.0  # nothing in flight: nothing is late
    from types import SimpleNamespace

    msg = SimpleNamespace(prompt_ids=(1,) * 1000)
    worker._calls = {1: SimpleNamespace(msg=msg, started_s=now - 30),
                     2: SimpleNamespace(msg=SimpleNamespace(prompt_ids=(1,)), started_s=now)}
    assert worker.liveness() == (now - 30, pytest.approx(1000 * PRIOR_S_PER_TOKEN))
    worker._timed(2.0, 1000)  # a finished call's pace: 2 ms a token
    assert worker.liveness()[1] == pytest.approx(2.0)
