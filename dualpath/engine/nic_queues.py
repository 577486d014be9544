"""One direction of an engine's compute NIC: lane queues, arbiter, cap, counters, dispatcher.

A ``NicDirection`` (the send side or the receive side) holds ``Work`` items of at most
``chunk_bytes`` each, of three kinds: ``active`` (a chunk of a transfer this engine started),
``passive`` (a peer's grant request: the peer moves the bytes by a one-sided operation, this NIC
is charged for them) and ``copy`` (a piece of a host↔device copy). One dispatcher thread picks
the next item — by smooth weighted round robin over the backlogged lanes, or in arrival order
over all lanes when QoS lanes are off — paces it through the direction's token bucket when the
NIC is capped, runs it, and counts its bytes per kind and lane. It also tracks the most bytes
charged in any 100 ms window.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from typing import ClassVar, Literal

from dualpath.errors import TransferError
from dualpath.storage.throttle import TokenBucket
from dualpath.transfer.lanes import Lane, LaneArbiter

NicSide = Literal["send", "recv"]
WorkKind = Literal["active", "passive", "copy"]
WORK_KINDS: tuple[WorkKind, ...] = ("active", "passive", "copy")
PEAK_WINDOW_S = 0.1


class Submission:
    """One ``submit``/``submit_copy`` call: its future and how many of its chunks are left.

    Thread-safe: chunks finish on dispatcher threads, failures come from anywhere. The future
    settles exactly once; ``on_fail`` (e.g. cancel outstanding grant requests) runs on failure.
    """

    def __init__(self, chunks: int, on_fail: Callable[[], None] | None = None) -> None:
        self.future: Future[None] = Future()
        self.future.set_running_or_notify_cancel()  # queued work cannot be cancelled
        self.on_fail = on_fail
        self.chunks = chunks
        self._left = chunks
        self._settled = False
        self._lock = threading.Lock()
        self.failed = False

    def chunk_done(self) -> None:
        """One chunk moved; the last one completes the future."""
        with self._lock:
            self._left -= 1
            done = self._left <= 0 and not self._settled
            self._settled = self._settled or done
        if done:
            self.future.set_result(None)

    def complete_if_empty(self) -> bool:
        """Complete a submission of no chunks at all; True if it was one."""
        if self.chunks:
            return False
        with self._lock:
            done, self._settled = not self._settled, True
        if done:
            self.future.set_result(None)
        return True

    def fail(self, exc: BaseException) -> bool:
        """Fail the future with ``exc`` (once); False if it had already settled."""
        with self._lock:
            if self._settled:
                return False
            self._settled = self.failed = True
        self.future.set_exception(exc)
        if self.on_fail is not None:
            self.on_fail()
        return True


class Work(ABC):
    """One item of a NIC direction's queues: at most ``chunk_bytes`` on one lane."""

    kind: ClassVar[WorkKind]

    def __init__(self, lane: Lane, nbytes: int) -> None:
        self.lane = lane
        self.nbytes = nbytes

    def dropped(self, now_s: float) -> bool:
        """True if the item is to be skipped without charging the NIC (its owner gave up)."""
        return False

    def on_drop(self) -> None:
        """Called (outside the queue lock) for an item that ``dropped`` skipped."""
        return None

    @abstractmethod
    def run(self) -> bool:
        """Do the work, once paced; True if its bytes moved (then they are counted).

        Must not raise: a failure belongs to the item's owner (its submission's future).
        """


class _SubmissionWork(Work):
    """A work item that belongs to a ``Submission``: skipped once the submission failed."""

    def __init__(self, sub: Submission, lane: Lane, nbytes: int) -> None:
        super().__init__(lane, nbytes)
        self.sub = sub

    def dropped(self, now_s: float) -> bool:
        return self.sub.failed

    def finish(self, op: Callable[[], None], what: str) -> bool:
        """Run ``op``; count the chunk done, or fail the submission with a ``TransferError``."""
        try:
            op()
        except Exception as exc:  # any failure belongs to the caller's future
            err = exc if isinstance(exc, TransferError) else TransferError(f"{what}: {exc}")
            if err is not exc:
                err.__cause__ = exc
            self.sub.fail(err)
            return False
        self.sub.chunk_done()
        return True


