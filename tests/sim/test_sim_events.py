"""The discrete-event loop and shared links."""

import pytest

from dualpath.sim.events import EventLoop
from dualpath.sim.links import Link, RateGroup


def test_events_run_in_time_then_fifo_order():
    loop, seen = EventLoop(), []
    loop.at(2.0, lambda: seen.append("b"))
    loop.at(1.0, lambda: seen.append("a"))
    loop.at(2.0, lambda: seen.append("c"))
    h = loop.at(1.5, lambda: seen.append("x"))
    h.cancel()
    assert loop.run() == 2.0
    assert seen == ["a", "b", "c"]


def test_run_until_and_past_event_rejected():
    loop, seen = EventLoop(), []
    loop.at(5.0, lambda: seen.append(1))
    assert loop.run(until=3.0) == 3.0 and not seen
    with pytest.raises(ValueError):
        loop.at(1.0, lambda: None)
    loop.run()
    assert seen == [1]


def _flows(starts):
    loop, link, done = EventLoop(), None, {}
    link = Link(loop, 100e6)
    for name, t, nbytes in starts:
        loop.at(t, lambda n=name, b=nbytes: link.transfer(b, lambda n=n: done.__setitem__(
            n, loop.now)))
    loop.run()
    return done, link


def test_one_flow_takes_size_over_bandwidth():
    done, link = _flows([("a", 0.0, 100e6)])
    assert done["a"] == pytest.approx(1.0)
    assert link.work_done == pytest.approx(100e6)


def test_two_equal_flows_share():
    done, _ = _flows([("a", 0.0, 100e6), ("b", 0.0, 100e6)])
    assert done["a"] == pytest.approx(2.0) and done["b"] == pytest.approx(2.0)


def test_late_flow():
    # a alone for 0.5 s (50 MB), then both at 50 MB/s: a's last 50 MB take 1 s more
    done, _ = _flows([("a", 0.0, 100e6), ("b", 0.5, 100e6)])
    assert done["a"] == pytest.approx(1.5)
    assert done["b"] == pytest.approx(2.0)


def test_rate_group_step_time_grows_with_batch():
    loop, done = EventLoop(), {}
    group = RateGroup(loop, lambda n: 0.01 * n)
    group.start(10, lambda: done.__setitem__("a", loop.now))
    group.start(20, lambda: done.__setitem__("b", loop.now))
    loop.run()
    assert done["a"] == pytest.approx(10 * 0.02)
    assert done["b"] == pytest.approx(0.2 + 10 * 0.01)


def test_lockstep_group_steps_at_the_busiest_member():
    from dualpath.sim.links import LockstepGroup

    loop, done = EventLoop(), {}
    group = LockstepGroup(loop, lambda n, tokens: 0.01 * n)
    group.start_for("x", 10, lambda: done.__setitem__("x1", loop.now))
    group.start_for("x", 10, lambda: done.__setitem__("x2", loop.now))
    group.start_for("y", 5, lambda: done.__setitem__("y", loop.now))
    assert group.max_batch == 2 and group.batch("y") == 1
    loop.run()
    # member x has 2 requests: every step takes 0.02 s for everyone until x empties
    assert done["y"] == pytest.approx(5 * 0.02)
    assert done["x1"] == pytest.approx(10 * 0.02)
    assert group.max_batch == 0
    with pytest.raises(ValueError):
        group.start(1, lambda: None)


