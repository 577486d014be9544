"""Links whose bandwidth is shared equally by the flows on them (processor sharing).

A :class:`Link` of ``bandwidth`` bytes/s carrying n flows gives each ``bandwidth / n``. Every
item on a shared resource progresses at the same per-item rate, so the resource keeps one
*virtual progress* counter ``v`` (work each item has received since the resource began) and a
heap of ``(v at which the item is served, id)``: starting or finishing an item costs
O(log n) and completion times are exact for this model. Only the next completion is
scheduled; as adding an item can only slow the others down, that event may fire early (it
then re-arms itself) but never late, so most starts need not move it.

:class:`RateGroup` is the same idea for work that progresses at a common rate set by the
group's size (a decode engine: every running request advances one token per step, and the
step time grows with the batch). :class:`LockstepGroup` is a rate group spread over several
members that step together (the decode engines of one EP group: each step lasts as long as
the busiest member's step).

:class:`PipeLink` serves the hops that are rarely the bottleneck (a node's DRAM, each
direction of a compute NIC) in booking order: a booking's finish time is fixed when it is
made, so a hop costs no event of its own and the caller waits only for the latest finish of
a transfer's hops. Its lanes follow :mod:`dualpath.traffic.lanes`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Mapping

from dualpath.sim.events import EventHandle, EventLoop
from dualpath.traffic.lanes import DEFAULT_LANE_WEIGHTS, Lane, validate_weights

_EPS = 1e-9


class _Shared:
    """Items with remaining work progressing at ``per_item_rate(n)`` each; exact completions."""

    def __init__(self, loop: EventLoop, name: str) -> None:
        self.loop = loop
        self.name = name
        self._v = 0.0  # work each present item has received since the resource began
        self._heap: list[tuple[float, int]] = []
        self._done: dict[int, Callable[[], None]] = {}
        self._last = 0.0
        self._next: EventHandle | None = None
        self._ids = 0
        self.work_done = 0.0  # total work served (bytes or steps)
        self.busy_time = 0.0

    def per_item_rate(self, n: int) -> float:
        """Rate each of ``n`` concurrent items progresses at."""
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self._done)

    def _advance(self) -> None:
        now = self.loop.now
        dt = now - self._last
        n = len(self._done)
        if dt > 0 and n:
            served = dt * self.per_item_rate(n)
            self._v += served
            self.work_done += served * n
            self.busy_time += dt
        self._last = now

    def start(self, amount: float, on_done: Callable[[], None]) -> int:
        """Add an item of ``amount`` work; ``on_done`` runs when it is served. Its id."""
        self._advance()
        key = self._ids
        self._ids += 1
        if amount <= 0:
            self.loop.after(0.0, on_done)
            return key
        self._added(key)
        target = self._v + float(amount)
        heapq.heappush(self._heap, (target, key))
        self._done[key] = on_done
        # Adding an item never speeds the others up, so a pending completion event can only
        # be early, never late (it re-checks when it fires); move it only if the new item
        # would finish before it.
        if (self._next is None or (self._heap[0][1] == key
                and self.loop.now + amount / self.per_item_rate(len(self._done))
                < self._next.time)):
            self._reschedule()
        return key

    def _added(self, key: int) -> None:
        """Hook: item ``key`` joins (before the rate is next evaluated)."""

    def _removed(self, key: int) -> None:
        """Hook: item ``key`` was served."""

    def _reschedule(self) -> None:
        if self._next is not None:
            self._next.cancel()
            self._next = None
        if not self._heap:
            return
        rate = self.per_item_rate(len(self._done))
        left = self._heap[0][0] - self._v
        self._next = self.loop.after((left if left > 0.0 else 0.0) / rate,
                                     self._complete)

    def _complete(self) -> None:
        self._next = None
        self._advance()
        callbacks = []
        heap = self._heap
        while heap and heap[0][0] - self._v <= _EPS * (heap[0][0] if heap[0][0] > 1.0 else 1.0):
            _, key = heapq.heappop(heap)
            self._removed(key)
            callbacks.append(self._done.pop(key))
        self._reschedule()  # also when the event was early (items were added since)
        for callback in callbacks:
            callback()

    def served(self) -> float:
        """Total work served so far (up to date at the current time)."""
        self._advance()
        return self.work_done


class Link(_Shared):
    """A link of ``bandwidth`` bytes/s shared equally by its flows."""

    def __init__(self, loop: EventLoop, bandwidth: float, name: str = "link") -> None:
        if bandwidth <= 0:
            raise ValueError("bandwidth must be > 0")
        super().__init__(loop, name)
        self.bandwidth = float(bandwidth)

    def per_item_rate(self, n: int) -> float:
        """Fair share: ``bandwidth / n``."""
        return self.bandwidth / n

    def transfer(self, nbytes: float, on_done: Callable[[], None]) -> int:
        """Start a flow of ``nbytes``; ``on_done`` runs when its last byte arrives."""
        return self.start(nbytes, on_done)


class RateGroup(_Shared):
    """Items that all advance at ``1 / step_time(n)`` units/s while ``n`` are running."""

    def __init__(self, loop: EventLoop, step_time: Callable[[int], float],
                 name: str = "group") -> None:
        super().__init__(loop, name)
        self.step_time = step_time

    def per_item_rate(self, n: int) -> float:
        """Every item gets one unit per step."""
        return 1.0 / self.step_time(n)


class LockstepGroup(_Shared):
    """Members that step together: a step lasts as long as the slowest member's step.

    Each item belongs to a member (one decode engine) and carries its KV tokens; every item
    advances one unit per step. A member's step time is ``step_time(items, tokens)`` of its
    running items; the slowest member is found through a lazy max-heap (O(log n) per change).
    """

    def __init__(self, loop: EventLoop, step_time: Callable[[int, float], float],
                 name: str = "lockstep") -> None:
        super().__init__(loop, name)
        self.step_time = step_time
        self._item: dict[int, tuple[Hashable, float]] = {}  # key -> (member, tokens)
        self._load: dict[Hashable, tuple[int, float]] = {}  # member -> (items, tokens)
        self._stamp: dict[Hashable, int] = {}
        self._slowest: list[tuple[float, int, Hashable]] = []  # (-step, stamp, member)
        self._stamps = 0
        self._pending: tuple[Hashable, float] | None = None
        self._step: float | None = None  # cached step_s(); None once a member changed

    def batch(self, member: Hashable) -> int:
        """Running items of ``member``."""
        return self._load.get(member, (0, 0.0))[0]

    @property
    def max_batch(self) -> int:
        """Running items of the slowest member."""
        top = self._top()
        return 0 if top is None else self._load[top][0]

    def step_s(self) -> float:
        """The group's current step time (the slowest member's)."""
        if self._step is None:
            top = self._top()
            self._step = self.step_time(1, 0.0) if top is None else -self._slowest[0][0]
        return self._step

    def per_item_rate(self, n: int) -> float:
        """One unit per step of the slowest member."""
        return 1.0 / self.step_s()

    def start_for(self, member: Hashable, amount: float, on_done: Callable[[], None],
                  tokens: float = 0.0) -> int:
        """Add ``amount`` steps of work for one of ``member``'s requests (``tokens`` of KV)."""
        self._pending = (member, float(tokens))
        try:
            return self.start(amount, on_done)
        finally:
            self._pending = None

    def _top(self) -> Hashable:
        heap = self._slowest
        while heap and self._stamp.get(heap[0][2]) != heap[0][1]:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def _move(self, member: Hashable, items: int, tokens: float) -> None:
        self._step = None
        old_items, old_tokens = self._load.get(member, (0, 0.0))
        items, tokens = old_items + items, old_tokens + tokens
        self._stamps += 1
        if items:
            self._load[member] = (items, tokens)
            self._stamp[member] = self._stamps
            heapq.heappush(self._slowest,
                           (-self.step_time(items, tokens), self._stamps, member))
        else:
            self._load.pop(member, None)
            self._stamp.pop(member, None)
        if len(self._slowest) > 4 * len(self._load) + 64:  # drop the stale entries
            self._slowest = [(-self.step_time(*self._load[m]), self._stamp[m], m)
                             for m in self._load]
            heapq.heapify(self._slowest)

    def _added(self, key: int) -> None:
        if self._pending is None:
            raise ValueError("LockstepGroup items need a member: use start_for()")
        self._item[key] = self._pending
        self._move(self._pending[0], +1, self._pending[1])

    def _removed(self, key: int) -> None:
        member, tokens = self._item.pop(key)
        self._move(member, -1, -tokens)


