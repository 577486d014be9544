"""Caps on both ends of a transfer: the passive NIC grants, arbitrates and paces peers' chunks.

"Engines" here are traffic managers over real Mooncake backends in one process where the point
is NIC behaviour (a decode engine pulled by two prefill engines; lanes vs one FIFO on the pulled
NIC), and over local backends where only the grant protocol matters (timeouts, cancels, dead
requesters, a stalled peer).
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future

import msgpack
import pytest
import zmq

from dualpath.config import EngineConfig, TrafficConfig
from dualpath.errors import TransferError
from dualpath.traffic.lanes import Lane
from dualpath.traffic.manager import TrafficManager
from dualpath.transfer.base import Segment, TransferBackend
from dualpath.transfer.local import LocalBackend

KB = 1 << 10
MB = 1 << 20
WINDOW_S = 0.1
CHUNK = 64 * KB


class Timed(TransferBackend):
    """Delegates to a real backend and logs ``(start time, bytes)`` of every call."""

    def __init__(self, inner: TransferBackend) -> None:
        self.inner = inner
        self.endpoint = inner.endpoint
        self.events: list[tuple[float, int]] = []
        self._lock = threading.Lock()

    def register(self, address: int, nbytes: int) -> None:
        """Register with the real backend."""
        self.inner.register(address, nbytes)

    def write(self, peer: str, segments: Sequence[Segment]) -> None:
        """Log, then write through the real backend."""
        self._log(segments)
        self.inner.write(peer, segments)

    def read(self, peer: str, segments: Sequence[Segment]) -> None:
        """Log, then read through the real backend."""
        self._log(segments)
        self.inner.read(peer, segments)

    def close(self) -> None:
        """Close the real backend."""
        self.inner.close()

    def _log(self, segments: Sequence[Segment]) -> None:
        with self._lock:
            self.events.append((time.monotonic(), sum(s[2] for s in segments)))


class Engine:
    """A traffic manager with a registered buffer, over Mooncake or the local backend."""

    def __init__(self, config: TrafficConfig, size: int = 8 * MB, mooncake: bool = False,
                 inner: TransferBackend | None = None) -> None:
        if inner is not None:
            pass
        elif mooncake:
            from dualpath.transfer.mooncake import MooncakeBackend

            try:
                inner: TransferBackend = MooncakeBackend()
            except TransferError as exc:
                pytest.skip(str(exc))
        else:
            inner = LocalBackend()
        self.backend = Timed(inner)
        self.buf = mmap.mmap(-1, size)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.buf))
        self.tm = TrafficManager(self.backend, config)
        self.tm.register(self.addr, size)
        self.endpoint = self.backend.endpoint

    def pull(self, peer: Engine, nbytes: int, lane: Lane = Lane.KV_LOAD,
             offset: int = 0) -> Future[None]:
        """Read ``nbytes`` of ``peer``'s buffer into ours (a one-sided read)."""
        return self.tm.submit("read", peer.endpoint, [(self.addr + offset, peer.addr, nbytes)],
                              lane)

    def knows(self, peer: Engine) -> None:
        assert peer.tm.nic_address is not None
        self.tm.set_peer_nic(peer.endpoint, peer.tm.nic_address)

    def close(self) -> None:
        self.tm.close()
        self.backend.close()


def _capped(send_mb_s: float, **kw: object) -> TrafficConfig:
    kw.setdefault("burst_chunks", 2)
    kw.setdefault("chunk_bytes", CHUNK)
    return TrafficConfig(compute_send_cap_mb_s=send_mb_s, **kw)  # type: ignore[arg-type]


def peak_mb_s(events: Sequence[tuple[float, int]], window_s: float = WINDOW_S) -> float:
    """The most bytes in any window of ``window_s`` ending at an event, as MB/s."""
    events = sorted(events)
    best = total = start = 0
    for t, nbytes in events:
        total += nbytes
        while events[start][0] <= t - window_s:
            total -= events[start][1]
            start += 1
        best = max(best, total)
    return best / window_s / 1e6


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    """Traffic managers made by the test, closed after it; the process runs at an engine
    process's GIL switch interval meanwhile (at Python's 5 ms, the two ends' grant and
    dispatcher threads in this one process wait for each other, not for the cap)."""
    made: list[Engine] = []
    default_switch_s = sys.getswitchinterval()
    sys.setswitchinterval(EngineConfig().gil_switch_ms / 1000)
    yield made
    for engine in reversed(made):
        engine.close()
    sys.setswitchinterval(default_switch_s)


# --- the acceptance point: a decode engine pulled by two prefill engines ----------------------


