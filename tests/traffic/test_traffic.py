"""The traffic manager: lane isolation on a capped link, chunking, ordering, errors, counters."""

from __future__ import annotations

import ctypes
import mmap
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from functools import partial

import pytest
import torch

from dualpath.config import TrafficConfig
from dualpath.errors import TransferError
from dualpath.traffic.lanes import Lane
from dualpath.traffic.manager import TrafficManager, split_chunks
from dualpath.transfer.base import PendingTransfer, Segment, TransferBackend
from dualpath.transfer.local import LocalBackend

MB = 1 << 20
KB = 1 << 10


def _address(buf: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


class Link:
    """Two local backends with an 8 MB registered buffer each; ``tm`` sends from ``a`` to ``b``
    (``a``: ``sender`` if given)."""

    def __init__(self, config: TrafficConfig, sender: LocalBackend | None = None) -> None:
        self.a, self.b = sender or LocalBackend(), LocalBackend()
        self.abuf, self.bbuf = mmap.mmap(-1, 8 * MB), mmap.mmap(-1, 8 * MB)
        self.aaddr, self.baddr = _address(self.abuf), _address(self.bbuf)
        self.tm = TrafficManager(self.a, config)
        self.tm.register(self.aaddr, 8 * MB)
        self.b.register(self.baddr, 8 * MB)

    def close(self) -> None:
        self.tm.close()
        self.a.close()
        self.b.close()


@pytest.fixture
def link() -> Iterator[Link]:
    link = Link(TrafficConfig())
    yield link
    link.close()


class Recorder(TransferBackend):
    """A fake backend that logs each call's segments; it can hold calls or fail them."""

    endpoint = "recorder"

    def __init__(self, gate: threading.Event | None = None, fail_at: int | None = None) -> None:
        self.calls: list[tuple[str, list[Segment]]] = []
        self.gate = gate
        self.fail_at = fail_at

    def register(self, address: int, nbytes: int) -> None:
        """Nothing to register."""

    def write(self, peer: str, segments: Sequence[Segment]) -> None:
        """Log the call (after the gate opens); fail the ``fail_at``-th local address."""
        if self.gate is not None:
            self.gate.wait(5)
        self.calls.append(("write", list(segments)))
        if self.fail_at is not None and any(s[0] == self.fail_at for s in segments):
            raise TransferError(f"injected failure at {self.fail_at}")

    def read(self, peer: str, segments: Sequence[Segment]) -> None:
        """Log the call."""
        self.calls.append(("read", list(segments)))

    def close(self) -> None:
        """Nothing to close."""


# --- the acceptance point: lanes on a capped compute link --------------------------------------


class Flow:
    """A thread that keeps ``depth`` 1 MB writes in flight on one lane until stopped."""

    def __init__(self, link: Link, lane: Lane, offset: int, depth: int = 4) -> None:
        self.stop = threading.Event()
        seg = [(link.aaddr + offset, link.baddr + offset, MB)]
        self._args = (link.tm, link.b.endpoint, seg, lane, depth)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        tm, peer, seg, lane, depth = self._args
        inflight: deque = deque()
        while not self.stop.is_set():
            while len(inflight) < depth:
                inflight.append(tm.submit("write", peer, seg, lane))
            inflight.popleft().result()
        for f in inflight:
            f.result()

    def end(self) -> None:
        self.stop.set()
        self.thread.join(5)


def _lane_rate(tm: TrafficManager, lane: Lane, seconds: float) -> float:
    """Bytes per second ``lane`` moved over the next ``seconds``."""
    key = f"lane_bytes_{lane.value}"
    before, t0 = tm.metrics()[key], time.monotonic()
    time.sleep(seconds)
    after, t1 = tm.metrics()[key], time.monotonic()
    return (after - before) / (t1 - t0)


class SlowLanding(LocalBackend):
    """A local backend whose transfers land 10 ms after they start (once polled), so a NIC
    direction keeps several in flight."""

    def start_write(self, peer: str, segments: Sequence[Segment]) -> PendingTransfer:
        """Check the ranges now; move the bytes at the first poll 10 ms on."""
        self._check(peer, segments)
        return _Later(partial(self.write, peer, list(segments)), time.monotonic() + 0.01)


class _Later(PendingTransfer):
    def __init__(self, land: Callable[[], None], at_s: float) -> None:
        self._land, self._at_s = land, at_s

    def poll(self) -> bool:
        if time.monotonic() < self._at_s:
            return False
        self._land()
        return True


@pytest.mark.parametrize("inflight", [1, 4], ids=["one-at-a-time", "four-in-flight"])
def test_high_lane_keeps_the_capped_link_and_kv_takes_it_when_idle(inflight):
    cap = 200e6  # 1 MB chunks: 5 ms of the cap each
    link = Link(TrafficConfig(compute_send_cap_mb_s=cap / 1e6, inflight_chunks=inflight),
                sender=None if inflight == 1 else SlowLanding())
    kv = Flow(link, Lane.KV_FORWARD, offset=0)
    high = Flow(link, Lane.HIGH, offset=4 * MB)
    try:
        time.sleep(0.2)  # both flows backlogged
        before = link.tm.metrics()
        t0 = time.monotonic()
        time.sleep(1.0)
        after, t1 = link.tm.metrics(), time.monotonic()
        high_rate = (after["lane_bytes_high"] - before["lane_bytes_high"]) / (t1 - t0)
        kv_rate = (after["lane_bytes_kv_forward"] - before["lane_bytes_kv_forward"]) / (t1 - t0)
        assert high_rate >= 0.95 * cap, f"high lane got {high_rate / cap:.1%} of the cap"
        assert kv_rate > 0, "the KV lane starved"
        assert high_rate + kv_rate <= 1.02 * cap
        high.end()
        time.sleep(0.1)  # the high lane's queue drains
        alone = _lane_rate(link.tm, Lane.KV_FORWARD, 0.5)
        assert alone >= 0.9 * cap, f"KV alone got {alone / cap:.1%} of the cap"
        assert 0.5 < link.tm.metrics()["cnic_send_utilization"] <= 1.05
    finally:
        high.end()
        kv.end()
        link.close()


# --- chunking ---------------------------------------------------------------------------------


def test_split_chunks_packs_small_segments_and_cuts_big_ones():
    small = [(i * 100, 10_000 + i * 100, 48) for i in range(5)]
    assert split_chunks(small, 100) == [small[:2], small[2:4], small[4:]]
    big = [(0, 1000, 250)]
    assert split_chunks(big, 100) == [[(0, 1000, 100)], [(100, 1100, 100)], [(200, 1200, 50)]]
    mixed = [(0, 0, 30), (500, 500, 250), (900, 900, 0), (950, 950, 60)]
    assert split_chunks(mixed, 100) == [
        [(0, 0, 30), (500, 500, 70)], [(570, 570, 100)], [(670, 670, 80)], [(950, 950, 60)]]
    assert split_chunks([], 100) == []


def test_backend_sees_chunks_of_at_most_chunk_bytes():
    backend = Recorder()
    with TrafficManager(backend, TrafficConfig(chunk_bytes=64 * KB)) as tm:
        segments = [(i * MB, 100 * MB + i * MB, 48 * KB) for i in range(10)]
        segments.append((50 * MB, 150 * MB, 300 * KB))
        tm.write("peer", segments, Lane.KV_FORWARD)
    sizes = [sum(s[2] for s in segs) for _, segs in backend.calls]
    assert max(sizes) <= 64 * KB
    assert sum(sizes) == 10 * 48 * KB + 300 * KB
    whole = [seg for _, segs in backend.calls for seg in segs if seg[2] == 48 * KB]
    assert whole == segments[:10]  # 48 KB blocks are never cut


def test_kv_lanes_move_in_kv_chunks_and_the_high_lane_in_chunks():
    backend = Recorder()
    config = TrafficConfig(chunk_bytes=64 * KB, kv_chunk_bytes=256 * KB)
    with TrafficManager(backend, config) as tm:
        tm.write("peer", [(0, MB, MB)], Lane.KV_LOAD)
        kv_sizes = [sum(s[2] for s in segs) for _, segs in backend.calls]
        backend.calls.clear()
        tm.write("peer", [(0, MB, MB)], Lane.HIGH)
        high_sizes = [sum(s[2] for s in segs) for _, segs in backend.calls]
        dst, src = bytearray(MB), bytearray(b"\x07" * MB)
        assert tm.copy(dst, src, Lane.KV_SAVE) == MB and dst == src
        m = tm.metrics()
    assert kv_sizes == [256 * KB] * 4
    assert high_sizes == [64 * KB] * 16
    assert m["d2h_bytes"] == MB
    assert TrafficConfig(chunk_bytes=64 * KB).lane_chunk_bytes("kv_save") == 64 * KB  # default
    with pytest.raises(ValueError, match="kv_chunk_bytes"):
        TrafficConfig(kv_chunk_bytes=0)


def test_write_and_read_round_trip_through_chunks(link):
    link.abuf[: 3 * MB] = bytes(range(256)) * (3 * MB // 256)
    link.tm.write(link.b.endpoint, [(link.aaddr, link.baddr + MB, 3 * MB)], Lane.KV_FORWARD)
    assert link.bbuf[MB: 4 * MB] == link.abuf[: 3 * MB]
    link.tm.read(link.b.endpoint, [(link.aaddr + 5 * MB, link.baddr + MB, 3 * MB)], Lane.KV_LOAD)
    assert link.abuf[5 * MB: 8 * MB] == link.abuf[: 3 * MB]
    m = link.tm.metrics()
    assert m["cnic_send_bytes"] == m["cnic_recv_bytes"] == 3 * MB
    assert m["lane_bytes_kv_forward"] == m["lane_bytes_kv_load"] == 3 * MB
    assert m["cnic_send_utilization"] is None and m["cnic_recv_utilization"] is None


# --- ordering ---------------------------------------------------------------------------------


def test_same_lane_is_fifo_and_high_lane_goes_first():
    gate = threading.Event()
    backend = Recorder(gate)
    with TrafficManager(backend, TrafficConfig(chunk_bytes=100)) as tm:
        first = tm.submit("write", "peer", [(1, 0, 100)], Lane.KV_SAVE)  # holds the dispatcher
        time.sleep(0.05)
        kv = [tm.submit("write", "peer", [(100 + i, 0, 100)], Lane.KV_SAVE) for i in range(5)]
        high = [tm.submit("write", "peer", [(200 + i, 0, 100)], Lane.HIGH) for i in range(5)]
        gate.set()
        for f in [first, *kv, *high]:
            f.result(5)
    order = [segs[0][0] for _, segs in backend.calls]
    assert order == [1, 200, 201, 202, 203, 204, 100, 101, 102, 103, 104]


def test_future_completes_after_its_last_chunk():
    gate = threading.Event()
    backend = Recorder(gate)
    with TrafficManager(backend, TrafficConfig(chunk_bytes=100)) as tm:
        future = tm.submit("write", "peer", [(0, 0, 1000)], Lane.KV_LOAD)
        assert not future.done()
        assert not future.cancel()  # queued transfers cannot be cancelled
        gate.set()
        future.result(5)
    assert len(backend.calls) == 10


# --- errors -----------------------------------------------------------------------------------


def test_backend_error_fails_the_future_and_drops_the_rest_of_that_transfer():
    backend = Recorder(fail_at=300)
    with TrafficManager(backend, TrafficConfig(chunk_bytes=100)) as tm:
        bad = tm.submit("write", "peer", [(100, 0, 500)], Lane.KV_FORWARD)
        with pytest.raises(TransferError, match="injected"):
            bad.result(5)
        tm.write("peer", [(10_000, 0, 200)], Lane.KV_FORWARD)  # later transfers still run
    starts = [segs[0][0] for _, segs in backend.calls]
    assert starts == [100, 200, 300, 10_000, 10_100]


def test_bad_address_through_local_backend(link):
    with pytest.raises(TransferError):
        link.tm.write(link.b.endpoint, [(link.aaddr, link.baddr + 8 * MB, 16)], Lane.HIGH)
    with pytest.raises(TransferError):
        link.tm.read("local-0", [(link.aaddr, link.baddr, 16)], Lane.HIGH)


def test_bad_arguments(link):
    with pytest.raises(ValueError):
        link.tm.submit("copy", link.b.endpoint, [], Lane.HIGH)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        link.tm.submit("write", link.b.endpoint, [(0, -1, 5)], Lane.HIGH)
    with pytest.raises(ValueError):
        link.tm.submit("write", link.b.endpoint, [(0, 1)], Lane.HIGH)  # type: ignore[list-item]
    assert link.tm.submit("write", link.b.endpoint, [], Lane.HIGH).result(1) is None
    with pytest.raises(ValueError):
        TrafficManager(None, TrafficConfig(lane_weights=(("high", 99),)))
    with pytest.raises(ValueError):
        TrafficConfig(chunk_bytes=0)


def test_closed_or_backendless_manager_refuses_transfers():
    tm = TrafficManager(None, TrafficConfig())
    with pytest.raises(TransferError):
        tm.submit("write", "peer", [(0, 0, 1)], Lane.HIGH)
    with pytest.raises(TransferError):
        tm.register(4096, 4096)
    tm.close()
    backend = Recorder()
    tm = TrafficManager(backend, TrafficConfig(chunk_bytes=100))
    futures = [tm.submit("write", "peer", [(i * 100, 0, 100)], Lane.KV_SAVE) for i in range(20)]
    tm.close()  # drains what was queued
    assert all(f.done() and f.exception() is None for f in futures)
    with pytest.raises(TransferError):
        tm.submit("write", "peer", [(0, 0, 1)], Lane.HIGH)


# --- copies, counters, idling -----------------------------------------------------------------


def test_copy_counts_bytes_per_lane_and_direction():
    tm = TrafficManager(None, TrafficConfig())
    dst, src = bytearray(1000), bytes(range(250)) * 4
    assert tm.copy(memoryview(dst), src, Lane.KV_LOAD) == 1000
    assert bytes(dst) == src
    t_dst, t_src = torch.zeros(64, 8, dtype=torch.bfloat16), torch.randn(64, 8).bfloat16()
    assert tm.copy(t_dst, t_src, Lane.KV_SAVE) == 1024
    assert torch.equal(t_dst, t_src)
    tm.copy(bytearray(10), b"x" * 10, Lane.HIGH, direction="d2h")
    with pytest.raises(ValueError):
        tm.copy(bytearray(10), b"x" * 11, Lane.HIGH)
    m = tm.metrics()
    assert (m["h2d_bytes"], m["d2h_bytes"]) == (1000, 1034)
    assert (m["copy_bytes_kv_load"], m["copy_bytes_kv_save"], m["copy_bytes_high"]) == (
        1000, 1024, 10)
    assert m["cnic_send_bytes"] == m["lane_bytes_kv_load"] == 0
    tm.close()


def test_capped_read_is_paced():
    backend = Recorder()
    config = TrafficConfig(compute_recv_cap_mb_s=100, chunk_bytes=64 * KB, burst_chunks=2)
    with TrafficManager(backend, config) as tm:
        start = time.monotonic()
        tm.read("peer", [(0, 0, 2 * MB)], Lane.KV_LOAD)
        elapsed = time.monotonic() - start
        assert elapsed >= (2 * MB - 2 * 64 * KB) / 100e6 * 0.95  # all but the burst is paced
        assert tm.metrics()["cnic_recv_utilization"] > 0


def test_idle_dispatchers_sleep(link):
    link.tm.write(link.b.endpoint, [(link.aaddr, link.baddr, MB)], Lane.HIGH)
    cpu = time.process_time()
    time.sleep(0.3)
    assert time.process_time() - cpu < 0.1
