"""Hook order of layerwise prefill: proof that KV moves per layer, overlapped with each layer's
compute, inside a window of device memory.

A real forward of a tiny random 6-layer model runs with ``PrefillHooks`` on a traffic manager
that logs every KV move, and torch hooks on the decoder layer modules log when each layer
computes (not ``PrefillHooks``'s own calls). In ``layerwise`` mode (docs/paper.md §2.1,
docs/design.md §3, §9):

- layer i's context KV is resident before layer i computes;
- layer i+1's load is *in flight while layer i computes*: the test's transfer backend holds
  that load until layer i has started, so a load done before the compute (a blocking prefetch)
  never completes in time and fails the test;
- no load runs two layers ahead (the window holds two layers);
- layer i's KV leaves after layer i and before layer i+1 starts;
- with a 2-layer window, layer j reuses layer j-2's slot only after layer j-2 has left: sends
  are slowed down and the bytes that reach the DE buffer must equal a run that keeps every
  layer resident (same hidden states, so the same greedy tokens).

``basic`` loads every layer before the forward and sends every layer after it.
"""

from __future__ import annotations

import ctypes
import threading
import time
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
from dualpath.kv.host_pool import HostPool
from dualpath.request import SamplingParams
from dualpath.request import Sequence as Seq
from dualpath.traffic.lanes import Lane
from dualpath.traffic.manager import CopyDirection, TrafficManager, TransferKind
from dualpath.transfer.base import Segment, TransferBackend

BLOCK = 16
NUM_HIT = 2  # leading prompt blocks whose KV is loaded (the cache hit)
NUM_BLOCKS = 4  # prompt blocks: 2 hit, 1 full miss, 1 partial miss
PROMPT_LEN = (NUM_BLOCKS - 1) * BLOCK + 7
DE_ENDPOINT = "recording-de"
GATE_S = 3.0  # how long a held load waits for the layer before it to start computing
SLOW_SEND_S = 0.02  # a send's duration when sends are slowed down


class EventLog:
    """``(event, layer)`` in the order they happened, from any thread."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)

    def add(self, event: str, layer: int) -> None:
        with self._lock:
            self.events.append((event, layer))
            self._changed.notify_all()

    def wait_for(self, event: str, layer: int, timeout_s: float) -> bool:
        """Block until ``(event, layer)`` is logged; False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: (event, layer) in self.events, timeout_s)

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

    def count(self, event: str) -> int:
        return sum(1 for e, _ in self.events if e == event)

    def _positions(self, event: str, layer: int) -> list[int]:
        return [i for i, e in enumerate(self.events) if e == (event, layer)]


class LayerMap:
    """Addresses → (layer, prompt block), by inverting the code's own address arithmetic.

    The DE buffer and the PE host slots hold every layer at its own address, so they name the
    layer; the PE-cache side of each move must be where ``CacheAddresses`` puts that layer's
    block (with a window, layers i and i+W share an address).
    """

    def __init__(self, addrs: CacheAddresses, plan: LayerPlan, num_layers: int,
                 pool: HostPool) -> None:
        self.addrs, self.plan = addrs, plan
        self.lb = lb = addrs.layer_block_bytes
        layers = range(num_layers)
        self._de = {plan.de_layer_block(i, j, lb): (i, j)
                    for i in layers for j in range(len(plan.pe_blocks))}
        self._host = {pool.tensor(slot).data_ptr() + i * lb: (i, j)
                      for i in layers for j, slot in enumerate(plan.pe_slots)}

    def segment(self, seg: Segment) -> set[tuple[int, int]]:
        """(layer, prompt block) of a PE-cache ↔ DE-buffer segment; both sides must agree."""
        local, remote, nbytes = seg
        de = self._blocks(self._de, remote, nbytes, "DE buffer")
        self._check_cache(local, nbytes, de)
        return de

    def host_copy(self, dst: int, src: int, nbytes: int) -> set[tuple[int, int]]:
        """(layer, prompt block) of a PE host slot → PE cache copy."""
        host = self._blocks(self._host, src, nbytes, "PE host buffer")
        self._check_cache(dst, nbytes, host)
        return host

    def _check_cache(self, address: int, nbytes: int, blocks: set[tuple[int, int]]) -> None:
        expect = sorted(self.addrs.layer_block(i, self.plan.pe_blocks[j]) for i, j in blocks)
        got = list(range(address, address + nbytes, self.lb))
        assert got == expect, f"PE cache side {address:#x}+{nbytes} is not layer blocks {blocks}"

    def _blocks(self, where: dict[int, tuple[int, int]], address: int, nbytes: int,
                side: str) -> set[tuple[int, int]]:
        assert nbytes > 0 and nbytes % self.lb == 0, f"{side}: {nbytes} bytes"
        starts = range(address, address + nbytes, self.lb)
        assert all(a in where for a in starts), f"{side}: {address:#x}+{nbytes} off the blocks"
        return {where[a] for a in starts}


