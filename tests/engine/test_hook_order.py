"""Hook order of layerwise prefill: proof that KV moves per layer, around each layer's compute.

A real forward of a tiny random model runs with ``PrefillHooks`` on a traffic manager that logs
every KV move, and torch hooks on the decoder layer modules log when each layer computes (not
``PrefillHooks``'s own calls). In ``layerwise`` mode (PAPER §2.1, DESIGN §3) layer i's hit KV
must be resident before layer i computes, layer i+1's load must already be on its way while
layer i computes (and not layer i+2's), and layer i's KV must leave after layer i and before
layer i+1. ``basic`` loads every layer before the forward and sends every layer after it.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from dualpath.config import EngineConfig, TrafficConfig
from dualpath.engine.layerwise import CacheAddresses, LayerPlan, PrefillHooks
from dualpath.engine.llm_engine import LLMEngine
from dualpath.engine.traffic import CopyDirection, TrafficManager, TransferKind
from dualpath.kv.host_pool import HostPool
from dualpath.request import SamplingParams
from dualpath.request import Sequence as Seq
from dualpath.transfer.base import Segment, TransferBackend
from dualpath.transfer.lanes import Lane

BLOCK = 16
NUM_HIT = 2  # leading prompt blocks whose KV is loaded (the cache hit)
NUM_BLOCKS = 4  # prompt blocks: 2 hit, 1 full miss, 1 partial miss
PROMPT_LEN = (NUM_BLOCKS - 1) * BLOCK + 7
DE_ENDPOINT = "recording-de"


class EventLog:
    """``(event, layer)`` in the order they happened, from any thread."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def add(self, event: str, layer: int) -> None:
        with self._lock:
            self.events.append((event, layer))

    def first(self, event: str, layer: int) -> int:
        """Position of the first ``(event, layer)``; fails the test if there is none."""
        hits = self._positions(event, layer)
        assert hits, f"no {event} of layer {layer} in {self.events}"
        return hits[0]

    def last(self, event: str, layer: int) -> int:
        """Position of the last ``(event, layer)``; fails the test if there is none."""
        hits = self._positions(event, layer)
        assert hits, f"no {event} of layer {layer} in {self.events}"
        return hits[-1]

    def _positions(self, event: str, layer: int) -> list[int]:
        return [i for i, e in enumerate(self.events) if e == (event, layer)]


class LayerMap:
    """Addresses → (layer, prompt block), by inverting the code's own address arithmetic.

    ``CacheAddresses.layer_block`` and ``LayerPlan.de_layer_block`` of every layer and prompt
    block, so a segment that is not made of whole layer blocks of this request fails the test.
    """

    def __init__(self, addrs: CacheAddresses, plan: LayerPlan, num_layers: int) -> None:
        self.plan = plan
        self.lb = lb = addrs.layer_block_bytes
        layers = range(num_layers)
        self._cache = {addrs.layer_block(i, b): (i, j)
                       for i in layers for j, b in enumerate(plan.pe_blocks)}
        self._de = {plan.de_layer_block(i, j, lb): (i, j)
                    for i in layers for j in range(len(plan.pe_blocks))}

    def cache_blocks(self, address: int, nbytes: int) -> set[tuple[int, int]]:
        """(layer, prompt block) of the PE-cache layer blocks ``[address, +nbytes)`` covers."""
        return self._blocks(self._cache, address, nbytes, "PE cache")

    def segment(self, seg: Segment) -> set[tuple[int, int]]:
        """(layer, prompt block) of a PE-cache ↔ DE-buffer segment; both sides must agree."""
        local, remote, nbytes = seg
        pe = self.cache_blocks(local, nbytes)
        de = self._blocks(self._de, remote, nbytes, "DE buffer")
        assert pe == de, f"segment {seg}: PE side {sorted(pe)} != DE side {sorted(de)}"
        return pe

    def _blocks(self, where: dict[int, tuple[int, int]], address: int, nbytes: int,
                side: str) -> set[tuple[int, int]]:
        assert nbytes > 0 and nbytes % self.lb == 0, f"{side}: {nbytes} bytes"
        starts = range(address, address + nbytes, self.lb)
        assert all(a in where for a in starts), f"{side}: {address:#x}+{nbytes} off the blocks"
        return {where[a] for a in starts}


class RecordingBackend(TransferBackend):
    """A fake peer link in one process: ``memmove``s each segment, then reports the call."""

    endpoint = "recording-pe"

    def __init__(self, on_moved: Callable[[str, Sequence[Segment]], None]) -> None:
        self.on_moved = on_moved

    def register(self, address: int, nbytes: int) -> None:
        pass

    def write(self, peer: str, segments: Sequence[Segment]) -> None:
        for local, remote, nbytes in segments:
            ctypes.memmove(remote, local, nbytes)
        self.on_moved("write", segments)

    def read(self, peer: str, segments: Sequence[Segment]) -> None:
        for local, remote, nbytes in segments:
            ctypes.memmove(local, remote, nbytes)
        self.on_moved("read", segments)

    def close(self) -> None:
        pass


