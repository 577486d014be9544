"""Stream order made visible to host threads, and host futures made visible to streams.

The layerwise prefill on CUDA never synchronizes its compute stream. Two bridges replace it:

- ``EventWatcher.watch(event)`` returns a future that completes once the GPU has passed
  ``event`` (a thread of its own calls ``event.synchronize()``). A layer's send chains on it
  (``TrafficManager.submit(..., after=...)``), so the send starts as soon as that layer's
  compute is done, while the compute thread is already launching the next layers.
- ``stream_wait(events, stream)`` makes a stream wait for copies issued on another stream
  (the host-to-device loads on the traffic manager's copy stream), without a host wait.

Events are anything with ``synchronize()`` (and ``record``/``wait_event`` on the stream side),
so the host logic is tested with fakes on machines without a GPU. One watcher serves one
engine: its events come from one compute stream and complete in order, so a single thread
synchronizing them first in, first out never holds a later event behind an earlier one that
is not done yet.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

_STOP = None


class EventWatcher:
    """Completes a future per watched event once the device has reached it (FIFO, one thread).

    The thread starts on the first ``watch`` and ends on ``close``. A ``synchronize`` that
    raises (a device error) fails that event's future with the error; later events go on.
    """

    def __init__(self, name: str = "cuda-event-watcher") -> None:
        self._name = name
        self._queue: queue.SimpleQueue[tuple[Any, Future[None]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def watch(self, event: Any) -> Future[None]:
        """A future that completes once ``event`` has completed on its stream (never blocks).

        Raises ``RuntimeError`` after ``close``.
        """
        future: Future[None] = Future()
        future.set_running_or_notify_cancel()
        with self._lock:
            if self._closed:
                raise RuntimeError("the event watcher is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._queue.put((event, future))
        return future

    def close(self) -> None:
        """Stop the thread once the events already watched have completed (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._queue.put(_STOP)
            thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not _STOP:
            event, future = item
            try:
                event.synchronize()
            except Exception as exc:  # a device error belongs to whoever waits on the event
                future.set_exception(exc)
            else:
                future.set_result(None)


def stream_wait(events: Iterable[Any], stream: Any) -> int:
    """Make ``stream`` wait for every event in ``events`` (on the device; the host goes on).

    Returns how many events it waits for.
    """
    count = 0
    for event in events:
        stream.wait_event(event)
        count += 1
    return count


_watchers: dict[str, EventWatcher] = {}
_watchers_lock = threading.Lock()


def shared_watcher(device: Any) -> EventWatcher:
    """The process's watcher for ``device`` (one per device, created on first use)."""
    key = str(device)
    with _watchers_lock:
        watcher = _watchers.get(key)
        if watcher is None:
            watcher = _watchers[key] = EventWatcher(f"cuda-event-watcher-{key}")
        return watcher