class PipeLink:
    """A link of ``bandwidth`` bytes/s that serves KV bookings in the order they are made.

    In-order service gives the link's throughput exactly (a link that is the bottleneck
    queues its bookings; one that is not serves each at once) without an event per hop, at
    the price of per-flow fairness: a later booking waits for the earlier ones instead of
    sharing with them. Pure: the time is an argument.

    Lanes (the QoS of :mod:`dualpath.traffic.lanes`): the high lane carries latency-critical
    traffic (EP all-to-all) at ``high_bps`` bytes/s — set by the caller while a forward runs,
    or asked of ``high_demand`` when set. Weighted round robin gives it what it asks for, up
    to ``w_high / (w_high + w_lane)`` of the link while a KV lane is busy too, and a KV
    booking gets the rest as it is when the booking is made.
    """

    def __init__(self, bandwidth: float, name: str = "pipe",
                 weights: Mapping[Lane, int] = DEFAULT_LANE_WEIGHTS) -> None:
        if bandwidth <= 0:
            raise ValueError(f"{name}: bandwidth must be > 0, got {bandwidth}")
        self.bandwidth = float(bandwidth)
        self.name = name
        self.weights = validate_weights(weights)
        w_high = self.weights[Lane.HIGH]
        self._high_cap = {lane: self.bandwidth * w_high / (w_high + w)
                          for lane, w in self.weights.items() if lane is not Lane.HIGH}
        self.free_at = 0.0  # when the last booking made so far finishes
        self.kv_bytes = 0.0  # bytes booked on the KV lanes
        self.high_bps = 0.0
        self.high_demand: Callable[[], float] | None = None

    def kv_bps(self, lane: Lane = Lane.KV_LOAD) -> float:
        """What a booking on ``lane`` gets now: the link less the high lane's share."""
        try:
            cap = self._high_cap[lane]
        except KeyError:
            raise ValueError(f"{self.name}: book KV lanes only, not {lane!r} (the high lane "
                             "is a demand: high_bps)") from None
        high = self.high_bps if self.high_demand is None else self.high_demand()
        return self.bandwidth - (high if high < cap else cap)

    def book(self, nbytes: float, now: float, lane: Lane = Lane.KV_LOAD) -> float:
        """Serve ``nbytes`` on ``lane`` after the bookings made before; when it finishes."""
        rate = self.kv_bps(lane)
        if nbytes <= 0:
            return now
        begin = now if now > self.free_at else self.free_at
        self.free_at = begin + nbytes / rate
        self.kv_bytes += nbytes
        return self.free_at


class DuplexNic:
    """A full-duplex compute NIC seen from PCIe (docs/paper.md §3.3): ``tx`` reads host or GPU
    memory (it sends, and it is the first half of a loopback copy), ``rx`` writes memory (it
    receives, and it is the second half of a loopback copy); ``bandwidth`` each way. EP
    all-to-all asks the same of both (balanced dispatch and combine)."""

    def __init__(self, bandwidth: float, name: str = "cnic",
                 weights: Mapping[Lane, int] = DEFAULT_LANE_WEIGHTS) -> None:
        self.tx = PipeLink(bandwidth, f"{name}.tx", weights)
        self.rx = PipeLink(bandwidth, f"{name}.rx", weights)

    def set_high_bps(self, bps: float) -> None:
        """The all-to-all demand from now on (bytes/s each way; 0 when idle)."""
        self.tx.high_bps = self.rx.high_bps = bps

    def set_high_demand(self, demand: Callable[[], float]) -> None:
        """Ask ``demand()`` for the all-to-all demand at each booking instead."""
        self.tx.high_demand = self.rx.high_demand = demand
