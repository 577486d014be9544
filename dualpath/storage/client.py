"""A node's storage client: the read queue (``read_q``, in tokens) and the storage-NIC caps.

Every engine of a node reads and writes full blocks through one ``StorageClient``. It counts
the tokens of reads submitted but not yet finished — the paper's per-node read queue that the
scheduler balances — and, when caps are configured, paces reads and writes through token
buckets so the node behaves like one with a storage NIC of that bandwidth. Engine processes
of one node each own a client; given the node's ``NodeNicAccount`` their buckets are one shared
account (``node_nic.py``), so together they stay within the node's cap. Byte counters and
utilization feed the metrics.

A storage fault never reaches the caller as an exception (docs/design.md §9): a block that a backend
fails to read — whatever it raises — is a miss that the prefill engine recomputes, a read
still unfinished at its deadline is a miss too, and a failed write is counted and dropped.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from dualpath.config import StorageConfig
from dualpath.kv.hashing import BlockKey
from dualpath.storage.base import StorageBackend
from dualpath.storage.node_nic import NodeNicAccount, SharedBucket
from dualpath.storage.warm import WarmBlocks, WarmTag
from dualpath.traffic.token_bucket import TokenBucket

BURST_BLOCKS = 1  # a capped NIC may send one block ahead of its average rate
# How long ``close`` lets queued writes go on; a block whose write has not started by then is
# dropped (not stored: a miss later, never wrong KV). Without it, a stop behind a slow store or
# a tight write cap waits for every queued block (at 2 KB/s, the launcher's 15 s and a SIGKILL).
CLOSE_DRAIN_S = 3.0
PREFETCH_YIELD_S = 0.005  # a prefetch waiting for the node's request reads looks again this often
ERROR_FIELDS = ("read_errors", "write_errors", "lookup_errors", "read_deadline_misses")

log = logging.getLogger("dualpath.storage")


def _bucket(cap_mb_s: float | None, block_bytes: int, node_nic: NodeNicAccount | None,
            direction: str) -> TokenBucket | SharedBucket | None:
    """The cap of one NIC direction: this process's own, or the node's shared account."""
    if cap_mb_s is None:
        return None
    if node_nic is not None:
        return node_nic.bucket(direction, cap_mb_s * 1e6, BURST_BLOCKS * block_bytes)
    return TokenBucket(cap_mb_s * 1e6, BURST_BLOCKS * block_bytes)


class _Direction:
    """One direction of the storage NIC: its cap, pending tokens and moved bytes."""

    def __init__(self, bucket: TokenBucket | SharedBucket | None) -> None:
        self.bucket = bucket
        self.pending_tokens = 0
        self.bytes_moved = 0


class ReadFuture(Future[list[bool]]):
    """Per-block success of one ``submit_read``; ``io_done`` says when its buffers are free.

    The result (True: the block is in its buffer and verified) comes when every block has been
    read or at the read's deadline, whichever is first. ``io_done`` completes (with None) once
    no read into the buffers is running or can still start: at once with the result when no
    block was mid-read at the deadline, later otherwise.
    """

    io_done: Future[None]


_QUEUED, _RUNNING, _DONE, _SKIPPED = range(4)


class _Read:
    """The state of one submitted read (all fields under ``lock``)."""

    def __init__(self, num_blocks: int) -> None:
        self.lock = threading.Lock()
        self.state = [_QUEUED] * num_blocks
        self.ok = [False] * num_blocks
        self.open = num_blocks  # blocks queued or running
        self.reported = False  # the result has been decided
        self.expired = False  # the deadline fired first
        self.tasks: list[Future[None]] = []
        self.future = ReadFuture()
        self.future.io_done = Future()
        self.future.set_running_or_notify_cancel()  # not cancellable: the reads are under way
        self.future.io_done.set_running_or_notify_cancel()

    def begin(self, i: int) -> bool:
        """Block ``i`` is about to be read; False if the deadline skipped it."""
        with self.lock:
            if self.expired:
                return False
            self.state[i] = _RUNNING
            return True

    def end(self, i: int, ok: bool) -> tuple[list[bool] | None, bool]:
        """Block ``i`` was read (or given up before its read); returns the result if it is
        now decided, and whether the I/O of the whole read has ended."""
        with self.lock:
            self.state[i] = _DONE
            self.ok[i] = ok
            self.open -= 1
            result = None
            if not self.reported and self.open == 0:
                self.reported = True
                result = list(self.ok)
            return result, self.open == 0

    def expire(self) -> tuple[list[bool] | None, int, int, bool]:
        """The deadline: the result (None if already decided), how many blocks were skipped
        before their read started, how many were mid-read, and whether the I/O has ended."""
        with self.lock:
            if self.reported:
                return None, 0, 0, False
            self.reported = self.expired = True
            result = [s == _DONE and ok for s, ok in zip(self.state, self.ok, strict=True)]
            skipped = 0
            for i, s in enumerate(self.state):
                if s == _QUEUED:
                    self.state[i] = _SKIPPED
                    skipped += 1
            self.open -= skipped
            running = self.state.count(_RUNNING)
            return result, skipped, running, self.open == 0


class _Deadlines:
    """One thread that runs callbacks at their due times (time.monotonic)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, due: float, callback: Callable[[], None]) -> None:
        with self._cond:
            heapq.heappush(self._heap, (due, next(self._seq), callback))
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="storage-deadlines",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (not self._heap or
                                            self._heap[0][0] > time.monotonic()):
                    timeout = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._cond.wait(timeout)
                if self._closed:
                    return
                _, _, callback = heapq.heappop(self._heap)
            try:
                callback()
            except Exception:  # a callback's bug must not stop every later deadline
                log.exception("storage deadline callback failed")


