"""The EP traffic generator over in-process backends and real traffic managers: shares land in
the peers' buffers on the high lane, split evenly; no peers, no traffic; a dead or hung peer is
counted and left out, never a failed or hung step."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence

import pytest

from dualpath.config import TrafficConfig
from dualpath.traffic.ep import (
    EP_BUFFER_MAX_BYTES,
    EpPeer,
    EpTraffic,
    ep_buffer_bytes,
    ep_metrics_off,
)
from dualpath.traffic.lanes import Lane
from dualpath.traffic.manager import TrafficManager
from dualpath.transfer.base import Segment
from dualpath.transfer.local import LocalBackend


class HangingBackend(LocalBackend):
    """A local backend whose writes to the peers in ``hang`` block until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.hang: set[str] = set()
        self.release = threading.Event()

    def write(self, peer: str, segments: Sequence[Segment]) -> None:
        if peer in self.hang:
            self.release.wait(30)
        super().write(peer, segments)


class Group:
    """Engines of one EP group: a backend, a traffic manager and an EpTraffic each."""

    def __init__(self, n: int, bytes_per_token: int = 1000, max_step_tokens: int = 64,
                 timeout_s: float = 5.0, backend: type[LocalBackend] = LocalBackend,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.backends = [backend() for _ in range(n)]
        self.traffic = [TrafficManager(b, TrafficConfig()) for b in self.backends]
        self.ep = [EpTraffic(t, bytes_per_token, max_step_tokens, timeout_s=timeout_s,
                             retry_s=10.0, clock=clock) for t in self.traffic]

    def peer(self, i: int) -> EpPeer:
        ep = self.ep[i]
        return EpPeer(f"e{i}", self.backends[i].endpoint, ep.buffer_addr, ep.buffer_bytes)

    def connect(self) -> None:
        """Every engine learns every other one."""
        for i, ep in enumerate(self.ep):
            ep.set_peers(self.peer(j) for j in range(len(self.ep)) if j != i)

    def close(self) -> None:
        for backend in self.backends:
            if isinstance(backend, HangingBackend):
                backend.release.set()
        for traffic in self.traffic:
            traffic.close()
        for backend in self.backends:
            backend.close()


@pytest.fixture
def group() -> Iterator[Group]:
    made: list[Group] = []

    def make(*args, **kwargs) -> Group:
        made.append(Group(*args, **kwargs))
        return made[-1]

    yield make  # type: ignore[misc]
    for g in made:
        g.close()


def landed(ep: EpTraffic, value: int) -> int:
    """Bytes of ``ep``'s buffer equal to ``value``."""
    return bytes(ep.view()).count(bytes([value]))


def test_an_exchange_writes_each_peers_share_into_its_buffer_on_the_high_lane(group):
    g = group(3)
    sender, b, c = g.ep
    sender.view()[:] = b"\xab" * sender.buffer_bytes
    sender.set_peers([g.peer(1), g.peer(2)])
    assert sender.exchange(10) == 10 * 1000
    assert landed(b, 0xAB) == 5000 and landed(c, 0xAB) == 5000
    assert bytes(b.view()[:5000]) == b"\xab" * 5000  # from the start of the peer's buffer
    lanes = g.traffic[0].metrics()
    assert lanes["lane_bytes_high"] == 10_000
    assert all(lanes[f"lane_bytes_{lane.value}"] == 0 for lane in Lane if lane is not Lane.HIGH)
    m = sender.metrics()
    assert (m["ep_bytes_sent"], m["ep_exchanges"], m["ep_tokens"]) == (10_000, 1, 10)
    assert m["ep_failed_exchanges"] == 0 and m["ep_peers"] == 2 and m["ep_wait_s_total"] > 0
    assert g.traffic[1].metrics()["lane_bytes_high"] == 0  # the receivers sent nothing


def test_the_split_is_even_to_the_byte(group):
    g = group(4, bytes_per_token=1001)
    for i, ep in enumerate(g.ep):
        ep.view()[:] = bytes([i + 1]) * ep.buffer_bytes
    g.ep[0].set_peers([g.peer(1), g.peer(2), g.peer(3)])
    assert g.ep[0].exchange(10) == 10_010
    assert sorted(landed(g.ep[i], 1) for i in (1, 2, 3)) == [3336, 3337, 3337]
    assert g.traffic[0].metrics()["lane_bytes_high"] == 10_010


def test_every_engine_of_a_group_sends_to_every_other(group):
    g = group(3)
    g.connect()
    for ep in g.ep:
        assert ep.exchange(8) == 8000
    assert [t.metrics()["lane_bytes_high"] for t in g.traffic] == [8000] * 3


def test_no_peers_or_no_tokens_means_no_traffic(group):
    g = group(2)
    alone, other = g.ep
    assert alone.exchange(50) == 0
    alone.set_peers([g.peer(1)])
    assert alone.exchange(0) == 0
    alone.set_peers([])
    assert alone.exchange(50) == 0
    assert g.traffic[0].metrics()["lane_bytes_high"] == 0
    assert alone.metrics() == ep_metrics_off()
    assert landed(other, 0) == other.buffer_bytes


def test_a_share_larger_than_the_buffers_wraps_around_them(group):
    g = group(2, bytes_per_token=4096, max_step_tokens=1)  # 4 KiB buffers
    assert g.ep[0].buffer_bytes == 4096
    g.ep[0].view()[:] = b"\x07" * 4096
    g.ep[0].set_peers([g.peer(1)])
    assert g.ep[0].exchange(5) == 5 * 4096
    assert g.traffic[0].metrics()["lane_bytes_high"] == 5 * 4096
    assert landed(g.ep[1], 7) == 4096


def test_a_dead_peer_is_skipped_and_counted_and_tried_again_later(group):
    now = [0.0]
    g = group(3, clock=lambda: now[0])
    sender = g.ep[0]
    sender.set_peers([g.peer(1), g.peer(2)])
    g.backends[2].close()  # the engine died: its endpoint is gone
    assert sender.exchange(10) == 5000  # the live peer's share
    assert sender.metrics()["ep_failed_exchanges"] == 1 and sender.peers == ("e1",)
    now[0] = 9.0
    assert sender.exchange(10) == 10_000  # the benched peer is left out: all to the live one
    assert sender.metrics()["ep_failed_exchanges"] == 1
    now[0] = 10.0  # its bench is over: tried again, fails again, counted
    assert sender.exchange(10) == 5000
    assert sender.metrics()["ep_failed_exchanges"] == 2
    sender.set_peers([g.peer(1)])  # the router says it is gone
    now[0] = 30.0
    assert sender.peers == ("e1",) and sender.exchange(10) == 10_000
    assert g.traffic[0].metrics()["lane_bytes_high"] == 5000 + 10_000 + 5000 + 10_000


def test_a_peer_that_does_not_answer_costs_one_bounded_wait_not_a_hung_step(group):
    g = group(3, timeout_s=0.3, backend=HangingBackend)
    sender, hung = g.ep[0], g.backends[0]
    hung.hang.add(g.backends[2].endpoint)
    sender.set_peers([g.peer(1), g.peer(2)])  # the live one's chunk goes first
    started = time.monotonic()
    assert sender.exchange(10) == 5000
    assert 0.3 <= time.monotonic() - started < 2.0
    assert sender.metrics()["ep_failed_exchanges"] == 1 and sender.peers == ("e1",)
    hung.release.set()


def test_a_rejoined_peer_is_tried_at_once_and_peers_without_a_buffer_are_left_out(group):
    g = group(3)
    sender = g.ep[0]
    sender.set_peers([g.peer(1), g.peer(2)])
    g.backends[2].close()
    sender.exchange(10)  # fails: benched
    assert sender.peers == ("e1",)
    sender.set_peers([g.peer(1), g.peer(2)])  # the same entries: still benched
    assert sender.peers == ("e1",)
    back = LocalBackend()  # the engine came back with a new endpoint
    g.backends.append(back)
    back.register(g.ep[2].buffer_addr, g.ep[2].buffer_bytes)
    rejoined = EpPeer("e2", back.endpoint, g.ep[2].buffer_addr, g.ep[2].buffer_bytes)
    sender.set_peers([g.peer(1), rejoined, EpPeer("e9", "nowhere", 0, 0)])
    assert sender.peers == ("e1", "e2")
    assert sender.exchange(10) == 10_000  # both shares arrived
    assert sender.metrics()["ep_failed_exchanges"] == 1


def test_the_buffer_is_sized_for_the_largest_step_and_bounded():
    assert ep_buffer_bytes(1000, 64) == 65_536  # 64,000 rounded up to 4 KiB
    assert ep_buffer_bytes(1 << 20, 4096) == EP_BUFFER_MAX_BYTES
    with pytest.raises(ValueError, match="must be > 0"):
        ep_buffer_bytes(0, 64)
