"""One direction of an engine's compute NIC: lane queues, arbiter, cap, counters, dispatcher.

A ``NicDirection`` (the send side or the receive side) holds ``Work`` items of at most
``chunk_bytes`` each, of three kinds: ``active`` (a chunk of a transfer this engine started),
``passive`` (a peer's grant request: the peer moves the bytes by a one-sided operation, this NIC
is charged for them) and ``copy`` (a piece of a host↔device copy). One dispatcher thread picks
the next item — by smooth weighted round robin over the backlogged lanes, or in arrival order
over all lanes when QoS lanes are off — paces it through the direction's token bucket when the
NIC is capped, starts it, and counts its bytes per kind and lane once it has finished. It also
tracks the most bytes charged in any 100 ms window.

Up to ``window`` items are in flight at once: an item whose ``start`` returns before its bytes
have moved (a transfer through a backend with an asynchronous API) is polled by an
``InFlightPoller`` while the dispatcher starts the next ones; the dispatcher picks an item only
when a slot is free, so the lanes' order is kept at every pick and a high-lane item waits for
at most one slot. CUDA copies are polled on their copy-stream event the same way; host copies
and grant requests finish inside ``start`` (no slot held after).

With lanes, a high-lane item that arrives while a lower lane's item waits out its pacing goes
first (one that was already waiting when the arbiter gave the lower lane its weighted turn
does not): the waiting item goes back to the head of its lane, keeping the part of its pacing
it has waited out (those bytes had their wire time) and refunding the rest, and the high item
then waits out its own bytes. So the emulated wire is shared as a NIC's virtual lanes share it,
packet by packet, rather than a whole chunk at a time, and no wire time is lost to the
switch (one FIFO cannot reorder, so it waits).

An item that is not ``ready`` (a grant request whose requester already holds all the grants it
may hold) keeps the head of its lane: with lanes, the other lanes go on; with one FIFO, the
NIC waits for it, as a work queue does. Items whose owner gave up are dropped uncharged.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Literal

from dualpath.errors import TransferError
from dualpath.traffic.inflight import InFlightPoller
from dualpath.traffic.lanes import Lane, LaneArbiter
from dualpath.traffic.token_bucket import TokenBucket
from dualpath.traffic.work import WORK_KINDS, Work, WorkKind

NicSide = Literal["send", "recv"]
PEAK_WINDOW_S = 0.1


class PeakWindow:
    """The most bytes charged in any window of ``window_s`` seconds (exact, sliding)."""

    def __init__(self, window_s: float = PEAK_WINDOW_S) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()
        self._sum = 0
        self.peak_bytes = 0

    def add(self, now_s: float, nbytes: int) -> None:
        """Charge ``nbytes`` at ``now_s`` (times must not go backwards)."""
        events = self._events
        events.append((now_s, nbytes))
        total = self._sum + nbytes
        cutoff = now_s - self.window_s
        while events[0][0] <= cutoff:
            total -= events.popleft()[1]
        self._sum = total
        if total > self.peak_bytes:
            self.peak_bytes = total


class NicDirection:
    """One direction of the compute NIC with its dispatcher thread (the copy thread too).

    ``window``: how many items may be in flight at once (at least 1).
    """

    def __init__(self, side: NicSide, bucket: TokenBucket | None, weights: Mapping[Lane, int],
                 qos_lanes: bool = True, clock: Callable[[], float] = time.monotonic,
                 recheck_s: float = 0.05, window: int = 1) -> None:
        if window < 1:
            raise ValueError(f"a NIC direction's window must be >= 1, got {window}")
        self.side = side
        self.window = window
        self.inflight = 0  # items started and not finished yet
        self._poller = InFlightPoller(f"traffic-{side}-poll", self._finished)
        self.bucket = bucket  # touched only by the dispatcher thread
        self._clock = clock
        self._recheck_s = recheck_s  # how often a lane whose head is not ready is re-checked
        self._arbiter = LaneArbiter(weights) if qos_lanes else None
        self._queues: dict[Lane, deque[Work]] = {lane: deque() for lane in Lane}
        self._fifo: deque[Work] = deque()
        self.cond = threading.Condition()
        self.bytes: dict[WorkKind, dict[Lane, int]] = {k: dict.fromkeys(Lane, 0)
                                                       for k in WORK_KINDS}
        self.dropped: dict[WorkKind, int] = dict.fromkeys(WORK_KINDS, 0)
        self.peak = PeakWindow()
        self.queued_bytes = 0
        self.num_preempted = 0  # lower-lane items sent back for a high-lane one
        self.progress_s = clock()  # last time the dispatcher looked at its queues
        self.closed = False
        self._thread = threading.Thread(target=self._dispatch, daemon=True,
                                        name=f"traffic-{side}")
        self._thread.start()

    def put(self, items: Iterable[Work]) -> None:
        """Queue items in order; ``TransferError`` once the direction is closed."""
        with self.cond:
            if self.closed:
                raise TransferError(f"the compute NIC's {self.side} side is closed")
            if self.queued_bytes == 0:
                self.progress_s = self._clock()
            for item in items:
                (self._queues[item.lane] if self._arbiter is not None
                 else self._fifo).append(item)
                self.queued_bytes += item.nbytes
            self.cond.notify()

    def wake(self) -> None:
        """Re-check the heads of the lanes (an item may have become ready)."""
        with self.cond:
            self.cond.notify()

    def stalled(self, now_s: float, timeout_s: float) -> bool:
        """True if work waits and the dispatcher has not looked at it for ``timeout_s``."""
        return self.queued_bytes > 0 and now_s - self.progress_s > timeout_s

    def total_bytes(self, kind: WorkKind | None = None) -> int:
        """Bytes counted (of one kind, or all), every lane together."""
        kinds = WORK_KINDS if kind is None else (kind,)
        return sum(sum(self.bytes[k].values()) for k in kinds)

    def close(self) -> None:
        """Let the dispatcher drain what is queued, then stop it."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()

    # --- the dispatcher -----------------------------------------------------------------------

    def _dispatch(self) -> None:
        """Pick, pace, start, count; until closed, drained and nothing is in flight."""
        while (item := self._next()) is not None:
            if self.bucket is not None and not self._paced(item):
                continue  # a high-lane item came first: ``item`` is back in its lane
            charged_s = self._clock()
            moved = item.start()
            with self.cond:
                self.peak.add(charged_s, item.nbytes)
                if moved is None:
                    self.inflight += 1
                elif moved:
                    self.bytes[item.kind][item.lane] += item.nbytes
            if moved is None:
                self._poller.add(item)
        with self.cond:
            while self.inflight:
                self.cond.wait()
        self._poller.close()

    def _finished(self, item: Work, moved: bool) -> None:
        """An item in flight has finished (on the poller's thread): count it, free its slot."""
        with self.cond:
            self.inflight -= 1
            if moved:
                self.bytes[item.kind][item.lane] += item.nbytes
            self.cond.notify()

    def _paced(self, item: Work) -> bool:
        """Wait out ``item``'s share of the cap (the emulated NIC's pacing); False when a
        ready high-lane item arrived meanwhile and ``item`` went back, keeping what it had
        waited out (the wire time its bytes had so far) and refunding the rest."""
        assert self.bucket is not None
        unpaid = item.nbytes - item.paid_bytes
        wait_s = self.bucket.reserve(unpaid, self._clock())
        if wait_s <= 0:
            return True
        high = self._queues[Lane.HIGH]
        with self.cond:  # a high item already waiting: the arbiter gave this lane its turn
            turn_over_high = bool(high)
        if self._arbiter is None or item.lane is Lane.HIGH or turn_over_high:
            time.sleep(wait_s)
            return True
        deadline_s = self._clock() + wait_s
        with self.cond:
            while not (high and high[0].ready()):
                left_s = deadline_s - self._clock()
                if left_s <= 0:
                    return True
                self.cond.wait(left_s)
            self._queues[item.lane].appendleft(item)
            self.queued_bytes += item.nbytes
            self.num_preempted += 1
            left_bytes = min(unpaid, round(max(0.0, deadline_s - self._clock())
                                           * self.bucket.rate_bytes_s))
        item.paid_bytes += unpaid - left_bytes
        self.bucket.refund(left_bytes)
        return False

    def _next(self) -> Work | None:
        """The next item to run; waits while idle; None once closed and drained."""
        while True:
            dropped: list[Work] = []
            with self.cond:
                while True:
                    if self.inflight >= self.window:  # no progress_s: all slots stuck is a stall
                        self.cond.wait()
                        continue
                    self.progress_s = now = self._clock()
                    item, blocked = self._pop(now, dropped)
                    if item is not None or dropped:
                        break
                    if self.closed and not blocked:
                        return None
                    self.cond.wait(self._recheck_s if blocked else None)
                for gone in dropped:
                    self.queued_bytes -= gone.nbytes
                    self.dropped[gone.kind] += 1
                if item is not None:
                    self.queued_bytes -= item.nbytes
            for gone in dropped:  # outside the lock
                gone.on_drop()
            if item is not None:
                return item

    def _pop(self, now: float, dropped: list[Work]) -> tuple[Work | None, bool]:
        """The next item (None if none is ready) and whether a not-ready head waits."""
        if self._arbiter is None:
            if not self._head_ready(self._fifo, now, dropped):
                return None, bool(self._fifo)
            return self._fifo.popleft(), False
        ready: list[Lane] = []
        blocked = False
        for lane, q in self._queues.items():
            if q:
                if self._head_ready(q, now, dropped):
                    ready.append(lane)
                else:
                    blocked = blocked or bool(q)
        lane = self._arbiter.pick(ready)
        return (None if lane is None else self._queues[lane].popleft()), blocked

    @staticmethod
    def _head_ready(q: deque[Work], now: float, dropped: list[Work]) -> bool:
        """Drop dropped items off the head of ``q``; whether its head is ready to run."""
        while q and q[0].dropped(now):
            dropped.append(q.popleft())
        return bool(q) and q[0].ready()