class StorageClient:
    """Capped, queued, parallel access to one store for the engines of a node."""

    def __init__(self, backend: StorageBackend, block_size: int,
                 config: StorageConfig | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 node_nic: NodeNicAccount | None = None) -> None:
        config = config or StorageConfig()
        # agent sessions' blocks kept in this process's DRAM (None: off): reads ask it first
        self.warm = WarmBlocks(round(config.warm_session_mb * 1e6), clock) if (
            config.warm_session_mb > 0) else None
        self.backend = backend
        self.block_size = block_size
        self.read_deadline_s = config.read_deadline_s
        self._clock = clock
        self._started_s = clock()
        self._lock = threading.Lock()
        self._read = _Direction(_bucket(config.read_cap_mb_s, backend.block_bytes, node_nic,
                                        "read"))
        self._write = _Direction(_bucket(config.write_cap_mb_s, backend.block_bytes, node_nic,
                                         "write"))
        # separate pools: writes stuck behind a slow store (or another host's eviction pass)
        # must not hold the workers that latency-critical reads need
        workers = max(1, config.workers)
        self._read_pool = ThreadPoolExecutor(workers, thread_name_prefix="storage-read")
        # prefetches of sessions' chains into ``warm``: one at a time, behind every request
        self._prefetch_pool = ThreadPoolExecutor(1, thread_name_prefix="storage-prefetch")
        self.prefetch_blocks_read = 0
        self._write_pool = ThreadPoolExecutor(workers, thread_name_prefix="storage-write")
        self._deadlines = _Deadlines()
        self._errors = dict.fromkeys(ERROR_FIELDS, 0)
        self._logged: set[tuple[str, type]] = set()
        self._closing = threading.Event()  # set by close: queued writes drain until ...
        self._drain_end_s = float("inf")  # ... this time.monotonic(), then are dropped
        self._writes_dropped = 0

    @property
    def read_queue_tokens(self) -> int:
        """Tokens of submitted reads not yet finished (the node's ``read_q``)."""
        return self._read.pending_tokens

    @property
    def write_queue_tokens(self) -> int:
        """Tokens of submitted writes not yet finished."""
        return self._write.pending_tokens

    def exists_prefix(self, keys: Sequence[BlockKey]) -> int:
        """How many leading blocks the store holds (0 when the store fails: recompute)."""
        try:
            return self.backend.exists_prefix(keys)
        except Exception as exc:
            self._count_error("lookup_errors", exc)
            return 0

    def submit_read(self, keys: Sequence[BlockKey], buffers: Sequence[Any],
                    keep: WarmTag | None = None) -> ReadFuture:
        """Start reading blocks into buffers; returns a future of per-block success. A block
        this node holds warm (``warm.py``) is copied from DRAM, without the storage NIC;
        with ``keep``, each block read is kept warm as that session's.

        The contract:

        * The future completes when every block has been read, or ``read_deadline_s`` after
          this call at the latest; it never raises for a storage fault. True means the block
          is in its buffer and verified; False (a miss: recompute it) means it is missing,
          damaged, failed in the backend (an exception from the backend becomes False), or
          was not read by the deadline.
        * After the deadline no block read starts. A block whose read was running at the
          deadline is reported False, and its read may still be writing into its buffer:
          ``future.io_done`` completes once no such read is left. Do not reuse or fill the
          buffers of a read before ``io_done`` (it completes with the result unless a read
          was caught mid-flight).
        * ``read_queue_tokens`` counts a block until its read ends or the deadline skips it.
        """
        pairs = list(zip(keys, buffers, strict=True))
        read = _Read(len(pairs))
        if not pairs:
            read.future.set_result([])
            read.future.io_done.set_result(None)
            return read.future
        with self._lock:
            self._read.pending_tokens += len(pairs) * self.block_size
        deadline = None if self.read_deadline_s is None else time.monotonic() + self.read_deadline_s
        read.tasks = [self._read_pool.submit(self._read_block, read, i, key, buffer, deadline,
                                             keep)
                      for i, (key, buffer) in enumerate(pairs)]
        if deadline is not None:
            self._deadlines.add(deadline, lambda: self._expire(read))
        return read.future

    def submit_write(self, keys: Sequence[BlockKey], buffers: Sequence[Any],
                     keep: WarmTag | None = None) -> Future[list[bool]]:
        """Start storing blocks, in order (a chain's parent lands before its child); with
        ``keep``, each block stored is kept warm as that session's too.

        The future gives per-block success and never raises for a storage fault: a failed
        write (store down, read-only, full, ...) is False, counted in ``write_errors``, and
        dropped — the block is simply not cached.
        """
        pairs = list(zip(keys, buffers, strict=True))
        with self._lock:
            self._write.pending_tokens += len(pairs) * self.block_size
        return self._write_pool.submit(lambda: [self._write_block(k, b, keep) for k, b in pairs])

    def prefetch(self, keys_of: Callable[[], Sequence[BlockKey]], tag: WarmTag,
                 expires_s: float) -> Future[int]:
        """Read a session's stored chain (its keys made by ``keys_of``, on the prefetch's own
        thread: hashing a long chain is no work for the caller's loop) into this node's DRAM
        (``warm``) in the background,
        on the lowest priority: a block waits while any request's read is queued here, and
        nothing is read after ``expires_s`` (this client's clock) or once the budget has no
        room left for it. A block that is missing or fails verification ends it there (what
        follows it cannot be a hit; the turn reads the rest from storage, or misses, as any
        read). The future gives the blocks now held."""
        if self.warm is None:
            done: Future[int] = Future()
            done.set_result(0)
            return done
        return self._prefetch_pool.submit(self._prefetch, keys_of, tag, expires_s)

    def _prefetch(self, keys_of: Callable[[], Sequence[BlockKey]], tag: WarmTag,
                  expires_s: float) -> int:
        assert self.warm is not None
        held = 0
        scratch = bytearray(self.backend.block_bytes)
        for key in keys_of():
            if self._closing.is_set() or self._clock() >= expires_s:
                break
            if self.warm.keep(tag, [key], [None], prefetch_until_s=expires_s):
                held += 1  # here already: now this session's too
                continue
            while self._read.pending_tokens and not self._closing.wait(PREFETCH_YIELD_S):
                pass  # requests first
            self._pace(self._read, None)
            try:
                ok = bool(self.backend.get_into([key], [scratch])[0])
            except Exception as exc:  # a miss, as for any read
                self._count_error("read_errors", exc)
                ok = False
            if not ok:
                break  # the chain is cut here: what follows cannot be a hit
            with self._lock:
                self._read.bytes_moved += self.backend.block_bytes
                self.prefetch_blocks_read += 1
            if not self.warm.keep(tag, [key], [scratch], prefetch_until_s=expires_s):
                break  # no room: the budget holds what it can
            held += 1
        return held

    def read(self, keys: Sequence[BlockKey], buffers: Sequence[Any]) -> list[bool]:
        """Read blocks and wait for the result and for the I/O into ``buffers`` to end."""
        future = self.submit_read(keys, buffers)
        result = future.result()
        future.io_done.result()
        return result

    def write(self, keys: Sequence[BlockKey], buffers: Sequence[Any]) -> list[bool]:
        """Store blocks and wait for them."""
        return self.submit_write(keys, buffers).result()

    def metrics(self) -> dict[str, float | int | None]:
        """Counters and utilization of this node's storage NIC, plus the store's stats."""
        elapsed = max(1e-9, self._clock() - self._started_s)
        out: dict[str, float | int | None] = {
            "read_queue_tokens": self._read.pending_tokens,
            "write_queue_tokens": self._write.pending_tokens,
            "snic_read_bytes": self._read.bytes_moved,
            "snic_write_bytes": self._write.bytes_moved,
            "snic_read_utilization": _utilization(self._read, elapsed),
            "snic_write_utilization": _utilization(self._write, elapsed),
        }
        stats = self.backend.stats.snapshot()
        with self._lock:
            errors = dict(self._errors)
        # a backend that catches its own read and write failures counts them itself (fs does)
        errors["read_errors"] += stats.pop("read_errors", 0)
        errors["write_errors"] += stats.pop("write_errors", 0)
        out.update(stats)
        out.update(errors)
        if self.warm is not None:  # its expiries run with the engine's heartbeats
            out.update(self.warm.snapshot())
            out["prefetch_blocks_read"] = self.prefetch_blocks_read
        return out

    def close(self, drain_s: float = CLOSE_DRAIN_S) -> None:
        """Finish pending reads, let pending writes go on for ``drain_s`` (a block whose
        write has not started by then is dropped and reported False), and stop the workers.
        A write the backend is running when the drain ends is waited for."""
        self._drain_end_s = time.monotonic() + drain_s
        self._closing.set()
        self._prefetch_pool.shutdown(wait=True, cancel_futures=True)
        self._read_pool.shutdown(wait=True)
        self._write_pool.shutdown(wait=True)
        if self._writes_dropped:
            log.warning("storage: %d queued block writes dropped at close (the %g s drain "
                        "ended first): not stored, later misses", self._writes_dropped, drain_s)
        self._deadlines.close()
        for direction in (self._read, self._write):
            if isinstance(direction.bucket, SharedBucket):
                direction.bucket.close(unlink=True)

    # -- reads -----------------------------------------------------------------------------
    def _read_block(self, read: _Read, i: int, key: BlockKey, buffer: Any,
                    deadline: float | None, keep: WarmTag | None) -> None:
        """One block of a read, on a worker: from DRAM if warm, else pace and read unless the
        deadline passed; report."""
        if read.expired:
            return  # skipped at the deadline, and its tokens released there
        maybe_warm = self.warm is not None and self.warm.holds(key)
        late = not maybe_warm and not self._pace(self._read, deadline)
        if not read.begin(i):
            return
        warm = ok = False
        try:
            warm = ok = maybe_warm and self.warm is not None and self.warm.get_into(key, buffer)
            if maybe_warm and not warm:  # its copy was damaged (or just dropped): the store
                late = not self._pace(self._read, deadline)
            if not warm and not late:  # late: the NIC cap would start it after the deadline
                ok = bool(self.backend.get_into([key], [buffer])[0])
            if ok and keep is not None and self.warm is not None:
                self.warm.keep(keep, [key], [buffer])  # a warm hit: the session holds it too
        except Exception as exc:  # store down, permission, I/O error, ...: a miss
            self._count_error("read_errors", exc)
        finally:
            with self._lock:
                self._read.pending_tokens -= self.block_size
                if ok and not warm:
                    self._read.bytes_moved += self.backend.block_bytes
                if late:
                    self._errors["read_deadline_misses"] += 1
            result, io_ended = read.end(i, ok)
            if result is not None:
                read.future.set_result(result)
            if io_ended:
                read.future.io_done.set_result(None)

    def _expire(self, read: _Read) -> None:
        """A read's deadline: report what is read, skip what has not started."""
        result, skipped, running, io_ended = read.expire()
        if result is None:
            return  # every block was read in time
        for task in read.tasks:
            task.cancel()  # a queued task would only find itself skipped
        with self._lock:
            self._read.pending_tokens -= skipped * self.block_size
            self._errors["read_deadline_misses"] += skipped + running
        read.future.set_result(result)
        if io_ended:
            read.future.io_done.set_result(None)

    # -- writes ----------------------------------------------------------------------------
    def _write_block(self, key: BlockKey, buffer: Any, keep: WarmTag | None) -> bool:
        ok = False
        try:
            if self._write_turn():
                ok = bool(self.backend.put_from([key], [buffer])[0])
            if ok and keep is not None and self.warm is not None:
                self.warm.keep(keep, [key], [buffer])
        except Exception as exc:  # store down, read-only, full, ...: not cached, never raised
            self._count_error("write_errors", exc)
        finally:
            with self._lock:
                self._write.pending_tokens -= self.block_size
                if ok:
                    self._write.bytes_moved += self.backend.block_bytes
        return ok

    # -- shared ----------------------------------------------------------------------------
    def _pace(self, direction: _Direction, deadline: float | None) -> bool:
        """Wait for the NIC cap's turn; False (without waiting) if it comes after ``deadline``."""
        if direction.bucket is None:
            return True
        with self._lock:
            wait_s = direction.bucket.reserve(self.backend.block_bytes, self._clock())
        if deadline is not None and time.monotonic() + wait_s >= deadline:
            return False
        if wait_s > 0:
            time.sleep(wait_s)  # pacing to the emulated NIC's bandwidth
        return True

    def _write_turn(self) -> bool:
        """Wait for the write cap's turn; False (the block is dropped) when a close's drain
        ends before it."""
        wait_s = 0.0
        if self._write.bucket is not None:
            with self._lock:
                wait_s = self._write.bucket.reserve(self.backend.block_bytes, self._clock())
        turn_s = time.monotonic() + wait_s
        if wait_s > 0 and not self._closing.wait(wait_s):
            return True  # paced to the emulated NIC's bandwidth, no close meanwhile
        if turn_s > self._drain_end_s:
            with self._lock:
                self._writes_dropped += 1
            return False
        time.sleep(max(0.0, turn_s - time.monotonic()))  # a close came; the turn is inside
        return True

    def _count_error(self, name: str, exc: Exception) -> None:
        with self._lock:
            self._errors[name] += 1
            first = (name, type(exc)) not in self._logged
            self._logged.add((name, type(exc)))
        if first:  # once per kind: a store that is down fails every block the same way
            log.warning("storage %s: %s: %s (counted, not raised)", name.replace("_", " "),
                        type(exc).__name__, exc)


def _utilization(direction: _Direction, elapsed_s: float) -> float | None:
    if direction.bucket is None:
        return None
    return direction.bytes_moved / (direction.bucket.rate_bytes_s * elapsed_s)