class RecordingTraffic(TrafficManager):
    """A real traffic manager that logs each KV load and send by layer.

    ``load_issued``/``send_issued``: when ``submit`` is called. ``load_done``: when the backend
    has moved the last byte of a layer's load (before its future completes, so a waiter that
    wakes always comes after it in the log); for a host → device ``copy`` (PE read path), the
    copy call itself.
    """

    def __init__(self, log: EventLog, layers: LayerMap) -> None:
        self.log = log
        self.layers = layers
        self.blocks: dict[tuple[str, int], set[int]] = {}  # (load|send, layer) -> prompt blocks
        self._pending: dict[int, int] = {}  # layer -> load bytes submitted, not yet moved
        self._pending_lock = threading.Lock()
        super().__init__(RecordingBackend(self._moved), TrafficConfig())

    def submit(self, kind: TransferKind, peer: str, segments: Sequence[Segment],
               lane: Lane) -> Future[None]:
        assert peer == DE_ENDPOINT
        touched = set().union(*(self.layers.segment(s) for s in segments))
        (layer,) = {layer for layer, _ in touched}  # one submission moves one layer
        what = "load" if kind == "read" else "send"
        assert lane is (Lane.KV_LOAD if what == "load" else Lane.KV_FORWARD)
        self.blocks.setdefault((what, layer), set()).update(j for _, j in touched)
        if what == "load":
            with self._pending_lock:
                self._pending[layer] = self._pending.get(layer, 0) + sum(s[2] for s in segments)
        self.log.add(f"{what}_issued", layer)
        return super().submit(kind, peer, segments, lane)

    def copy(self, dst: Any, src: Any, lane: Lane, direction: CopyDirection | None = None) -> int:
        if lane is not Lane.KV_LOAD:
            return super().copy(dst, src, lane, direction)
        touched = self.layers.cache_blocks(dst.data_ptr(), dst.nbytes)
        (layer,) = {layer for layer, _ in touched}
        self.blocks.setdefault(("load", layer), set()).update(j for _, j in touched)
        self.log.add("load_issued", layer)
        nbytes = super().copy(dst, src, lane, direction)
        self.log.add("load_done", layer)
        return nbytes

    def _moved(self, kind: str, segments: Sequence[Segment]) -> None:
        if kind != "read":
            return
        for seg in segments:
            (layer,) = {layer for layer, _ in self.layers.segment(seg)}
            with self._pending_lock:
                self._pending[layer] -= seg[2]
                done = self._pending[layer] == 0
            if done:
                self.log.add("load_done", layer)