class RecordingBackend(TransferBackend):
    """A fake peer link in one process: ``memmove``s each segment, then reports the call."""

    endpoint = "recording-pe"

    def __init__(self, on_start: Callable[[str, Sequence[Segment]], None],
                 on_moved: Callable[[str, Sequence[Segment]], None], send_s: float) -> None:
        self.on_start, self.on_moved, self.send_s = on_start, on_moved, send_s

    def register(self, address: int, nbytes: int) -> None:
        pass

    def write(self, peer: str, segments: Sequence[Segment]) -> None:
        self.on_start("write", segments)
        if self.send_s:
            time.sleep(self.send_s)  # a slow link, so a slot reused too early shows
        for local, remote, nbytes in segments:
            ctypes.memmove(remote, local, nbytes)
        self.on_moved("write", segments)

    def read(self, peer: str, segments: Sequence[Segment]) -> None:
        self.on_start("read", segments)
        for local, remote, nbytes in segments:
            ctypes.memmove(local, remote, nbytes)
        self.on_moved("read", segments)

    def close(self) -> None:
        pass


class RecordingTraffic(TrafficManager):
    """A real traffic manager that logs each KV load and send by layer.

    ``load_issued``/``send_issued``: when the hooks call ``submit``/``submit_copies``;
    ``load_done``/``send_done``: when a layer's last byte has moved, logged before the future
    the hooks wait on completes. With ``gate`` on, the load of layer i+1 cannot complete before
    layer i has started computing (``gate_timeout`` is logged when that never happens).
    """

    def __init__(self, log: EventLog, layers: LayerMap, gate: bool, send_s: float) -> None:
        self.log, self.layers, self.gate = log, layers, gate
        self.blocks: dict[tuple[str, int], set[int]] = {}  # (load|send, layer) -> prompt blocks
        self.submissions: dict[str, int] = {"load": 0, "send": 0}  # calls, not layers
        self._pending: dict[tuple[str, int], int] = {}  # bytes submitted, not yet moved
        self._lock = threading.Lock()
        super().__init__(RecordingBackend(self._started, self._moved, send_s), TrafficConfig())

    def submit(self, kind: TransferKind, peer: str, segments: Sequence[Segment], lane: Lane,
               after: Future[None] | None = None) -> Future[None]:
        assert peer == DE_ENDPOINT
        touched = set().union(*(self.layers.segment(s) for s in segments))
        what = "load" if kind == "read" else "send"
        assert lane is (Lane.KV_LOAD if what == "load" else Lane.KV_FORWARD)
        self._issue(what, touched, per_block=True)
        if what == "load":
            after = _both(after, self._gate(min(layer for layer, _ in touched)))
        return super().submit(kind, peer, segments, lane, after=after)

    def submit_copies(self, pairs: Sequence[tuple[Any, Any]], lane: Lane,
                      direction: CopyDirection | None = None,
                      after: Future[None] | None = None) -> Future[None]:
        if lane is not Lane.KV_LOAD:
            return super().submit_copies(pairs, lane, direction, after=after)
        rows = [(d, s) for dst, src in pairs  # a run of blocks is [blocks, layer block bytes]
                for d, s in (zip(dst, src, strict=True) if dst.dim() > 1 else [(dst, src)])]
        touched = set().union(*(self.layers.host_copy(dst.data_ptr(), src.data_ptr(), dst.nbytes)
                                for dst, src in rows))
        layers = sorted({layer for layer, _ in touched})
        self._issue("load", touched, per_block=False)
        inner = super().submit_copies(pairs, lane, direction,
                                      after=_both(after, self._gate(layers[0])))
        return _then(inner, lambda: [self._copied(layer) for layer in layers])

    def _issue(self, what: str, touched: set[tuple[int, int]], per_block: bool) -> None:
        """Log one submission of the ``touched`` (layer, prompt block)s, which may span
        layers; each layer is pending until its bytes moved (``per_block``) or, for host
        copies, until the submission's copies are done."""
        layers = sorted({layer for layer, _ in touched})
        with self._lock:
            self.submissions[what] += 1
            for layer in layers:
                blocks = {j for i, j in touched if i == layer}
                self.blocks.setdefault((what, layer), set()).update(blocks)
                key = (what, layer)
                self._pending[key] = self._pending.get(key, 0) + (
                    len(blocks) * self.layers.lb if per_block else 1)
        for layer in layers:
            self.log.add(f"{what}_issued", layer)

    def _gate(self, layer: int) -> Future[None] | None:
        """Completes once layer ``layer - 1`` has started computing (or after ``GATE_S``)."""
        if not self.gate or layer == 0:
            return None
        gate: Future[None] = Future()

        def open_gate() -> None:
            if not self.log.wait_for("compute_start", layer - 1, GATE_S):
                self.log.add("gate_timeout", layer)
            gate.set_result(None)

        threading.Thread(target=open_gate, daemon=True).start()
        return gate

    def _copied(self, layer: int) -> None:
        self._settle("load", layer, 1)

    def _started(self, kind: str, segments: Sequence[Segment]) -> None:
        for layer in sorted({layer for seg in segments for layer, _ in self.layers.segment(seg)}):
            self.log.add("read_started" if kind == "read" else "send_started", layer)

    def _moved(self, kind: str, segments: Sequence[Segment]) -> None:
        what = "load" if kind == "read" else "send"
        for seg in segments:
            for layer, _ in self.layers.segment(seg):
                self._settle(what, layer, self.layers.lb)

    def _settle(self, what: str, layer: int, nbytes: int) -> None:
        with self._lock:
            self._pending[(what, layer)] -= nbytes
            done = self._pending[(what, layer)] == 0
        if done:
            self.log.add(f"{what}_done", layer)


