"""Several chunks in flight per NIC direction: the window, lane order at every pick, failures
that stay with their submission, byte counts once landed, stalls, and the poller's backoff."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial

import pytest

from dualpath.config import TrafficConfig
from dualpath.errors import TransferError
from dualpath.traffic.inflight import InFlightPoller
from dualpath.traffic.lanes import DEFAULT_LANE_WEIGHTS, Lane
from dualpath.traffic.manager import TrafficManager
from dualpath.traffic.queues import NicDirection
from dualpath.traffic.work import MoveWork, Submission
from dualpath.transfer.base import PendingTransfer, Segment, TransferBackend


def _until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


class Gate(PendingTransfer):
    """A started transfer that lands (or fails) when the test says so."""

    def __init__(self) -> None:
        self.outcome: bool | Exception = False

    def poll(self) -> bool:
        """False until ``land`` or ``fail``."""
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome

    def land(self) -> None:
        self.outcome = True

    def fail(self, why: str = "injected") -> None:
        self.outcome = TransferError(why)


class Deferred(TransferBackend):
    """A fake backend whose transfers start at once and land when their ``Gate`` opens (or at
    once, after ``land_all``)."""

    endpoint = "deferred"

    def __init__(self) -> None:
        self.started: list[tuple[int, Gate]] = []  # (first local address, its gate)
        self._lock = threading.Lock()
        self._open = False

    def register(self, address: int, nbytes: int) -> None:
        """Nothing to register."""

    def start_write(self, peer: str, segments: Sequence[Segment]) -> PendingTransfer:
        """Log the start; the transfer lands when its gate opens."""
        gate = Gate()
        with self._lock:
            self.started.append((segments[0][0], gate))
            if self._open:
                gate.land()
        return gate

    start_read = start_write

    def write(self, peer: str, segments: Sequence[Segment]) -> None:
        raise AssertionError("the traffic manager starts transfers, it does not wait in them")

    read = write

    def close(self) -> None:
        """Nothing to close."""

    def starts(self) -> list[int]:
        with self._lock:
            return [addr for addr, _ in self.started]

    def gate(self, addr: int) -> Gate:
        with self._lock:
            return next(g for a, g in self.started if a == addr)

    def land_all(self) -> None:
        """Land every transfer not settled yet, and later ones at once (a test ends)."""
        with self._lock:
            self._open = True
            for _, gate in self.started:
                if gate.outcome is False:
                    gate.land()


@contextmanager
def _manager(window: int) -> Iterator[tuple[Deferred, TrafficManager]]:
    """A traffic manager of 100-byte chunks over ``Deferred``; what is left lands at the end."""
    backend = Deferred()
    tm = TrafficManager(backend, TrafficConfig(chunk_bytes=100, inflight_chunks=window))
    try:
        yield backend, tm
    finally:
        backend.land_all()
        tm.close()


def test_a_direction_keeps_up_to_its_window_in_flight_and_counts_bytes_once_landed():
    with _manager(window=3) as (backend, tm):
        future = tm.submit("write", "peer", [(0, 0, 500)], Lane.KV_FORWARD)
        _until(lambda: len(backend.starts()) == 3)
        time.sleep(0.05)
        assert backend.starts() == [0, 100, 200]  # a full window: the rest waits
        assert tm.metrics()["cnic_send_bytes"] == 0  # nothing has landed yet
        backend.gate(100).land()
        _until(lambda: len(backend.starts()) == 4)
        assert backend.starts()[3] == 300 and not future.done()
        for addr in (0, 200, 300):
            backend.gate(addr).land()
        _until(lambda: len(backend.starts()) == 5)
        backend.gate(400).land()
        future.result(5)
        _until(lambda: tm.metrics()["cnic_send_bytes"] == 500)
    assert tm.metrics()["lane_bytes_kv_forward"] == 500


def test_each_free_slot_goes_to_the_lane_the_arbiter_picks_then():
    with _manager(window=2) as (backend, tm):
        kv = tm.submit("write", "peer", [(0, 0, 400)], Lane.KV_SAVE)
        _until(lambda: backend.starts() == [0, 100])
        high = tm.submit("write", "peer", [(1000, 0, 200)], Lane.HIGH)  # after the KV chunks
        time.sleep(0.05)
        backend.gate(0).land()
        _until(lambda: len(backend.starts()) == 3)
        backend.gate(100).land()
        _until(lambda: len(backend.starts()) == 4)
        assert backend.starts() == [0, 100, 1000, 1100]  # high first at each free slot
        for addr in (1000, 1100):
            backend.gate(addr).land()
        high.result(5)
        _until(lambda: len(backend.starts()) == 6)
        for addr in (200, 300):
            backend.gate(addr).land()
        kv.result(5)


def test_a_failed_chunk_in_flight_fails_only_its_submission():
    with _manager(window=2) as (backend, tm):
        bad = tm.submit("write", "peer", [(0, 0, 300)], Lane.KV_FORWARD)
        good = tm.submit("write", "peer", [(1000, 0, 100)], Lane.KV_FORWARD)
        _until(lambda: backend.starts() == [0, 100])
        backend.gate(0).fail("the peer went away")
        with pytest.raises(TransferError, match="the peer went away"):
            bad.result(5)
        _until(lambda: len(backend.starts()) == 3)
        backend.gate(100).land()  # the failed transfer's other chunk lands late: no effect
        backend.gate(1000).land()
        assert good.result(5) is None
        _until(lambda: tm.metrics()["cnic_send_bytes"] == 200)
    assert backend.starts() == [0, 100, 1000]  # the failed transfer's last chunk never started
    assert tm.metrics()["cnic_send_bytes"] == 200  # the failed chunk is not counted


def test_a_transfer_that_cannot_start_fails_its_future():
    class Refusing(Deferred):
        def start_write(self, peer: str, segments: Sequence[Segment]) -> PendingTransfer:
            raise RuntimeError("no route to peer")

    tm = TrafficManager(Refusing(), TrafficConfig(inflight_chunks=4))
    closer = threading.Thread(target=tm.close, daemon=True)
    try:
        failed = tm.submit("write", "peer", [(0, 0, 100)], Lane.HIGH)
        with pytest.raises(TransferError, match="no route to peer"):
            failed.result(5)
    finally:
        closer.start()
        closer.join(5)
    assert not closer.is_alive(), "the dispatcher died"


def test_a_granted_chunk_returns_its_grant_once_landed_not_once_started():
    sub = Submission(1)
    gate = Gate()
    released: list[bool] = []
    item = MoveWork(sub, Lane.KV_LOAD, 100, lambda: gate)
    item.release = partial(released.append, True)
    assert item.start() is None and item.poll() is None
    assert released == [] and not sub.future.done()
    gate.land()
    assert item.poll() is True
    assert released == [True] and sub.future.done()


def test_a_direction_whose_slots_are_all_stuck_is_stalled():
    now = [0.0]
    backend = Deferred()
    d = NicDirection("send", None, DEFAULT_LANE_WEIGHTS, clock=lambda: now[0], window=2)
    try:
        sub = Submission(3)
        items = [MoveWork(sub, Lane.KV_SAVE, 100, partial(backend.start_write, "p", [(a, 0, 100)]))
                 for a in (0, 100, 200)]
        d.put(items)
        _until(lambda: len(backend.starts()) == 2)
        now[0] = 10.0
        time.sleep(0.05)
        assert d.stalled(now[0], timeout_s=5.0)  # work waits behind two stuck transfers
        backend.gate(0).land()
        _until(lambda: len(backend.starts()) == 3)
        assert not d.stalled(now[0], timeout_s=5.0)
        for addr in (100, 200):
            backend.gate(addr).land()
        sub.future.result(5)
    finally:
        backend.land_all()
        d.close()
    assert d.inflight == 0


def test_close_waits_for_chunks_still_in_flight_after_their_submission_failed():
    with _manager(window=4) as (backend, tm):
        future = tm.submit("write", "peer", [(0, 0, 200)], Lane.KV_FORWARD)
        _until(lambda: len(backend.starts()) == 2)
        backend.gate(0).fail()
        with pytest.raises(TransferError):
            future.result(5)  # settled, with its second chunk still moving
        closer = threading.Thread(target=tm.close)
        closer.start()
        time.sleep(0.05)
        assert closer.is_alive()
        backend.gate(100).land()
        closer.join(5)
        assert not closer.is_alive()
        assert tm.metrics()["cnic_send_bytes"] == 100


def test_window_must_be_positive():
    with pytest.raises(ValueError, match="inflight_chunks"):
        TrafficConfig(inflight_chunks=0)
    with pytest.raises(ValueError, match="window"):
        NicDirection("send", None, DEFAULT_LANE_WEIGHTS, window=0)


def test_the_poller_checks_often_after_a_change_then_backs_off():
    poller = InFlightPoller("test", lambda item, moved: None)
    poller.poll_min_s, poller.poll_max_s, poller.fast_polls = 50e-6, 1e-3, 3
    sleeps = [poller._sleep_s(quiet) for quiet in range(12)]
    assert sleeps[:4] == [50e-6] * 4
    assert sleeps[4:7] == [100e-6, 200e-6, 400e-6]
    assert sleeps[8:] == [1e-3] * 4
    poller.close()  # never started: nothing to join