def direction_metrics(d: NicDirection, elapsed_s: float) -> dict[str, float | int | None]:
    """The ``cnic_{side}_*`` metrics of one NIC direction (keys: ``traffic``'s docstring)."""
    side = d.side
    with d.cond:
        active, passive, copies = (dict(d.bytes[k]) for k in WORK_KINDS)
        queued, peak, preempted = d.queued_bytes, d.peak.peak_bytes, d.num_preempted
    total = sum(active.values()) + sum(passive.values()) + sum(copies.values())
    out: dict[str, float | int | None] = {}
    for lane in Lane:
        out[f"cnic_{side}_lane_bytes_{lane.value}"] = active[lane] + passive[lane] + copies[lane]
        out[f"cnic_{side}_passive_lane_bytes_{lane.value}"] = passive[lane]
    out[f"cnic_{side}_bytes"] = sum(active.values())
    out[f"cnic_{side}_passive_bytes"] = sum(passive.values())
    out[f"cnic_{side}_total_bytes"] = total
    out[f"cnic_{side}_queue_bytes"] = queued
    out[f"cnic_{side}_preempted"] = preempted
    out[f"cnic_{side}_utilization"] = (
        None if d.bucket is None else total / (d.bucket.rate_bytes_s * elapsed_s))
    out[f"cnic_{side}_peak_mb_s_100ms"] = peak / d.peak.window_s / 1e6
    return out
