"""The stream-ordered layerwise pipeline (CUDA) with fakes for the device: its host logic.

``PrefillHooks(stream_ordered=True)`` is what runs on a CUDA cache. Here the cache is on the
CPU, torch's CUDA events and streams are fakes that log, the traffic manager is a fake that
reports a copy-stream event per load and chains each send on its ``after`` future, and the
event watcher is a fake whose futures the test completes ("the device reached that event"). It
checks what the GPU test (``test_cuda_hook_order``) measures with real events:

- the compute thread never waits on the host for a host→device copy to land: the compute
  stream waits on the copy's event before the layer is launched;
- nothing synchronizes the compute stream; a layer's send starts once the device has passed
  that layer's compute event, not at the end of the forward;
- a slot's next load chains on its tenant's send (or, with nothing to send, its compute);
- the forward's end waits for every load to have landed (the host slots are freed after it).
"""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future
from typing import Any

import pytest
import torch

from dualpath.engine.cuda_events import EventWatcher, stream_wait
from dualpath.engine.layerwise import LayerPlan, PrefillHooks
from dualpath.kv.cache import PagedKVCache
from dualpath.kv.host_pool import HostPool
from dualpath.model.spec import ModelSpec
from dualpath.traffic.copies import CopyIssue

NUM_LAYERS = 4
BLOCK = 4


def _spec(num_layers: int = NUM_LAYERS) -> ModelSpec:
    return ModelSpec(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=32,
                     num_layers=num_layers, num_heads=2, num_kv_heads=1, head_dim=8,
                     rms_norm_eps=1e-5, max_position=64, torch_dtype="float32")