def _both(a: Future[None] | None, b: Future[None] | None) -> Future[None] | None:
    """A future done when both are (either may be None)."""
    if a is None or b is None:
        return a or b
    out: Future[None] = Future()
    b.add_done_callback(lambda _: a.add_done_callback(
        lambda f: out.set_exception(f.exception()) if f.exception() else out.set_result(None)))
    return out


def _then(inner: Future[None], action: Callable[[], None]) -> Future[None]:
    """A future that completes after ``action`` ran on ``inner``'s success."""
    out: Future[None] = Future()

    def done(f: Future[None]) -> None:
        if f.exception() is not None:
            out.set_exception(f.exception())
            return
        action()
        out.set_result(None)

    inner.add_done_callback(done)
    return out


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
    hidden: torch.Tensor
    de_buffer: torch.Tensor
    blocks: dict[tuple[str, int], set[int]] = field(default_factory=dict)
    submissions: dict[str, int] = field(default_factory=dict)
    group: int = 1


def _engine(model_dir, window: int | None) -> LLMEngine:
    return LLMEngine(model_dir, EngineConfig(dtype="float32", block_size=BLOCK,
                                             num_kv_blocks=NUM_BLOCKS + 2, layer_window=window))


@pytest.fixture(scope="module")
def full(tiny_deep_dir) -> LLMEngine:
    return _engine(tiny_deep_dir, None)