def test_lockstep_group_steps_at_the_member_with_the_most_kv():
    from dualpath.sim.links import LockstepGroup

    loop, done = EventLoop(), {}
    group = LockstepGroup(loop, lambda n, tokens: 0.001 * n + 1e-6 * tokens)
    group.start_for("x", 10, lambda: done.__setitem__("x", loop.now), tokens=1000)
    group.start_for("y", 10, lambda: done.__setitem__("y", loop.now), tokens=1000)
    group.start_for("y", 4, lambda: done.__setitem__("y2", loop.now), tokens=0)
    group.start_for("z", 2, lambda: done.__setitem__("z", loop.now), tokens=30_000)
    assert group.max_batch == 1  # z: one request but 30K tokens is the slowest member
    assert group.step_s() == pytest.approx(0.001 + 0.03)
    loop.run()
    assert done["z"] == pytest.approx(2 * 0.031)
    # then y (2 requests, 1,000 tokens: 3 ms) sets the pace until its short request is done
    assert done["y2"] == pytest.approx(done["z"] + 2 * 0.003)
    assert done["x"] == pytest.approx(done["y2"] + 6 * 0.002)  # x moved 4 steps already
    assert group.max_batch == 0 and len(group._slowest) <= 64 + 4 * 3


def test_many_flows_finish_in_size_order_exactly():
    loop, link, done = EventLoop(), None, []
    link = Link(loop, 1.0)
    for size in (3.0, 1.0, 2.0):
        link.transfer(size, lambda s=size: done.append((s, loop.now)))
    loop.run()
    # 3 flows share: size 1 at t=3, then 2 share: size 2 at 3+2=5, then size 3 at 6
    assert done == [(1.0, pytest.approx(3.0)), (2.0, pytest.approx(5.0)),
                    (3.0, pytest.approx(6.0))]


# --- in-order links with QoS lanes (DRAM, compute NICs) ---


def test_pipe_link_serves_bookings_in_order():
    from dualpath.sim.links import PipeLink

    pipe = PipeLink(100.0)
    assert pipe.book(100.0, 0.0) == pytest.approx(1.0)
    assert pipe.book(50.0, 0.2) == pytest.approx(1.5)  # waits for the first
    assert pipe.book(100.0, 3.0) == pytest.approx(4.0)  # idle link: served at once
    assert pipe.book(0.0, 3.5) == 3.5  # nothing to move
    assert pipe.kv_bytes == pytest.approx(250.0)


def test_pipe_link_kv_gets_what_the_high_lane_leaves():
    from dualpath.sim.links import PipeLink
    from dualpath.traffic.lanes import DEFAULT_LANE_WEIGHTS, Lane

    pipe = PipeLink(100.0)
    pipe.high_bps = 30.0  # all-to-all of a running forward
    assert pipe.book(70.0, 0.0) == pytest.approx(1.0)
    pipe.high_bps = 1e9  # more than the link: the weights still give KV 1 share in 100
    assert pipe.kv_bps(Lane.KV_FORWARD) == pytest.approx(100.0 / 100)
    weights = {**DEFAULT_LANE_WEIGHTS, Lane.HIGH: 3, Lane.KV_LOAD: 1}
    fair = PipeLink(100.0, weights=weights)
    fair.high_demand = lambda: 1e9  # asked at each booking
    assert fair.book(25.0, 0.0) == pytest.approx(1.0)  # 1 share in 4
    with pytest.raises(ValueError, match="high lane"):
        pipe.book(1.0, 0.0, Lane.HIGH)
    with pytest.raises(ValueError, match="bandwidth"):
        PipeLink(0.0)


def test_duplex_nic_directions_are_independent():
    from dualpath.sim.links import DuplexNic

    nic = DuplexNic(10.0)
    assert nic.tx.book(10.0, 0.0) == pytest.approx(1.0)
    assert nic.rx.book(10.0, 0.0) == pytest.approx(1.0)
    nic.set_high_bps(5.0)
    assert nic.tx.book(5.0, 1.0) == pytest.approx(2.0) and nic.rx.high_bps == 5.0


def test_when_runs_now_or_later():
    loop, seen = EventLoop(), []
    loop.at(1.0, lambda: loop.when(0.5, lambda: seen.append(("past", loop.now))))
    loop.at(1.0, lambda: loop.when(2.0, lambda: seen.append(("later", loop.now))))
    processed = loop.run()
    assert seen == [("past", 1.0), ("later", 2.0)] and processed == 2.0
    assert loop.processed == 3  # the past one ran inline, without an event of its own