class Log:
    """What happened, in order, from any thread."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, Any]] = []
        self._lock = threading.Lock()

    def add(self, what: str, arg: Any = None) -> None:
        with self._lock:
            self.entries.append((what, arg))

    def index(self, what: str, arg: Any = None) -> int:
        return self.entries.index((what, arg))

    def has(self, what: str, arg: Any = None) -> bool:
        return (what, arg) in self.entries


_ids = itertools.count()


class FakeEvent:
    """A CUDA event: ``record`` logs which stream it marks."""

    def __init__(self, name: str | None = None) -> None:
        self.name = name or f"event{next(_ids)}"
        self.log: Log | None = None

    def record(self, stream: FakeStream) -> None:
        stream.log.add("record", self.name)

    def synchronize(self) -> None:
        raise AssertionError("the host synchronized a CUDA event")


class FakeStream:
    """The compute stream: it may wait on events; a host synchronize fails the test."""

    def __init__(self, log: Log) -> None:
        self.log = log

    def wait_event(self, event: FakeEvent) -> None:
        self.log.add("stream waits", event.name)

    def synchronize(self) -> None:
        raise AssertionError("the compute stream was synchronized")


class FakeWatcher:
    """Futures for compute events, completed by the test when 'the device' reaches them."""

    def __init__(self) -> None:
        self.watched: dict[str, Future[None]] = {}

    def watch(self, event: FakeEvent) -> Future[None]:
        future: Future[None] = Future()
        self.watched[event.name] = future
        return future

    def reach(self, name: str) -> None:
        self.watched[name].set_result(None)


class FakeTraffic:
    """Copies report their copy-stream event at once and land when the test says; sends start
    once their ``after`` completes."""

    def __init__(self, log: Log, layer_of_dst) -> None:
        self.log = log
        self.layer_of_dst = layer_of_dst
        self.landed: dict[int, Future[None]] = {}
        self.copy_after: dict[int, Future[Any] | None] = {}
        self.sends: dict[int, Future[None]] = {}

    def submit_copies(self, pairs, lane, direction=None, after=None, issue=None):
        layer = self.layer_of_dst(pairs[0][0])
        assert issue is not None, "a stream-ordered load must ask for its copy events"
        issue.expect(1)
        issue.add(FakeEvent(f"copy{layer}"))
        self.log.add("copy issued", layer)
        self.copy_after[layer] = after
        landed: Future[None] = Future()
        self.landed[layer] = landed
        issue.follow(landed)
        return landed

    def submit(self, kind, peer, segments, lane, after=None):
        assert kind == "write"
        layer = int(segments[0][1] - 1_000_000) // 10_000_000
        done: Future[None] = Future()
        self.sends[layer] = done

        def start(_: Future[Any] | None = None) -> None:
            self.log.add("send starts", layer)
            done.set_result(None)

        if after is None:
            start()
        else:
            after.add_done_callback(start)
        return done


@pytest.fixture
def fake_cuda(monkeypatch):
    log = Log()
    stream = FakeStream(log)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    return log


def _hooks(log: Log, window: int | None, num_hit_blocks: int = 2,
           pe_blocks: tuple[int, ...] = (0, 1, 2), num_layers: int = NUM_LAYERS,
           group_bytes: int = 0) -> tuple[PrefillHooks, FakeTraffic, FakeWatcher]:
    spec = _spec(num_layers)
    cache = PagedKVCache(spec, num_blocks=8, block_size=BLOCK, kv_dtype="float32",
                         layer_window=window)
    lb = cache.data[0, 0].numel() * cache.data.element_size()
    pool = HostPool(num_layers * lb, num_hit_blocks or 1, pin=False)
    base = cache.data.data_ptr()

    def layer_of_dst(dst: torch.Tensor) -> int:  # slot of the cache view -> the layer loading
        # (a group's first layer names its load)
        slot = (dst.data_ptr() - base) // (cache.num_blocks * lb)
        return pending_layer[slot]

    pending_layer: dict[int, int] = {}
    traffic = FakeTraffic(log, layer_of_dst)
    # DE buffer addresses: layer i's blocks at 1e6 + i * 1e7 (only for the sends' logging)
    plan = LayerPlan(list(pe_blocks), num_hit_blocks, "pe", "layerwise", "de",
                     1_000_000, list(range(num_hit_blocks)))
    plan = _spread(plan, lb)
    watcher = FakeWatcher()
    hooks = PrefillHooks(plan, cache, traffic, pool, watcher=watcher,  # type: ignore[arg-type]
                         stream_ordered=True, group_bytes=group_bytes)
    original = hooks._start_load

    def tracked_start(layers: range):
        for layer_idx in layers:
            pending_layer[cache.layer_slot(layer_idx)] = layer_idx
        return original(layers)

    hooks._start_load = tracked_start  # type: ignore[method-assign]
    return hooks, traffic, watcher


def _spread(plan: LayerPlan, lb: int) -> LayerPlan:
    """The same plan whose DE layer addresses are 1e7 apart, so a send names its layer."""

    class Spread(LayerPlan):
        def de_layer_block(self, layer_idx: int, block: int, layer_block_bytes: int) -> int:
            return self.de_buffer_addr + layer_idx * 10_000_000 + block * layer_block_bytes

    return Spread(**{f: getattr(plan, f) for f in plan.__dataclass_fields__})


def _layer(hooks: PrefillHooks, log: Log, i: int) -> None:
    hooks.before_layer(i)
    log.add("compute", i)
    hooks.after_layer(i)


def test_loads_are_waited_on_by_the_stream_and_sends_follow_each_layers_event(fake_cuda):
    log = fake_cuda
    hooks, traffic, watcher = _hooks(log, window=None)
    for i in range(NUM_LAYERS):
        _layer(hooks, log, i)
        # the host never waited for the copy to land, yet the stream waits on it first
        assert not traffic.landed[i].done()
        assert log.index("stream waits", f"copy{i}") < log.index("compute", i)
    # every layer's compute was followed by an event; no send started before the device
    # reached it
    assert not any(w == "send starts" for w, _ in log.entries)
    assert hooks.num_stream_waits == NUM_LAYERS
    names = list(watcher.watched)
    assert len(names) == NUM_LAYERS
    watcher.reach(names[0])  # the device finished layer 0: its send starts, the others wait
    assert log.has("send starts", 0) and not log.has("send starts", 1)
    for name in names[1:]:
        watcher.reach(name)
    finished = threading.Event()
    thread = threading.Thread(target=lambda: (hooks.finish(), finished.set()))
    thread.start()
    assert not finished.wait(0.2), "the forward ended before its loads had landed"
    for future in traffic.landed.values():
        future.set_result(None)
    thread.join(5)
    assert finished.is_set()


def test_a_layers_send_starts_before_the_forward_ends(fake_cuda):
    log = fake_cuda
    hooks, _traffic, watcher = _hooks(log, window=None)
    _layer(hooks, log, 0)
    watcher.reach(next(iter(watcher.watched)))
    _layer(hooks, log, 1)  # layer 1 launches after layer 0's send started
    assert log.index("send starts", 0) < log.index("compute", 1)


def test_a_windowed_slot_is_loaded_after_its_tenant_left(fake_cuda):
    log = fake_cuda
    hooks, traffic, watcher = _hooks(log, window=2)
    _layer(hooks, log, 0)
    # layer 2 shares layer 0's slot: its load chains on layer 0's send
    assert traffic.copy_after[0] is None and traffic.copy_after[1] is None
    for future in traffic.landed.values():
        future.set_result(None)
    watcher.reach(next(iter(watcher.watched)))
    _layer(hooks, log, 1)
    assert traffic.copy_after[2] is traffic.sends[0]


def test_without_sends_a_slot_waits_for_its_tenants_compute(fake_cuda):
    log = fake_cuda
    # every prompt block is a hit read by the DE... here: nothing to forward at all
    hooks, traffic, watcher = _hooks(log, window=2, num_hit_blocks=2, pe_blocks=(0, 1))
    hooks.plan = _no_forward(hooks.plan)
    _layer(hooks, log, 0)
    _layer(hooks, log, 1)
    assert not traffic.sends
    # layer 2's load waits for the device to finish layer 0 (it overwrites layer 0's slot)
    computed0 = watcher.watched[next(iter(watcher.watched))]
    assert traffic.copy_after[2] is computed0


def test_without_sends_a_group_waits_for_the_compute_of_every_layer_it_replaces(fake_cuda):
    """Eight layers, four slots, groups of two, nothing to forward: the load of layers 4-5
    takes the slots of layers 0 and 1, so it waits for the device to finish both."""
    log = fake_cuda
    hooks, traffic, watcher = _hooks(log, window=4, num_hit_blocks=2, pe_blocks=(0, 1),
                                     num_layers=8, group_bytes=1 << 30)
    hooks.plan = _no_forward(hooks.plan)
    assert hooks.group == 2
    for i in range(3):
        _layer(hooks, log, i)
    after = traffic.copy_after[4]
    assert after is not None and not after.done()
    computed = list(watcher.watched.values())
    computed[0].set_result(None)  # the device finished layer 0, not yet layer 1
    assert not after.done(), "layers 4-5 may load while layer 1 still computes in its slot"
    computed[1].set_result(None)
    assert after.done()


def _no_forward(plan: LayerPlan) -> LayerPlan:
    fields = {f: getattr(plan, f) for f in plan.__dataclass_fields__}
    fields.update(forward_from=0, forward_to=0)
    return type(plan)(**fields)


def test_copy_issue_semantics():
    issue = CopyIssue()
    issue.expect(2)
    issue.add("a")
    assert not issue.future.done()
    issue.add("b")
    assert issue.future.result(0) == ["a", "b"]

    host = CopyIssue()  # host copies report no event: the issue settles when they land
    landed: Future[None] = Future()
    host.follow(landed)
    assert not host.future.done()
    landed.set_result(None)
    assert host.future.result(0) == []

    failed = CopyIssue()
    failed.expect(3)
    landed = Future()
    failed.follow(landed)
    landed.set_exception(RuntimeError("copy failed"))
    with pytest.raises(RuntimeError, match="copy failed"):
        failed.future.result(0)

    empty = CopyIssue()
    empty.expect(0)
    assert empty.future.result(0) == []


class _SyncEvent:
    def __init__(self, gate: threading.Event | None = None, error: Exception | None = None):
        self.gate, self.error = gate, error

    def synchronize(self) -> None:
        if self.gate is not None:
            assert self.gate.wait(5)
        if self.error is not None:
            raise self.error


def test_event_watcher_completes_in_order_and_reports_errors():
    watcher = EventWatcher()
    gate = threading.Event()
    first = watcher.watch(_SyncEvent(gate))
    failing = watcher.watch(_SyncEvent(error=RuntimeError("device fault")))
    last = watcher.watch(_SyncEvent())
    assert not first.done()
    gate.set()
    assert first.result(5) is None
    with pytest.raises(RuntimeError, match="device fault"):
        failing.result(5)
    assert last.result(5) is None
    watcher.close()
    with pytest.raises(RuntimeError, match="closed"):
        watcher.watch(_SyncEvent())


def test_stream_wait_counts_events():
    log = Log()
    stream = FakeStream(log)
    assert stream_wait([FakeEvent("x"), FakeEvent("y")], stream) == 2
    assert log.entries == [("stream waits", "x"), ("stream waits", "y")]


def test_a_host_copy_with_an_issue_settles_once_landed():
    from dualpath.traffic.lanes import Lane
    from dualpath.traffic.manager import TrafficManager

    src, dst = torch.arange(64, dtype=torch.float32), torch.zeros(64)
    issue = CopyIssue()
    with TrafficManager(None) as traffic:
        landed = traffic.submit_copies([(dst, src)], Lane.KV_LOAD, "h2d", issue=issue)
        assert issue.future.result(5) == []  # no copy stream on a CPU: nothing to wait on
        assert landed.done()
    assert torch.equal(dst, src)


class _CopyEvent:
    """A copy stream's event: landed once the test says so."""

    def __init__(self) -> None:
        self.landed = False
        self.error: Exception | None = None
        self.waited = False

    def query(self) -> bool:
        if self.error is not None:
            raise self.error
        return self.landed

    def synchronize(self) -> None:
        self.waited = True
        self.landed = True


def _copy_work(event):
    from dualpath.traffic.lanes import Lane
    from dualpath.traffic.work import CopyWork, Submission

    sub = Submission(1)
    return sub, CopyWork(sub, Lane.KV_LOAD, 1024, lambda: event)


def test_an_issued_cuda_copy_stays_in_flight_until_its_event_completes():
    event = _CopyEvent()
    sub, work = _copy_work(event)
    assert work.start() is None  # issued: the dispatcher moves on to the next item
    assert work.poll() is None and not sub.future.done()
    event.landed = True
    assert work.poll() is True
    assert sub.future.result(0) is None


def test_a_device_error_while_a_copy_lands_fails_its_submission():
    from dualpath.errors import TransferError

    event = _CopyEvent()
    sub, work = _copy_work(event)
    assert work.start() is None
    event.error = RuntimeError("illegal address")
    assert work.poll() is False
    with pytest.raises(TransferError, match="illegal address"):
        sub.future.result(0)


def test_run_waits_for_an_issued_copy_and_host_copies_finish_at_once():
    event = _CopyEvent()
    sub, work = _copy_work(event)
    assert work.run() is True and event.waited and sub.future.done()
    host_sub, host_work = _copy_work(None)
    assert host_work.start() is True and host_sub.future.done()