@pytest.fixture(scope="module")
def windowed(tiny_deep_dir) -> LLMEngine:
    engine = _engine(tiny_deep_dir, 2)
    assert engine.runner.cache.resident_layers == 2
    assert engine.runner.cache.num_blocks == 3 * (NUM_BLOCKS + 2)  # 6 layers / 2: 3x the blocks
    return engine


def _random_kv(nbytes: int, seed: int) -> torch.Tensor:
    """Finite float32 KV as bytes (random bytes could be NaN)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(nbytes // 4, generator=g).view(torch.uint8)


def _prefill(engine: LLMEngine, mode: str, read_path: str, gate: bool = False,
             send_s: float = 0.0, group_bytes: int = 0) -> Run:
    """One real prefill forward of the miss tokens, with the hit KV in PE slots and/or the DE
    buffer (a split read: block 0 on the PE, block 1 on the DE)."""
    cache = engine.runner.cache
    addrs = CacheAddresses(cache)
    num_layers = cache.num_layers
    pe_blocks = [1, 2, 3, 4]  # not 0, so a block index mix-up shows
    de_buffer = torch.zeros(num_layers * NUM_BLOCKS * addrs.layer_block_bytes, dtype=torch.uint8)
    de_buffer[:] = _random_kv(de_buffer.numel(), seed=1)
    pool = HostPool(engine.layout.full_block_bytes, NUM_HIT, pin=False)
    pe_reads = {"pe": NUM_HIT, "split": 1, "de": 0}[read_path]
    slots = pool.alloc(pe_reads) if pe_reads else []
    layer_major = de_buffer.view(num_layers, NUM_BLOCKS, -1)
    for k, slot in enumerate(slots):  # the same hit KV on both sides: every path, same math
        pool.tensor(slot).view(num_layers, -1).copy_(layer_major[:, k])
    plan = LayerPlan(pe_blocks, NUM_HIT, read_path, mode, DE_ENDPOINT, de_buffer.data_ptr(),
                     slots, num_pe_read_blocks=pe_reads)
    seq = Seq(list(range(1, PROMPT_LEN + 1)), SamplingParams(max_tokens=1, ignore_eos=True))
    seq.block_table = pe_blocks
    seq.num_computed_tokens = NUM_HIT * BLOCK
    log = EventLog()
    layer_map = LayerMap(addrs, plan, num_layers, pool)
    with RecordingTraffic(log, layer_map, gate, send_s) as traffic:
        hooks = PrefillHooks(plan, cache, traffic, pool, group_bytes=group_bytes)
        inputs = engine.runner.prepare([(seq, PROMPT_LEN - NUM_HIT * BLOCK)])
        with compute_events(engine.runner.model, log):
            hidden = engine.runner.run(inputs, hooks)
    assert torch.isfinite(hidden).all()
    if not cache.is_window:  # the cache still holds every layer: check it against the sources
        _assert_bytes_landed(engine, plan, de_buffer, pool)
    return Run(log, plan, num_layers, hidden, de_buffer, traffic.blocks, traffic.submissions,
               hooks.group)


def _assert_bytes_landed(engine: LLMEngine, plan: LayerPlan, de_buffer: torch.Tensor,
                         pool: HostPool) -> None:
    """The hit KV is in the PE cache and the forwarded blocks are in the DE buffer."""
    data = engine.runner.cache.data.view(torch.uint8)
    num_layers = data.shape[0]
    de = de_buffer.view(num_layers, NUM_BLOCKS, -1)
    for j in plan.host_loads():
        source = pool.tensor(plan.pe_slots[j]).view(num_layers, -1)
        assert torch.equal(data[:, plan.pe_blocks[j]].reshape(num_layers, -1), source)
    for j in [*plan.host_loads(), *plan.forward_blocks()]:
        assert torch.equal(data[:, plan.pe_blocks[j]].reshape(num_layers, -1), de[:, j])


def _assert_every_layer_moved(run: Run) -> None:
    """Each layer loaded exactly the hit blocks and sent exactly the forward blocks."""
    for i in range(run.num_layers):
        assert run.blocks[("load", i)] == set(range(NUM_HIT))
        assert run.blocks[("send", i)] == set(run.plan.forward_blocks())


READ_PATHS = ["pe", "de", "split"]


@pytest.fixture(scope="module", params=READ_PATHS)
def layerwise(request, windowed) -> Run:
    run = _prefill(windowed, "layerwise", request.param, gate=True)
    _assert_every_layer_moved(run)
    return run


def test_layerwise_loads_each_layers_hit_kv_before_that_layer_computes(layerwise):
    log = layerwise.log
    for i in range(layerwise.num_layers):
        assert log.last("load_done", i) < log.first("compute_start", i), (
            f"layer {i} computes before its hit KV is loaded: {log.events}")


def test_layerwise_loads_the_next_layer_while_a_layer_computes(layerwise):
    """The load of layer i+1 is issued before layer i ends and is still in flight when layer i
    starts: a prefetch that blocks before the compute would hold the gate shut."""
    log = layerwise.log
    assert log.count("gate_timeout") == 0, (
        f"a load did not overlap the compute of the layer before it: {log.events}")
    for i in range(layerwise.num_layers - 1):
        assert log.first("load_issued", i + 1) < log.first("compute_end", i), (
            f"layer {i + 1}'s load is not issued before layer {i} ends: {log.events}")
        assert log.last("load_done", i + 1) > log.first("compute_start", i), (
            f"layer {i + 1}'s load finished before layer {i} started: {log.events}")


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
def test_window_reuses_a_slot_only_after_its_layer_left(full, windowed, read_path):
    """Slow sends: layer j's load or compute must wait for layer j-2's send, or layer j's KV
    overwrites the slot before layer j-2's bytes leave — the DE buffer and the hidden states
    must equal a run that keeps every layer resident."""
    reference = _prefill(full, "layerwise", read_path)
    run = _prefill(windowed, "layerwise", read_path, send_s=SLOW_SEND_S)
    log = run.log
    for j in range(2, run.num_layers):
        if read_path != "pe":  # a read from the DE: its start is logged
            assert log.first("read_started", j) > log.first("send_done", j - 2), (
                f"layer {j} loads into a slot layer {j - 2} has not left: {log.events}")
        assert log.first("compute_start", j) > log.first("send_done", j - 2)
    assert torch.equal(run.de_buffer, reference.de_buffer), "the window corrupted sent KV"
    assert torch.equal(run.hidden, reference.hidden)


@pytest.mark.parametrize("read_path", ["pe", "de"])
def test_basic_loads_every_layer_before_layer_0_and_sends_after_the_last(full, read_path):
    run = _prefill(full, "basic", read_path)
    _assert_every_layer_moved(run)
    log, last = run.log, run.num_layers - 1
    for i in range(run.num_layers):
        assert log.last("load_done", i) < log.first("compute_start", 0), (
            f"layer {i}'s hit KV is not loaded before layer 0 computes: {log.events}")
        assert log.first("send_issued", i) > log.first("compute_end", last), (
            f"layer {i}'s KV is sent before the last layer ends: {log.events}")


def test_basic_refuses_a_window_cache(windowed):
    plan = LayerPlan([1], 0, "pe", "basic", DE_ENDPOINT, 1, [])
    with pytest.raises(ValueError, match="window"):
        PrefillHooks(plan, windowed.runner.cache, TrafficManager(None), None)


def test_layerwise_and_basic_compute_the_same_hidden_states(full, windowed):
    """Same greedy tokens: the window and the overlap change where KV sits, never the math."""
    basic = _prefill(full, "basic", "pe")
    for read_path in READ_PATHS:
        assert torch.equal(_prefill(windowed, "layerwise", read_path).hidden, basic.hidden)


@pytest.mark.parametrize("read_path", ["pe", "de"])
def test_a_wider_window_prefetches_as_many_layers_as_it_has_slots(tiny_deep_dir, full,
                                                                  read_path):
    """With 3 slots, layers i+1 and i+2 are loading while layer i computes, layer i+3 not yet
    (its slot is layer i's); the KV sent and the hidden states are those of a full cache."""
    engine = _engine(tiny_deep_dir, 3)
    assert engine.runner.cache.resident_layers == 3
    run = _prefill(engine, "layerwise", read_path, send_s=SLOW_SEND_S)
    _assert_every_layer_moved(run)
    log = run.log
    for i in range(run.num_layers - 2):
        assert log.first("load_issued", i + 2) < log.first("compute_start", i), (
            f"layer {i + 2}'s load is not in flight while layer {i} computes: {log.events}")
    for i in range(run.num_layers - 3):
        assert log.first("load_issued", i + 3) > log.first("compute_end", i), (
            f"layer {i + 3}'s load is issued before layer {i} ends: {log.events}")
    reference = _prefill(full, "layerwise", read_path)
    assert torch.equal(run.hidden, reference.hidden)
    assert torch.equal(run.de_buffer, reference.de_buffer)


GROUPED = 1 << 30  # a move size no tiny layer reaches: as many layers per move as allowed
LOAD_SOURCES = {"pe": 1, "de": 1, "split": 2}  # submissions per loaded group


@pytest.mark.parametrize("read_path", READ_PATHS)
def test_a_full_cache_moves_every_layer_in_one_load_and_one_send(full, read_path):
    """Grouped moves: one submission per source carries the six layers' hit KV, one carries
    their new KV; the bytes in the cache and the DE buffer and the hidden states are those
    of the layer-by-layer run."""
    reference = _prefill(full, "layerwise", read_path)
    run = _prefill(full, "layerwise", read_path, send_s=SLOW_SEND_S, group_bytes=GROUPED)
    _assert_every_layer_moved(run)
    assert run.group == run.num_layers
    assert run.submissions == {"load": LOAD_SOURCES[read_path], "send": 1}
    assert reference.submissions == {"load": LOAD_SOURCES[read_path] * run.num_layers,
                                     "send": run.num_layers}
    log, last = run.log, run.num_layers - 1
    assert log.first("send_issued", 0) > log.first("compute_end", last)
    assert torch.equal(run.de_buffer, reference.de_buffer)
    assert torch.equal(run.hidden, reference.hidden)


@pytest.mark.parametrize("read_path", READ_PATHS)
def test_a_window_of_four_moves_pairs_and_reuses_slots_only_after_they_left(
        tiny_deep_dir, full, read_path):
    """Four slots hold two groups of two: group (i, i+1) loads while the group before it
    computes, a group's slots are reused only once the group they held (layers j-4, j-3) has
    left, even with slow sends; the KV sent and the hidden states are a full cache's."""
    engine = _engine(tiny_deep_dir, 4)
    run = _prefill(engine, "layerwise", read_path, send_s=SLOW_SEND_S, group_bytes=GROUPED)
    _assert_every_layer_moved(run)
    assert run.group == 2
    groups = run.num_layers // 2
    assert run.submissions == {"load": LOAD_SOURCES[read_path] * groups, "send": groups}
    log = run.log
    for j in range(4, run.num_layers):
        if read_path != "pe":
            assert log.first("read_started", j) > log.last("send_done", j - 4), (
                f"layer {j} loads into a slot layer {j - 4} has not left: {log.events}")
        assert log.first("compute_start", j) > log.last("send_done", j - 4)
    for g in range(2, run.num_layers, 2):  # in flight while the group before it computes
        assert log.first("load_issued", g) < log.first("compute_end", g - 1), (
            f"group {g}'s load is not issued before layer {g - 1} ends: {log.events}")
    reference = _prefill(full, "layerwise", read_path)
    assert torch.equal(run.de_buffer, reference.de_buffer), "a group reused a slot too early"
    assert torch.equal(run.hidden, reference.hidden)


@pytest.mark.parametrize("read_path", ["pe", "de"])
def test_basic_grouped_loads_before_layer_0_and_sends_after_the_last(full, read_path):
    run = _prefill(full, "basic", read_path, group_bytes=GROUPED)
    _assert_every_layer_moved(run)
    assert run.submissions == {"load": 1, "send": 1}
    log, last = run.log, run.num_layers - 1
    for i in range(run.num_layers):
        assert log.last("load_done", i) < log.first("compute_start", 0)
        assert log.first("send_issued", i) > log.first("compute_end", last)
