"""The traffic manager: every byte an engine moves goes through it, on a QoS lane.

Transfers to and from peer engines (the compute network) are split into chunks of at most
``chunk_bytes``. Each direction of the compute NIC — send (writes) and receive (reads) — has one
dispatcher thread that keeps a FIFO of chunks per lane, lets the ``LaneArbiter`` pick which
backlogged lane goes next, paces the chunk through a token bucket when the NIC is capped (the
testbed's emulated NIC; off on real hardware), and runs the backend call. So high-lane traffic
gets about 99% of a busy link, KV traffic the rest, and KV traffic all of an idle one.

Host↔device copies go through ``copy`` so they are counted per lane too; they are not paced.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

from dualpath.config import TrafficConfig
from dualpath.errors import TransferError
from dualpath.storage.throttle import TokenBucket
from dualpath.transfer.base import Segment, TransferBackend
from dualpath.transfer.lanes import Lane, LaneArbiter, weights_from_pairs

TransferKind = Literal["write", "read"]
CopyDirection = Literal["h2d", "d2h"]
_NIC_SIDE: dict[str, str] = {"write": "send", "read": "recv"}


@dataclass
class _Submission:
    """One ``submit`` call: its future and how many of its chunks are still to move."""

    future: Future[None]
    chunks_left: int
    failed: bool = False


@dataclass
class _Chunk:
    """Segments moved by one backend call."""

    submission: _Submission
    lane: Lane
    peer: str
    segments: list[Segment]
    nbytes: int


class _Direction:
    """One direction of the compute NIC: lane queues, arbiter, cap, counters, dispatcher."""

    def __init__(self, kind: TransferKind, bucket: TokenBucket | None,
                 arbiter: LaneArbiter) -> None:
        self.kind = kind
        self.bucket = bucket  # touched only by the dispatcher thread
        self.arbiter = arbiter
        self.queues: dict[Lane, deque[_Chunk]] = {lane: deque() for lane in Lane}
        self.cond = threading.Condition()
        self.lane_bytes = dict.fromkeys(Lane, 0)
        self.queued_bytes = 0
        self.closed = False
        self.thread: threading.Thread | None = None

    @property
    def bytes_moved(self) -> int:
        return sum(self.lane_bytes.values())


def coalesce(segments: Sequence[Segment]) -> list[Segment]:
    """Merge each segment into the previous one when both sides continue contiguously.

    Layer-major placement (layer i of a request's blocks side by side in the PE cache and the DE
    buffer) turns a layer's many layer blocks into one segment on the wire.
    """
    merged: list[Segment] = []
    for local, remote, nbytes in segments:
        if merged:
            p_local, p_remote, p_bytes = merged[-1]
            if p_local + p_bytes == local and p_remote + p_bytes == remote:
                merged[-1] = (p_local, p_remote, p_bytes + nbytes)
                continue
        merged.append((local, remote, nbytes))
    return merged


def split_chunks(segments: Sequence[Segment], chunk_bytes: int) -> list[list[Segment]]:
    """Pack segments, in order, into chunks of at most ``chunk_bytes``.

    A segment that fits in a chunk is never split (it starts a new chunk if the current one
    lacks room); a larger one is cut to fill the current chunk, whole chunks, then a tail.
    Zero-length segments are dropped.
    """
    chunks: list[list[Segment]] = []
    current: list[Segment] = []
    room = chunk_bytes
    for local, remote, nbytes in segments:
        if current and room < nbytes <= chunk_bytes:
            chunks.append(current)
            current, room = [], chunk_bytes
        offset = 0
        while offset < nbytes:
            take = min(room, nbytes - offset)
            current.append((local + offset, remote + offset, take))
            offset += take
            room -= take
            if room == 0:
                chunks.append(current)
                current, room = [], chunk_bytes
    if current:
        chunks.append(current)
    return chunks


def _validated(segments: Sequence[Segment]) -> list[Segment]:
    out = [tuple(s) for s in segments]
    for seg in out:
        if len(seg) != 3 or any(not isinstance(v, int) or v < 0 for v in seg):
            raise ValueError(f"a segment is (local_addr, remote_addr, nbytes) of ints >= 0: {seg}")
    return out  # type: ignore[return-value]


class TrafficManager:
    """An engine's data movement: lanes, chunking, compute-NIC caps and counters."""

    def __init__(self, backend: TransferBackend | None, config: TrafficConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or TrafficConfig()
        self.backend = backend
        self._clock = clock
        self._started_s = clock()
        weights = weights_from_pairs(self.config.lane_weights)
        self._dirs: dict[str, _Direction] = {
            "write": _Direction("write", self._bucket(self.config.compute_send_cap_mb_s),
                                LaneArbiter(weights)),
            "read": _Direction("read", self._bucket(self.config.compute_recv_cap_mb_s),
                               LaneArbiter(weights)),
        }
        self._lock = threading.Lock()
        self._copy_lane_bytes = dict.fromkeys(Lane, 0)
        self._copy_dir_bytes: dict[str, int] = {"h2d": 0, "d2h": 0}
        if backend is not None:
            for d in self._dirs.values():
                d.thread = threading.Thread(target=self._dispatch, args=(d,), daemon=True,
                                            name=f"traffic-{_NIC_SIDE[d.kind]}")
                d.thread.start()

    # --- the API ------------------------------------------------------------------------

    def register(self, address: int, nbytes: int) -> None:
        """Register a host region with the transfer backend (once per region)."""
        self._need_backend().register(address, nbytes)

    def submit(self, kind: TransferKind, peer: str, segments: Sequence[Segment],
               lane: Lane) -> Future[None]:
        """Queue a transfer on ``lane``; the future completes when its last chunk has moved.

        ``write`` sends local → peer, ``read`` receives peer → local. A backend error fails
        the future and drops the transfer's remaining chunks.
        """
        if kind not in self._dirs:
            raise ValueError(f"kind must be 'write' or 'read', got {kind!r}")
        self._need_backend()
        lane = Lane(lane)
        future: Future[None] = Future()
        future.set_running_or_notify_cancel()  # queued work cannot be cancelled
        chunks = split_chunks(coalesce(_validated(segments)), self.config.chunk_bytes)
        if not chunks:
            future.set_result(None)
            return future
        self._enqueue(self._dirs[kind], _Submission(future, len(chunks)), lane, peer, chunks)
        return future

    def write(self, peer: str, segments: Sequence[Segment], lane: Lane) -> None:
        """Send local → peer on ``lane`` and wait."""
        self.submit("write", peer, segments, lane).result()

    def read(self, peer: str, segments: Sequence[Segment], lane: Lane) -> None:
        """Receive peer → local on ``lane`` and wait."""
        self.submit("read", peer, segments, lane).result()

    def copy(self, dst: Any, src: Any, lane: Lane, direction: CopyDirection | None = None) -> int:
        """Copy ``src`` into ``dst`` (tensors, or buffers of equal size); returns the bytes.

        ``direction`` is what the copy stands for (on a CPU engine both sides are host
        memory); by default KV saves are device → host and everything else host → device.
        """
        lane = Lane(lane)
        nbytes = _copy_into(dst, src)
        direction = direction or ("d2h" if lane is Lane.KV_SAVE else "h2d")
        with self._lock:
            self._copy_lane_bytes[lane] += nbytes
            self._copy_dir_bytes[direction] += nbytes
        return nbytes

    def metrics(self) -> dict[str, float | int | None]:
        """Byte counters per NIC direction, lane and copy kind, and capped-NIC utilization."""
        elapsed = max(1e-9, self._clock() - self._started_s)
        out: dict[str, float | int | None] = {}
        lane_bytes = dict.fromkeys(Lane, 0)
        for d in self._dirs.values():
            side = _NIC_SIDE[d.kind]
            with d.cond:
                moved, queued = d.bytes_moved, d.queued_bytes
                for lane, n in d.lane_bytes.items():
                    lane_bytes[lane] += n
            out[f"cnic_{side}_bytes"] = moved
            out[f"cnic_{side}_queue_bytes"] = queued
            out[f"cnic_{side}_utilization"] = (
                None if d.bucket is None else moved / (d.bucket.rate_bytes_s * elapsed))
        with self._lock:
            out.update({f"{k}_bytes": v for k, v in self._copy_dir_bytes.items()})
            out.update({f"copy_bytes_{lane.value}": n
                        for lane, n in self._copy_lane_bytes.items()})
        out.update({f"lane_bytes_{lane.value}": n for lane, n in lane_bytes.items()})
        return out

    def close(self) -> None:
        """Move what is queued, then stop the dispatchers (the backend stays open)."""
        for d in self._dirs.values():
            with d.cond:
                d.closed = True
                d.cond.notify_all()
        for d in self._dirs.values():
            if d.thread is not None:
                d.thread.join()

    def __enter__(self) -> TrafficManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals ----------------------------------------------------------------------

    def _bucket(self, cap_mb_s: float | None) -> TokenBucket | None:
        """The cap as a token bucket (burst: ``burst_chunks`` chunks); None when uncapped."""
        if cap_mb_s is None:
            return None
        return TokenBucket(cap_mb_s * 1e6, self.config.burst_chunks * self.config.chunk_bytes)

    def _need_backend(self) -> TransferBackend:
        if self.backend is None:
            raise TransferError("this traffic manager has no transfer backend")
        return self.backend

    def _enqueue(self, d: _Direction, sub: _Submission, lane: Lane, peer: str,
                 chunks: list[list[Segment]]) -> None:
        items = [_Chunk(sub, lane, peer, c, sum(s[2] for s in c)) for c in chunks]
        with d.cond:
            if d.closed:
                raise TransferError("the traffic manager is closed")
            d.queues[lane].extend(items)
            d.queued_bytes += sum(c.nbytes for c in items)
            d.cond.notify()

    def _dispatch(self, d: _Direction) -> None:
        """Dispatcher loop of one direction: pick, pace, move, until closed and drained."""
        while (chunk := self._next_chunk(d)) is not None:
            if d.bucket is not None:
                wait_s = d.bucket.reserve(chunk.nbytes, self._clock())
                if wait_s > 0:
                    time.sleep(wait_s)  # the emulated NIC's pacing
            self._move(d, chunk)

    def _next_chunk(self, d: _Direction) -> _Chunk | None:
        """The arbiter's next chunk; sleeps while idle; None once closed and drained."""
        with d.cond:
            while True:
                lane = d.arbiter.pick([lane for lane, q in d.queues.items() if q])
                if lane is None:
                    if d.closed:
                        return None
                    d.cond.wait()
                    continue
                chunk = d.queues[lane].popleft()
                d.queued_bytes -= chunk.nbytes
                if not chunk.submission.failed:
                    return chunk

    def _move(self, d: _Direction, chunk: _Chunk) -> None:
        """One backend call; count it, and settle the submission's future when it is due."""
        backend = self._need_backend()
        op = backend.write if d.kind == "write" else backend.read
        sub = chunk.submission
        try:
            op(chunk.peer, chunk.segments)
        except Exception as exc:  # any failure belongs to the caller's future
            with d.cond:
                sub.failed = True
            sub.future.set_exception(exc)
            return
        with d.cond:
            d.lane_bytes[chunk.lane] += chunk.nbytes
            sub.chunks_left -= 1
            done = sub.chunks_left == 0
        if done:
            sub.future.set_result(None)


def _copy_into(dst: Any, src: Any) -> int:
    """Copy a tensor (``copy_``) or a buffer (memoryview slice assignment); the bytes copied."""
    if hasattr(dst, "copy_"):
        dst.copy_(src)
        return int(dst.nbytes)
    out = memoryview(dst).cast("B")
    data = memoryview(src).cast("B")
    if out.nbytes != data.nbytes:
        raise ValueError(f"copy of {data.nbytes} bytes into a buffer of {out.nbytes}")
    out[:] = data
    return out.nbytes