def test_without_burst_both_ends_pace_a_transfer_at_once(engines):
    """Two capped ends, no burst: a pull takes its bytes' time at the cap, not twice that (a
    peer holds two grants, so each end paces one chunk while the other paces the next). Taking
    turns is slow on every pull, a busy host on some: the fastest of three pulls must be quick,
    and none may run ahead of the cap."""
    cap, chunk = 40.0, 512 * KB  # 13 ms a chunk: Python's per-chunk cost is small beside it
    de = Engine(_capped(cap, burst_chunks=0, chunk_bytes=chunk), mooncake=True)
    pe = Engine(TrafficConfig(compute_recv_cap_mb_s=cap, chunk_bytes=chunk, burst_chunks=0),
                mooncake=True)
    engines.extend([de, pe])
    pe.knows(de)
    elapsed_s = []
    for _ in range(3):
        start = time.monotonic()
        pe.pull(de, 8 * MB).result(10)
        elapsed_s.append(time.monotonic() - start)
    wire_s = 8 * MB / (cap * 1e6)  # 0.21 s (2-core Xeon: 1.2-1.6x that; taking turns 2.2-2.3x)
    assert min(elapsed_s) >= wire_s * 0.95  # no chunk ahead of the rate
    assert min(elapsed_s) < wire_s * 1.9, elapsed_s  # no turns
    assert de.tm.metrics()["cnic_send_passive_bytes"] == 3 * 8 * MB
    assert peak_mb_s(pe.backend.events) <= 1.1 * cap


