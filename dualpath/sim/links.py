"""Links whose bandwidth is shared equally by the flows on them (processor sharing).

A :class:`Link` of ``bandwidth`` bytes/s carrying n flows gives each ``bandwidth / n``; when a
flow starts or ends, every flow's remaining bytes are brought up to date and the next
completion is rescheduled, so completion times are exact for this model. The simulator uses
one link per storage NIC (node), per compute NIC (engine) and per node's DRAM where it models
them; a flow's rate on several links is not coupled (each flow uses one link here).

:class:`RateGroup` is the same idea for work that progresses at a common rate set by the
group's size (a decode engine: every running request advances one token per step, and the
step time grows with the batch).
"""

from __future__ import annotations

from collections.abc import Callable

from dualpath.sim.events import EventHandle, EventLoop

_EPS = 1e-9


class _Shared:
    """Items with remaining work progressing at ``rate(n)`` each; exact completion events."""

    def __init__(self, loop: EventLoop, name: str) -> None:
        self.loop = loop
        self.name = name
        self._left: dict[int, float] = {}
        self._done: dict[int, Callable[[], None]] = {}
        self._size: dict[int, float] = {}
        self._last = 0.0
        self._next: EventHandle | None = None
        self._ids = 0
        self.work_done = 0.0  # total work served (bytes or steps)
        self.busy_time = 0.0

    def per_item_rate(self, n: int) -> float:
        """Rate each of ``n`` concurrent items progresses at."""
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self._left)

    def _advance(self) -> None:
        now = self.loop.now
        dt = now - self._last
        if dt > 0 and self._left:
            served = dt * self.per_item_rate(len(self._left))
            for key in self._left:
                self._left[key] -= served
            self.work_done += served * len(self._left)
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
        self._left[key] = float(amount)
        self._size[key] = float(amount)
        self._done[key] = on_done
        self._reschedule()
        return key

    def _reschedule(self) -> None:
        if self._next is not None:
            self._next.cancel()
            self._next = None
        if not self._left:
            return
        key = min(self._left, key=self._left.__getitem__)
        rate = self.per_item_rate(len(self._left))
        self._next = self.loop.after(max(0.0, self._left[key]) / rate, self._complete)

    def _complete(self) -> None:
        self._next = None
        self._advance()
        finished = [k for k, left in self._left.items() if left <= _EPS * self._size[k]]
        if not finished:
            finished = [min(self._left, key=self._left.__getitem__)]
        callbacks = []
        for key in sorted(finished):
            del self._left[key]
            del self._size[key]
            callbacks.append(self._done.pop(key))
        self._reschedule()
        for callback in callbacks:
            callback()


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

    def backlog(self) -> float:
        """Bytes still to move over this link (up to date at the current time)."""
        self._advance()
        return sum(self._left.values())


class RateGroup(_Shared):
    """Items that all advance at ``1 / step_time(n)`` units/s while ``n`` are running."""

    def __init__(self, loop: EventLoop, step_time: Callable[[int], float],
                 name: str = "group") -> None:
        super().__init__(loop, name)
        self.step_time = step_time

    def per_item_rate(self, n: int) -> float:
        """Every item gets one unit per step."""
        return 1.0 / self.step_time(n)
