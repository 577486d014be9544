"""Small helpers over ``concurrent.futures.Future`` for the engines' asynchronous moves."""

from __future__ import annotations

import threading
from concurrent.futures import Future


def all_of(futures: list[Future[None]]) -> Future[None]:
    """A future that completes when every one of ``futures`` has (failing with the first
    error as soon as one fails; at once when the list is empty)."""
    combined: Future[None] = Future()
    combined.set_running_or_notify_cancel()
    if not futures:
        combined.set_result(None)
        return combined
    left = [len(futures)]
    lock = threading.Lock()

    def done(f: Future[None]) -> None:
        exc = f.exception()
        with lock:
            left[0] -= 1
            if combined.done():
                return
            if exc is not None:
                combined.set_exception(exc)
            elif left[0] == 0:
                combined.set_result(None)

    for future in futures:
        future.add_done_callback(done)
    return combined