class MoveWork(_SubmissionWork):
    """A chunk of a transfer this engine started: one backend call."""

    kind = "active"

    def __init__(self, sub: Submission, lane: Lane, nbytes: int,
                 op: Callable[[], None]) -> None:
        super().__init__(sub, lane, nbytes)
        self.op = op

    def run(self) -> bool:
        return self.finish(self.op, "transfer")


class CopyWork(_SubmissionWork):
    """A piece of a host↔device copy (the dispatcher is the copy thread)."""

    kind = "copy"

    def __init__(self, sub: Submission, lane: Lane, nbytes: int,
                 op: Callable[[], None]) -> None:
        super().__init__(sub, lane, nbytes)
        self.op = op

    def run(self) -> bool:
        return self.finish(self.op, "copy")


class PeakWindow:
    """The most bytes charged in any window of ``window_s`` seconds (exact, sliding)."""

    def __init__(self, window_s: float = PEAK_WINDOW_S) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()
        self._sum = 0
        self.peak_bytes = 0

    def add(self, now_s: float, nbytes: int) -> None:
        """Charge ``nbytes`` at ``now_s`` (times must not go backwards)."""
        self._events.append((now_s, nbytes))
        self._sum += nbytes
        while self._events[0][0] <= now_s - self.window_s:
            self._sum -= self._events.popleft()[1]
        self.peak_bytes = max(self.peak_bytes, self._sum)


class NicDirection:
    """One direction of the compute NIC with its dispatcher thread (the copy thread too)."""

    def __init__(self, side: NicSide, bucket: TokenBucket | None, weights: Mapping[Lane, int],
                 qos_lanes: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        self.side = side
        self.bucket = bucket  # touched only by the dispatcher thread
        self._clock = clock
        self._arbiter = LaneArbiter(weights) if qos_lanes else None
        self._queues: dict[Lane, deque[Work]] = {lane: deque() for lane in Lane}
        self._fifo: deque[Work] = deque()
        self.cond = threading.Condition()
        self.bytes: dict[WorkKind, dict[Lane, int]] = {k: dict.fromkeys(Lane, 0)
                                                       for k in WORK_KINDS}
        self.dropped: dict[WorkKind, int] = dict.fromkeys(WORK_KINDS, 0)
        self.peak = PeakWindow()
        self.queued_bytes = 0
        self.progress_s = clock()  # last time the dispatcher took an item (or became busy)
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

    def stalled(self, now_s: float, timeout_s: float) -> bool:
        """True if work has waited ``timeout_s`` without the dispatcher taking any of it."""
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
        """Pick, pace, run, count; until closed and drained."""
        while (item := self._next()) is not None:
            if self.bucket is not None:
                wait_s = self.bucket.reserve(item.nbytes, self._clock())
                if wait_s > 0:
                    time.sleep(wait_s)  # the emulated NIC's pacing
            charged_s = self._clock()
            moved = item.run()
            with self.cond:
                self.peak.add(charged_s, item.nbytes)
                if moved:
                    self.bytes[item.kind][item.lane] += item.nbytes

    def _next(self) -> Work | None:
        """The next item to run; waits while idle; None once closed and drained."""
        while True:
            with self.cond:
                item = self._pop()
                while item is None:
                    if self.closed:
                        return None
                    self.cond.wait()
                    item = self._pop()
                self.queued_bytes -= item.nbytes
                now = self._clock()
                self.progress_s = now
                if not item.dropped(now):
                    return item
                self.dropped[item.kind] += 1
            item.on_drop()

    def _pop(self) -> Work | None:
        if self._arbiter is None:
            return self._fifo.popleft() if self._fifo else None
        lane = self._arbiter.pick([lane for lane, q in self._queues.items() if q])
        return None if lane is None else self._queues[lane].popleft()
