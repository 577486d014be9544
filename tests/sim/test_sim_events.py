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
