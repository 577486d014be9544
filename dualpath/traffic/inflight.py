"""Work a NIC direction has started and not yet seen finish, polled by one thread.

A NIC direction keeps up to ``TrafficConfig.inflight_chunks`` items in flight: its dispatcher
starts an item (a Mooncake transfer is submitted and returns at once) and goes on to the next,
and this poller checks the started ones until each has finished, then hands it back
(``on_finish``), which frees its slot. One large transfer moves at the link's speed because
its slices are in flight together; a request's KV sent chunk by chunk, one at a time, moved at
about half of it (each chunk's start and end latency unhidden), and four in flight brought it
back (``dualpath bench transfer``).

The poller never spins: after a change (an item started or finished) it checks every
``poll_min_s`` for ``fast_polls`` checks, then doubles its sleep up to ``poll_max_s`` while
nothing changes, so a slow or hung transfer costs little CPU. On a 2-core machine, where the
two Mooncake engines of a loopback transfer keep both cores busy, CPU is what the poller costs
the link (measured with 4 in flight, 1 MB chunks): spinning ten checks after each change took
150-220 µs of CPU per chunk and held the ratio under 0.8; doubling from the first sleep found
chunks late (0.7-0.78); 50 µs sleeps for eight checks take 70-90 µs per chunk and 0.82-1.06.
The thread starts with the first item: a direction whose work all finishes inside
``start`` (copies, grants, backends without an asynchronous API) never starts it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from dualpath.traffic.work import Work

log = logging.getLogger(__name__)

POLL_MIN_S = 50e-6  # the sleep between checks after a change
FAST_POLLS = 8  # checks at POLL_MIN_S after a change, before the sleeps double
POLL_MAX_S = 1e-3  # the longest sleep between checks


class InFlightPoller:
    """Polls started items until each has finished; ``on_finish(item, moved)`` runs on the
    poller's thread, outside its lock."""

    def __init__(self, name: str, on_finish: Callable[[Work, bool], None]) -> None:
        self._name = name
        self._on_finish = on_finish
        self._cond = threading.Condition(threading.Lock())
        self._items: list[Work] = []
        self._closed = False
        self._thread: threading.Thread | None = None
        self.poll_min_s, self.poll_max_s, self.fast_polls = POLL_MIN_S, POLL_MAX_S, FAST_POLLS

    def add(self, item: Work) -> None:
        """Poll ``item`` (its ``start`` returned None) until it has finished."""
        with self._cond:
            self._items.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True, name=self._name)
                self._thread.start()
            self._cond.notify()

    def close(self) -> None:
        """Stop the thread once nothing is in flight (call after the last item finished)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _loop(self) -> None:
        quiet, last_count = 0, 0  # checks since the last change; items left after it
        while (items := self._wait_for_items()) is not None:
            finished = self._finish(items)
            quiet = 0 if finished or len(items) > last_count else quiet + 1
            last_count = len(items) - finished
            if last_count:
                time.sleep(self._sleep_s(quiet))

    def _sleep_s(self, quiet: int) -> float:
        """The sleep before the next check, ``quiet`` checks after the last change."""
        doublings = max(0, quiet - self.fast_polls)
        return min(self.poll_max_s, self.poll_min_s * (1 << min(doublings, 16)))

    def _wait_for_items(self) -> list[Work] | None:
        """A snapshot of the items in flight; waits while there are none; None once closed."""
        with self._cond:
            while not self._items:
                if self._closed:
                    return None
                self._cond.wait()
            return list(self._items)

    def _finish(self, items: list[Work]) -> int:
        """Poll each item once, hand back those that finished; how many did."""
        finished = [(item, moved) for item in items if (moved := _poll(item)) is not None]
        if finished:
            with self._cond:
                for item, _ in finished:
                    self._items.remove(item)
            for item, moved in finished:
                self._on_finish(item, moved)
        return len(finished)


def _poll(item: Work) -> bool | None:
    """``item.poll()``; an item that breaks its no-raise contract counts as finished, unmoved."""
    try:
        return item.poll()
    except Exception:
        log.exception("polling %s failed", type(item).__name__)
        return False
