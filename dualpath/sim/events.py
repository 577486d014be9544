"""A deterministic discrete-event loop with its own virtual clock (no wall-clock reads).

Events are ``(time, seq, callback)`` in a heap; ``seq`` is a global counter so events at the
same time run in the order they were scheduled. A scheduled event can be cancelled through the
handle :meth:`EventLoop.at` returns (it is then skipped when popped).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable


class EventHandle:
    """A scheduled callback; :meth:`cancel` makes the loop skip it."""

    __slots__ = ("callback", "cancelled", "time")

    def __init__(self, time: float, callback: Callable[[], None]) -> None:
        self.time = time
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        """Do not run this event."""
        self.cancelled = True


class EventLoop:
    """Virtual-time event loop: ``at``/``after`` schedule, ``run`` executes in time order."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, EventHandle]] = []
        self._seq = 0
        self.processed = 0

    def at(self, time: float, callback: Callable[[], None]) -> EventHandle:
        """Run ``callback`` at virtual ``time`` (ValueError if in the past)."""
        if time < self.now:
            raise ValueError(f"event at {time} is before now ({self.now})")
        handle = EventHandle(time, callback)
        heapq.heappush(self._heap, (time, self._seq, handle))
        self._seq += 1
        return handle

    def after(self, delay: float, callback: Callable[[], None]) -> EventHandle:
        """Run ``callback`` ``delay`` seconds of virtual time from now."""
        return self.at(self.now + (delay if delay > 0.0 else 0.0), callback)

    def when(self, time: float, callback: Callable[[], None]) -> None:
        """Run ``callback`` at ``time``: at once if that is not later than now (no event)."""
        if time <= self.now:
            callback()
        else:
            self.at(time, callback)

    def __len__(self) -> int:
        """Events still queued (cancelled ones included until popped)."""
        return len(self._heap)

    def run(self, until: float | None = None) -> float:
        """Run events in time order, skipping cancelled ones (those at or before ``until`` if
        given); the final virtual time. Kept in one loop: it runs once per simulated event."""
        heap, pop = self._heap, heapq.heappop
        limit = float("inf") if until is None else until
        while heap:
            if heap[0][0] > limit:
                self.now = limit
                break
            time, _, handle = pop(heap)
            if handle.cancelled:
                continue
            self.now = time
            self.processed += 1
            handle.callback()
        return self.now
