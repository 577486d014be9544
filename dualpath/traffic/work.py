"""Work in a NIC direction's queues: transfer chunks, copy pieces, and their submissions.

A ``Work`` item is at most ``chunk_bytes`` on one lane, of one kind: ``active`` (a chunk of a
transfer this engine started), ``passive`` (a peer's grant request, ``nic_grants``) or ``copy``
(a piece of a host↔device copy). A ``Submission`` is one ``submit``/``submit_copy`` call: its
future settles once, when its last item has run or its first failure. ``LiveSubmissions``
starts them (now or after another future) and lets a closing manager wait for them.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from functools import partial
from typing import Any, ClassVar, Literal

from dualpath.errors import TransferError
from dualpath.traffic.lanes import Lane
from dualpath.transfer.base import PendingTransfer

WorkKind = Literal["active", "passive", "copy"]
WORK_KINDS: tuple[WorkKind, ...] = ("active", "passive", "copy")
RUN_POLL_S = 50e-6  # ``MoveWork.run``'s wait between polls


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


class LiveSubmissions:
    """Submissions accepted and not yet settled: each starts now or once its ``after`` is done.

    ``after`` failing (or cancelled) fails the submission with a ``TransferError`` chained from
    it, and nothing of it moves. Never blocks the submitter (``add_done_callback``).
    """

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.closing = False
        self._cond = threading.Condition()
        self._live = 0
        self._waiting: set[Submission] = set()  # live, waiting for their ``after``

    def accept(self, sub: Submission, after: Future[Any] | None,
               start: Callable[[], None]) -> None:
        """Count ``sub`` live and run ``start`` now or after ``after``; raises once closing."""
        with self._cond:
            if self.closing:
                raise TransferError("the traffic manager is closed")
            self._live += 1
            if after is not None:
                self._waiting.add(sub)
        sub.future.add_done_callback(self._settled)
        if after is None:
            self._start(sub, start)
        else:
            after.add_done_callback(partial(self._after_done, sub, start))

    def close(self) -> None:
        """Accept nothing more (``accept`` raises ``TransferError``)."""
        with self._cond:
            self.closing = True

    def wait_settled(self) -> None:
        """Wait until every accepted submission has settled (call after ``close``).

        Those still waiting for an ``after`` that nothing else here will complete fail after
        ``grace_s`` without progress.
        """
        while True:
            with self._cond:
                before = self._live
                if before:
                    self._cond.wait(self.grace_s)
                if not self._live:
                    return
                stuck = list(self._waiting) if self._live == before == len(self._waiting) else []
            for sub in stuck:  # outside the lock: failing settles them
                sub.fail(TransferError("the traffic manager closed before this transfer's "
                                       "`after` completed"))

    def _after_done(self, sub: Submission, start: Callable[[], None], after: Future[Any]) -> None:
        with self._cond:
            self._waiting.discard(sub)
        try:
            exc = after.exception()
        except CancelledError as cancelled:
            exc = cancelled
        if exc is None:
            self._start(sub, start)
            return
        err = TransferError(f"the transfer's `after` failed: {exc!r}")
        err.__cause__ = exc
        sub.fail(err)

    @staticmethod
    def _start(sub: Submission, start: Callable[[], None]) -> None:
        if sub.failed or sub.complete_if_empty():
            return
        try:
            start()
        except Exception as exc:
            err = exc if isinstance(exc, TransferError) else TransferError(str(exc))
            if err is not exc:
                err.__cause__ = exc
            sub.fail(err)

    def _settled(self, _future: Future[None]) -> None:
        with self._cond:
            self._live -= 1
            self._cond.notify_all()


class Work(ABC):
    """One item of a NIC direction's queues: at most its lane's chunk, on one lane.

    Once paced, the dispatcher calls ``start``: an item either finishes inside it (``run``,
    the default) or returns None and is polled (``poll``) until it has finished, while the
    dispatcher starts the next ones (several items in flight per direction).
    """

    __slots__ = ("lane", "nbytes", "paid_bytes")
    kind: ClassVar[WorkKind]

    def __init__(self, lane: Lane, nbytes: int) -> None:
        self.lane = lane
        self.nbytes = nbytes
        self.paid_bytes = 0  # of its pacing, already waited out before a high item went first

    def dropped(self, now_s: float) -> bool:
        """True if the item is to be skipped without charging the NIC (its owner gave up)."""
        return False

    def ready(self) -> bool:
        """False while the item may not start (its lane waits; re-checked when woken)."""
        return True

    def on_drop(self) -> None:
        """Called (outside the queue lock) for an item that ``dropped`` skipped."""
        return None

    def start(self) -> bool | None:
        """Start the work, once paced: whether its bytes moved if it has finished already,
        None if it is still moving (then ``poll`` says when it has). Must not raise."""
        return self.run()

    def poll(self) -> bool | None:
        """For an item that ``start`` left moving: None while it still moves, else whether its
        bytes moved. Never waits; must not raise."""
        raise NotImplementedError(f"{type(self).__name__} finishes inside start()")

    @abstractmethod
    def run(self) -> bool:
        """Do the work, once paced; True if its bytes moved (then they are counted).

        Must not raise: a failure belongs to the item's owner (its submission's future).
        """


class SubmissionWork(Work):
    """An item of a ``Submission``: runs ``op``; skipped once the submission failed.

    ``release`` (set when a peer NIC granted the chunk) runs once the item has run or was
    dropped: the peer may then grant this engine another chunk.
    """

    __slots__ = ("op", "release", "sub")

    def __init__(self, sub: Submission, lane: Lane, nbytes: int,
                 op: Callable[[], Any]) -> None:
        super().__init__(lane, nbytes)
        self.sub = sub
        self.op = op
        self.release: Callable[[], None] | None = None

    def dropped(self, now_s: float) -> bool:
        return self.sub.failed

    def run(self) -> bool:
        """Run ``op``; count the chunk done, or fail the submission with a ``TransferError``."""
        try:
            self.op()
        except Exception as exc:  # any failure belongs to the caller's future
            return self._failed(exc)
        return self._moved()

    def on_drop(self) -> None:
        release, self.release = self.release, None
        if release is not None:
            release()

    def _moved(self) -> bool:
        """The chunk moved: count it done (the last one completes the submission)."""
        self.sub.chunk_done()
        self.on_drop()
        return True

    def _failed(self, exc: Exception) -> bool:
        """The chunk failed: fail the submission with a ``TransferError`` (chained)."""
        err = exc
        if not isinstance(exc, TransferError):
            err = TransferError(f"{'transfer' if self.kind == 'active' else 'copy'}: {exc}")
            err.__cause__ = exc
        self.sub.fail(err)
        self.on_drop()
        return False


class MoveWork(SubmissionWork):
    """A chunk of a transfer this engine started: one backend call, left in flight.

    ``op`` starts the transfer (``TransferBackend.start_write``/``start_read``) and returns
    its ``PendingTransfer``; the direction polls it until it has landed.
    """

    __slots__ = ("pending",)
    kind = "active"

    def __init__(self, sub: Submission, lane: Lane, nbytes: int,
                 op: Callable[[], PendingTransfer]) -> None:
        super().__init__(sub, lane, nbytes, op)
        self.pending: PendingTransfer | None = None

    def start(self) -> bool | None:
        """Start the transfer; None while it moves, else whether it moved."""
        try:
            self.pending = self.op()
        except Exception as exc:  # any failure belongs to the caller's future
            return self._failed(exc)
        return self.poll()

    def poll(self) -> bool | None:
        """Check the transfer once: None while it moves; done or failed settle the chunk."""
        assert self.pending is not None
        try:
            if not self.pending.poll():
                return None
        except Exception as exc:  # a failed transfer: its submission's error
            return self._failed(exc)
        return self._moved()

    def run(self) -> bool:
        """Start the transfer and wait for it (the dispatcher uses ``start`` and ``poll``)."""
        moved = self.start()
        while moved is None:
            time.sleep(RUN_POLL_S)
            moved = self.poll()
        return moved


class CopyWork(SubmissionWork):
    """A group of pieces of a host↔device copy (the dispatcher is the copy thread).

    ``op`` copies them (``PieceCopier.issue``): host copies finish inside ``start``; CUDA
    copies are issued on a copy stream and return an event, which the direction polls while
    it starts the next items (several copies in flight per direction).
    """

    __slots__ = ("done",)
    kind = "copy"

    def __init__(self, sub: Submission, lane: Lane, nbytes: int,
                 op: Callable[[], Any]) -> None:
        super().__init__(sub, lane, nbytes, op)
        self.done: Any | None = None  # the CUDA event of the issued copies

    def start(self) -> bool | None:
        """Copy (host) or issue (CUDA); None while issued copies are still landing."""
        try:
            self.done = self.op()
        except Exception as exc:  # any failure belongs to the caller's future
            return self._failed(exc)
        return self._moved() if self.done is None else self.poll()

    def poll(self) -> bool | None:
        """None while the issued copies are landing, else count the group done."""
        assert self.done is not None
        try:
            if not self.done.query():
                return None
        except Exception as exc:  # a device error: the submission's
            return self._failed(exc)
        return self._moved()

    def run(self) -> bool:
        """Copy and wait until the bytes have landed (the dispatcher uses ``start``/``poll``)."""
        moved = self.start()
        if moved is None:
            assert self.done is not None
            try:
                self.done.synchronize()
            except Exception as exc:  # a device error: the submission's
                return self._failed(exc)
            return self._moved()
        return moved