@contextmanager
def compute_events(model: torch.nn.Module, log: EventLog) -> Iterator[None]:
    """Log ``compute_start``/``compute_end`` of each decoder layer module's forward."""
    handles = []
    for i, layer in enumerate(model.model.layers):
        handles.append(layer.register_forward_pre_hook(
            lambda _m, _a, i=i: log.add("compute_start", i)))
        handles.append(layer.register_forward_hook(
            lambda _m, _a, _o, i=i: log.add("compute_end", i)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class Run:
    """What one recorded prefill forward did."""

    log: EventLog
    plan: LayerPlan
    num_layers: int
    blocks: dict[tuple[str, int], set[int]] = field(default_factory=dict)


@pytest.fixture(scope="module")
def engine(tiny_chaotic_dir) -> LLMEngine:
    return LLMEngine(tiny_chaotic_dir, EngineConfig(dtype="float32", block_size=BLOCK,
                                                    num_kv_blocks=NUM_BLOCKS + 2))


def _random_kv(nbytes: int, seed: int) -> torch.Tensor:
    """Finite float32 KV as bytes (random bytes could be NaN)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(nbytes // 4, generator=g).view(torch.uint8)


def _prefill(engine: LLMEngine, mode: str, read_path: str) -> Run:
    """One real prefill forward of the miss tokens, with the hit KV in a PE slot or DE buffer."""
    cache = engine.runner.cache
    addrs = CacheAddresses(cache)
    num_layers = cache.data.shape[0]
    pe_blocks = [1, 2, 3, 4]  # not 0, so a block index mix-up shows
    de_buffer = _random_kv(num_layers * NUM_BLOCKS * addrs.layer_block_bytes, seed=1)
    pool = HostPool(engine.layout.full_block_bytes, NUM_HIT, pin=False)
    slots = pool.alloc(NUM_HIT) if read_path == "pe" else []
    for k, slot in enumerate(slots):
        pool.tensor(slot).copy_(_random_kv(engine.layout.full_block_bytes, seed=10 + k))
    plan = LayerPlan(pe_blocks, NUM_HIT, read_path, mode, DE_ENDPOINT, de_buffer.data_ptr(),
                     slots)
    seq = Seq(list(range(1, PROMPT_LEN + 1)), SamplingParams(max_tokens=1, ignore_eos=True))
    seq.block_table = pe_blocks
    seq.num_computed_tokens = NUM_HIT * BLOCK
    log = EventLog()
    with RecordingTraffic(log, LayerMap(addrs, plan, num_layers)) as traffic:
        hooks = PrefillHooks(plan, cache, traffic, pool)
        inputs = engine.runner.prepare([(seq, PROMPT_LEN - NUM_HIT * BLOCK)])
        with compute_events(engine.runner.model, log):
            hidden = engine.runner.run(inputs, hooks)
    assert torch.isfinite(hidden).all()
    _assert_bytes_landed(engine, plan, de_buffer, pool)
    return Run(log, plan, num_layers, traffic.blocks)


def _assert_bytes_landed(engine: LLMEngine, plan: LayerPlan, de_buffer: torch.Tensor,
                         pool: HostPool) -> None:
    """The hit KV is in the PE cache and the forwarded blocks are in the DE buffer."""
    data = engine.runner.cache.data.view(torch.uint8)
    num_layers = data.shape[0]
    de = de_buffer.view(num_layers, NUM_BLOCKS, -1)
    for j in range(NUM_HIT):
        cached = data[:, plan.pe_blocks[j]].reshape(num_layers, -1)
        source = (pool.tensor(plan.pe_slots[j]).view(num_layers, -1) if plan.read_path == "pe"
                  else de[:, j])
        assert torch.equal(cached, source), f"hit block {j} not loaded"
    for j in plan.forward_range():
        assert torch.equal(data[:, plan.pe_blocks[j]].reshape(num_layers, -1), de[:, j])


def _assert_every_layer_moved(run: Run) -> None:
    """Each layer loaded exactly the hit blocks and sent exactly the forward range."""
    for i in range(run.num_layers):
        assert run.blocks[("load", i)] == set(range(NUM_HIT))
        assert run.blocks[("send", i)] == set(run.plan.forward_range())


READ_PATHS = ["pe", "de"]


@pytest.fixture(scope="module", params=READ_PATHS)
def layerwise(request, engine) -> Run:
    run = _prefill(engine, "layerwise", request.param)
    _assert_every_layer_moved(run)
    return run


def test_layerwise_loads_each_layers_hit_kv_before_that_layer_computes(layerwise):
    log = layerwise.log
    for i in range(layerwise.num_layers):
        assert log.last("load_done", i) < log.first("compute_start", i), (
            f"layer {i} computes before its hit KV is loaded: {log.events}")


def test_layerwise_issues_the_next_layers_load_before_a_layer_ends(layerwise):
    log = layerwise.log
    for i in range(layerwise.num_layers - 1):
        assert log.first("load_issued", i + 1) < log.first("compute_end", i), (
            f"layer {i + 1}'s load is not issued before layer {i} ends (no prefetch): "
            f"{log.events}")


def test_layerwise_loads_no_layer_two_ahead_of_the_one_computing(layerwise):
    log = layerwise.log
    for i in range(layerwise.num_layers - 2):  # a window of two layers, not all up front
        assert log.first("load_issued", i + 2) > log.first("compute_end", i), (
            f"layer {i + 2}'s load is issued before layer {i} ends: {log.events}")


def test_layerwise_sends_each_layer_after_it_ends_and_before_the_next_starts(layerwise):
    log, num_layers = layerwise.log, layerwise.num_layers
    for i in range(num_layers):
        sent = log.first("send_issued", i)
        assert sent > log.first("compute_end", i), (
            f"layer {i}'s KV is sent before layer {i} ends: {log.events}")
        if i + 1 < num_layers:
            assert sent < log.first("compute_start", i + 1), (
                f"layer {i}'s KV is sent after layer {i + 1} starts: {log.events}")


@pytest.mark.parametrize("read_path", READ_PATHS)
def test_basic_loads_every_layer_before_layer_0_and_sends_after_the_last(engine, read_path):
    run = _prefill(engine, "basic", read_path)
    _assert_every_layer_moved(run)
    log, last = run.log, run.num_layers - 1
    for i in range(run.num_layers):
        assert log.last("load_done", i) < log.first("compute_start", 0), (
            f"layer {i}'s hit KV is not loaded before layer 0 computes: {log.events}")
        assert log.first("send_issued", i) > log.first("compute_end", last), (
            f"layer {i}'s KV is sent before the last layer ends: {log.events}")