@pytest.mark.parametrize("grants", [True, False])
def test_two_readers_never_push_the_pulled_nic_past_its_cap(engines, grants):
    cap = 40.0  # MB/s: 4 MB per 100 ms window, against a burst of 2 × 64 KB
    de = Engine(_capped(cap), mooncake=True)
    readers = [Engine(TrafficConfig(compute_recv_cap_mb_s=10_000, chunk_bytes=CHUNK),
                      mooncake=True) for _ in range(2)]
    engines.extend([de, *readers])
    if grants:
        for pe in readers:
            pe.knows(de)
    start = time.monotonic()
    for f in [pe.pull(de, 8 * MB) for pe in readers]:
        f.result(10)
    elapsed = time.monotonic() - start
    merged = [e for pe in readers for e in pe.backend.events]
    measured = peak_mb_s(merged)
    m = de.tm.metrics()
    print(f"grants={grants}: {elapsed:.2f} s, readers' peak {measured:.1f} MB/s, "
          f"DE peak metric {m['cnic_send_peak_mb_s_100ms']:.1f} MB/s (cap {cap:g})")
    if grants:
        assert measured <= 1.1 * cap
        assert m["cnic_send_peak_mb_s_100ms"] <= 1.1 * cap
        assert m["cnic_send_passive_bytes"] == m["cnic_send_passive_lane_bytes_kv_load"] == 16 * MB
        assert m["cnic_send_lane_bytes_kv_load"] == m["cnic_send_total_bytes"] == 16 * MB
        assert elapsed >= (16 * MB - 2 * CHUNK) / (cap * 1e6) * 0.95
        assert all(pe.tm.metrics()["unpaced_peer_chunks"] == 0 for pe in readers)
    else:  # the bug this guards against: the pulled NIC is neither charged nor paced
        assert measured > 2 * cap
        assert m["cnic_send_passive_bytes"] == 0
        assert all(pe.tm.metrics()["unpaced_peer_chunks"] == 8 * MB // CHUNK for pe in readers)


class SlowStart(LocalBackend):
    """A local backend whose first read stalls: a requester that falls behind its grants."""

    def __init__(self, stall_s: float) -> None:
        super().__init__()
        self.stall_s = stall_s

    def read(self, peer: str, segments: Sequence[Segment]) -> None:
        """Stall once, then read."""
        stall, self.stall_s = self.stall_s, 0.0
        time.sleep(stall)
        super().read(peer, segments)


def test_a_requester_that_falls_behind_cannot_bunch_its_grants(engines):
    cap = 40.0
    de = Engine(_capped(cap))
    pe = Engine(TrafficConfig(chunk_bytes=CHUNK), inner=SlowStart(0.25))
    engines.extend([de, pe])
    pe.knows(de)
    pe.pull(de, 8 * MB).result(5)  # 0.2 s of the NIC, behind a 0.25 s stall
    measured = peak_mb_s(pe.backend.events)
    assert measured <= 1.1 * cap, f"{measured:.1f} MB/s moved through a {cap:g} MB/s NIC"
    assert de.tm.metrics()["cnic_send_passive_bytes"] == 8 * MB


# --- lanes vs one FIFO on the pulled NIC ------------------------------------------------------


def _high_wait_s(engines: list[Engine], qos_lanes: bool) -> float:
    """Two peers pull a backlog from a capped engine; how long its small HIGH write waits."""
    cap = 40.0  # MB/s: the 2 × 4 MB backlog is 210 ms of the link
    hub = Engine(_capped(cap, qos_lanes=qos_lanes), mooncake=True)
    peers = [Engine(TrafficConfig(chunk_bytes=CHUNK), mooncake=True) for _ in range(2)]
    engines.extend([hub, *peers])
    for peer in peers:
        peer.knows(hub)
    backlog = [peer.pull(hub, 4 * MB) for peer in peers]
    deadline = time.monotonic() + 5
    while hub.tm.metrics()["cnic_send_queue_bytes"] < 6 * MB:  # the requests have arrived
        assert time.monotonic() < deadline, "the grant requests never reached the hub"
        time.sleep(0.002)
    start = time.monotonic()
    hub.tm.write(peers[0].endpoint, [(hub.addr, peers[0].addr + 7 * MB, 4 * KB)], Lane.HIGH)
    waited = time.monotonic() - start
    for f in backlog:
        f.result(10)
    return waited


def test_high_lane_overtakes_peers_backlog_only_with_qos_lanes(engines):
    lanes = _high_wait_s(engines, qos_lanes=True)
    fifo = _high_wait_s(engines, qos_lanes=False)
    print(f"HIGH write behind a 8 MB pulled backlog at 40 MB/s: lanes {lanes * 1e3:.1f} ms, "
          f"FIFO {fifo * 1e3:.1f} ms")
    # about a chunk (1.6 ms at 40 MB/s) and the threads' hand-offs (~25 ms on a starved CPU)
    assert lanes < 0.06
    assert fifo > 0.15  # behind most of the backlog (210 ms of the link)


# --- a busy peer is not a dead one ------------------------------------------------------------


def test_transfers_longer_than_the_timeout_complete_while_the_peer_is_alive(engines):
    de = Engine(_capped(10, grant_timeout_s=0.3))
    first, second = (Engine(TrafficConfig(chunk_bytes=CHUNK, grant_timeout_s=0.3))
                     for _ in range(2))
    engines.extend([de, first, second])
    first.knows(de)
    second.knows(de)
    start = time.monotonic()
    long = first.pull(de, 6 * MB)  # 0.6 s through a 10 MB/s NIC
    time.sleep(0.05)
    behind = second.pull(de, 1 * MB)  # no grant for 0.5 s: queued behind ``long``
    long.result(5)
    behind.result(5)
    assert time.monotonic() - start > 0.6
    assert first.tm.metrics()["grant_timeouts"] == second.tm.metrics()["grant_timeouts"] == 0


# --- dead, hung, closed and abandoned ---------------------------------------------------------


def test_silent_grant_server_fails_the_transfer_within_the_timeout(engines):
    pe = Engine(TrafficConfig(chunk_bytes=CHUNK, grant_timeout_s=0.4))
    engines.append(pe)
    ctx = zmq.Context.instance()
    mute = ctx.socket(zmq.ROUTER)  # takes requests, never answers
    mute.setsockopt(zmq.LINGER, 0)
    port = mute.bind_to_random_port("tcp://127.0.0.1")
    try:
        pe.tm.set_peer_nic("some-peer:1", f"tcp://127.0.0.1:{port}")
        start = time.monotonic()
        future = pe.tm.submit("read", "some-peer:1", [(pe.addr, 4096, 1 * MB)], Lane.KV_LOAD)
        with pytest.raises(TransferError, match="dead or hung"):
            future.result(5)
        assert 0.35 < time.monotonic() - start < 1.0
        assert pe.backend.events == []  # nothing moved
        assert pe.tm.metrics()["grant_timeouts"] == 1
        assert mute.poll(1000), "the request never reached the peer"
    finally:
        mute.close()


def test_closed_peer_fails_transfers_waiting_on_it_and_new_ones(engines):
    de = Engine(_capped(5, grant_timeout_s=0.4))
    pe = Engine(TrafficConfig(chunk_bytes=CHUNK, grant_timeout_s=0.4))
    engines.append(pe)
    pe.knows(de)
    waiting = pe.pull(de, 4 * MB)  # 0.8 s of the peer's NIC
    time.sleep(0.1)
    start = time.monotonic()
    de.close()
    with pytest.raises(TransferError, match="refused: closed"):
        waiting.result(5)
    assert time.monotonic() - start < 0.3  # refused at once, not timed out
    start = time.monotonic()
    with pytest.raises(TransferError, match="dead or hung"):
        pe.pull(de, MB).result(5)  # nobody listens any more
    assert time.monotonic() - start < 1.0


class Held(LocalBackend):
    """A local backend whose writes wait for a gate: a NIC direction that stops moving."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def write(self, peer: str, segments: Sequence[Segment]) -> None:
        """Wait for the gate, then write."""
        self.gate.wait(10)
        super().write(peer, segments)


def test_stalled_peer_dispatcher_fails_the_transfer(engines):
    held = Held()
    de = Engine(_capped(100, grant_timeout_s=0.3), inner=held)
    pe = Engine(TrafficConfig(chunk_bytes=CHUNK, grant_timeout_s=0.3))
    engines.extend([de, pe])
    pe.knows(de)
    stuck = de.tm.submit("write", pe.endpoint, [(de.addr, pe.addr, 1024)], Lane.HIGH)
    start = time.monotonic()
    with pytest.raises(TransferError, match="dead or hung"):
        pe.pull(de, MB).result(5)  # the server answers pings, flagged stalled
    assert time.monotonic() - start < 1.5
    held.gate.set()
    stuck.result(5)


@pytest.mark.parametrize("pings", [False, True], ids=["silent", "alive-but-stuck"])
def test_a_requester_that_never_moves_its_grants_is_dropped_and_told(engines, pings):
    de = Engine(_capped(20, grant_timeout_s=0.4))
    pe = Engine(TrafficConfig(chunk_bytes=CHUNK, grant_timeout_s=0.4))
    engines.extend([de, pe])
    ghost = zmq.Context.instance().socket(zmq.DEALER)  # asks, never moves, never pings
    ghost.setsockopt(zmq.LINGER, 0)
    ghost.connect(de.tm.nic_address)
    try:
        asked = 1600  # 100 MB: 5 s of the NIC
        ghost.send(msgpack.packb(["req", [[i, "send", "kv_load", CHUNK] for i in range(asked)]]))
        deadline = time.monotonic() + 2
        while de.tm.metrics()["cnic_send_queue_bytes"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        pe.knows(de)
        start = time.monotonic()
        pulled = pe.pull(de, MB)  # same lane, behind the ghost's requests
        while not pulled.done() and time.monotonic() - start < 5:
            if pings:  # alive: it keeps the NIC from taking it for dead
                ghost.send(msgpack.packb(["ping", 0]))
            time.sleep(0.05)
        pulled.result(0)
        assert time.monotonic() - start < 1.2  # not 5 s
        m = de.tm.metrics()
        assert m["cnic_dropped_grants"] > asked - 10
        assert m["cnic_send_passive_bytes"] < MB + 10 * CHUNK
        granted, refused = [], []
        while ghost.poll(500):
            kind, body = msgpack.unpackb(ghost.recv())
            if kind == "pong":
                continue
            (granted.extend(body) if kind == "go" else refused.extend(body[0]))
            assert kind in ("go", "refused") and (kind == "go" or "expired" in body[1])
        assert len(granted) == 2  # its credit (burst_chunks)
        assert sorted(granted + refused) == list(range(asked))
    finally:
        ghost.close()


def test_failed_transfer_cancels_its_outstanding_requests(engines):
    de = Engine(_capped(20, grant_timeout_s=2))
    first, second = (Engine(TrafficConfig(chunk_bytes=CHUNK, grant_timeout_s=2))
                     for _ in range(2))
    engines.extend([de, first, second])
    first.knows(de)
    second.knows(de)
    doomed = first.pull(de, 8 * MB)  # 0.4 s of the peer's NIC
    time.sleep(0.05)
    first.tm.forget_peer(de.endpoint)
    with pytest.raises(TransferError, match="forgotten"):
        doomed.result(1)
    time.sleep(0.02)  # the cancel reaches the peer
    start = time.monotonic()
    second.pull(de, 256 * KB).result(5)
    assert time.monotonic() - start < 0.1  # the cancelled backlog no longer holds the NIC
    assert de.tm.metrics()["cnic_send_passive_bytes"] < 4 * MB


def test_close_stops_the_threads_and_frees_the_grant_port():
    before = {t.ident for t in threading.enumerate()}
    de = Engine(_capped(20))
    pe = Engine(TrafficConfig(chunk_bytes=CHUNK))
    pe.knows(de)
    pe.pull(de, 256 * KB).result(5)
    address = de.tm.nic_address
    assert address is not None and address.startswith("tcp://127.0.0.1:")
    assert pe.tm.nic_address is None  # uncapped: no grant server
    pe.close()
    de.close()
    left = [t.name for t in threading.enumerate() if t.ident not in before]
    assert left == []
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    try:
        sock.bind(address)  # the port is free again
    finally:
        sock.close(linger=0)
