"""A capped NIC direction shares its emulated wire packet by packet: a high-lane item that
arrives while a lower lane's item waits out its pacing goes first (that item goes back to the
head of its lane, refunded); one FIFO cannot reorder."""

from __future__ import annotations

import threading
import time

import pytest

from dualpath.traffic.lanes import Lane
from dualpath.traffic.queues import NicDirection
from dualpath.traffic.token_bucket import TokenBucket
from dualpath.traffic.work import Work

RATE_BYTES_S = 1e6  # 100 KB takes 0.1 s
WEIGHTS = {Lane.HIGH: 99, Lane.KV_LOAD: 1, Lane.KV_FORWARD: 1, Lane.KV_SAVE: 1}


class _Item(Work):
    """Records when it ran."""

    kind = "active"

    def __init__(self, name: str, lane: Lane, nbytes: int, log: list[tuple[str, float]]) -> None:
        super().__init__(lane, nbytes)
        self.name, self.log, self.ran = name, log, threading.Event()

    def run(self) -> bool:
        self.log.append((self.name, time.monotonic()))
        self.ran.set()
        return True


def _direction(qos_lanes: bool) -> NicDirection:
    # no burst: the first item already waits out its own bytes
    return NicDirection("send", TokenBucket(RATE_BYTES_S, 0.0), WEIGHTS, qos_lanes=qos_lanes)


@pytest.mark.parametrize("qos_lanes", [True, False])
def test_high_item_arriving_during_a_kv_items_pacing(qos_lanes):
    log: list[tuple[str, float]] = []
    nic = _direction(qos_lanes)
    try:
        kv = _Item("kv", Lane.KV_LOAD, 200_000, log)  # paced for 0.2 s
        high = _Item("high", Lane.HIGH, 10_000, log)  # 0.01 s of wire
        began = time.monotonic()
        nic.put([kv])
        time.sleep(0.05)  # the KV item is waiting out its pacing now
        nic.put([high])
        assert kv.ran.wait(5) and high.ran.wait(5)
    finally:
        nic.close()
    order = [name for name, _ in log]
    ran_at = {name: at - began for name, at in log}
    if qos_lanes:
        assert order == ["high", "kv"]
        assert ran_at["high"] < 0.15  # not after the KV item's 0.2 s
        assert ran_at["kv"] > 0.2  # the KV item then paid its bytes after the high one's
        assert nic.num_preempted == 1
    else:
        assert order == ["kv", "high"]  # a FIFO waits
        assert ran_at["high"] >= 0.2
        assert nic.num_preempted == 0
    total = sum(nic.bytes["active"].values())
    assert total == 210_000  # a preempted item is charged once, when it runs


def test_a_preempted_item_keeps_the_pacing_it_had_waited_out():
    """No wire time is lost to a preemption: the KV item runs once its own bytes and the high
    item's have had their time (0.41 s), not after a fresh full wait (0.61 s)."""
    log: list[tuple[str, float]] = []
    nic = _direction(True)
    try:
        kv = _Item("kv", Lane.KV_LOAD, 400_000, log)  # paced for 0.4 s
        high = _Item("high", Lane.HIGH, 10_000, log)
        began = time.monotonic()
        nic.put([kv])
        time.sleep(0.2)  # half of the KV item's bytes had their wire time
        nic.put([high])
        assert kv.ran.wait(5) and high.ran.wait(5)
    finally:
        nic.close()
    ran_at = {name: at - began for name, at in log}
    assert nic.num_preempted == 1
    assert 0.2 < ran_at["high"] < 0.3  # its own 0.01 s after it came
    assert 0.4 < ran_at["kv"] < 0.53
    assert kv.paid_bytes == pytest.approx(200_000, abs=30_000)


def test_a_high_item_that_is_not_ready_does_not_preempt():
    class _Waiting(_Item):
        def ready(self) -> bool:
            return False

    log: list[tuple[str, float]] = []
    nic = _direction(True)
    try:
        kv = _Item("kv", Lane.KV_LOAD, 100_000, log)
        nic.put([kv])
        time.sleep(0.02)
        nic.put([_Waiting("high", Lane.HIGH, 10_000, log)])
        assert kv.ran.wait(5)
        assert nic.num_preempted == 0
    finally:
        with nic.cond:  # let close() drain: drop the item that never becomes ready
            nic._queues[Lane.HIGH].clear()
            nic.queued_bytes = 0
        nic.close()


def test_refund_gives_back_a_reservation_up_to_the_burst():
    bucket = TokenBucket(rate_bytes_s=100.0, burst_bytes=50.0)
    assert bucket.reserve(150, 0.0) == pytest.approx(1.0)  # 50 - 150 = -100 tokens
    bucket.refund(150)
    assert bucket.reserve(50, 0.0) == 0.0  # back to 50
    bucket.refund(500)
    assert bucket.state[0] == 50.0  # never above the burst


def test_a_lower_lane_keeps_its_weighted_turns_while_high_items_wait():
    """Items queued together: the arbiter's turns for the KV lane are kept, not preempted, so
    a backlogged high lane cannot starve it."""
    log: list[tuple[str, float]] = []
    nic = NicDirection("send", TokenBucket(RATE_BYTES_S, 0.0),
                       {Lane.HIGH: 3, Lane.KV_LOAD: 1, Lane.KV_FORWARD: 1, Lane.KV_SAVE: 1})
    try:
        items = [_Item(f"high{i}", Lane.HIGH, 5_000, log) for i in range(8)]
        items += [_Item(f"kv{i}", Lane.KV_LOAD, 5_000, log) for i in range(2)]
        nic.put(items)
        assert all(item.ran.wait(5) for item in items)
    finally:
        nic.close()
    order = [name for name, _ in log]
    assert nic.num_preempted == 0
    assert order.index("kv0") < order.index("high7")  # its turn came amid the high items
