"""A node's storage client: the read queue (``read_q``, in tokens) and the storage-NIC caps.

Every engine of a node reads and writes full blocks through one ``StorageClient``. It counts
the tokens of reads submitted but not yet finished — the paper's per-node read queue that the
scheduler balances — and, when caps are configured, paces reads and writes through token
buckets so the node behaves like one with a storage NIC of that bandwidth. Byte counters and
utilization feed the metrics.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from dualpath.config import StorageConfig
from dualpath.kv.hashing import BlockKey
from dualpath.storage.base import StorageBackend
from dualpath.storage.throttle import TokenBucket

BURST_BLOCKS = 1  # a capped NIC may send one block ahead of its average rate


def _bucket(cap_mb_s: float | None, block_bytes: int) -> TokenBucket | None:
    return None if cap_mb_s is None else TokenBucket(cap_mb_s * 1e6, BURST_BLOCKS * block_bytes)


class _Direction:
    """One direction of the storage NIC: its cap, pending tokens and moved bytes."""

    def __init__(self, bucket: TokenBucket | None) -> None:
        self.bucket = bucket
        self.pending_tokens = 0
        self.bytes_moved = 0


class StorageClient:
    """Capped, queued, parallel access to one store for the engines of a node."""

    def __init__(self, backend: StorageBackend, block_size: int,
                 config: StorageConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        config = config or StorageConfig()
        self.backend = backend
        self.block_size = block_size
        self._clock = clock
        self._started_s = clock()
        self._lock = threading.Lock()
        self._read = _Direction(_bucket(config.read_cap_mb_s, backend.block_bytes))
        self._write = _Direction(_bucket(config.write_cap_mb_s, backend.block_bytes))
        self._pool = ThreadPoolExecutor(max(1, config.workers), thread_name_prefix="storage")

    @property
    def read_queue_tokens(self) -> int:
        """Tokens of submitted reads not yet finished (the node's ``read_q``)."""
        return self._read.pending_tokens

    @property
    def write_queue_tokens(self) -> int:
        """Tokens of submitted writes not yet finished."""
        return self._write.pending_tokens

    def exists_prefix(self, keys: Sequence[BlockKey]) -> int:
        """How many leading blocks the store holds."""
        return self.backend.exists_prefix(keys)

    def submit_read(self, keys: Sequence[BlockKey], buffers: Sequence[Any]) -> Future[list[bool]]:
        """Start reading blocks into buffers; the future gives per-block success."""
        return self._submit(self._read, self.backend.get_into, keys, buffers)

    def submit_write(self, keys: Sequence[BlockKey], buffers: Sequence[Any]) -> Future[list[bool]]:
        """Start storing blocks, in order (a chain's parent lands before its child)."""
        with self._lock:
            self._write.pending_tokens += len(keys) * self.block_size
        pairs = list(zip(keys, buffers, strict=True))
        return self._pool.submit(
            lambda: [self._one(self._write, self.backend.put_from, k, b) for k, b in pairs])

    def read(self, keys: Sequence[BlockKey], buffers: Sequence[Any]) -> list[bool]:
        """Read blocks and wait for them."""
        return self.submit_read(keys, buffers).result()

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
        out.update(self.backend.stats.snapshot())
        return out

    def close(self) -> None:
        """Finish pending work and stop the workers."""
        self._pool.shutdown(wait=True)

    def _submit(self, direction: _Direction, op: Callable[..., list[bool]],
                keys: Sequence[BlockKey], buffers: Sequence[Any]) -> Future[list[bool]]:
        """One task per block, in parallel (reads)."""
        with self._lock:
            direction.pending_tokens += len(keys) * self.block_size
        block_futures = [self._pool.submit(self._one, direction, op, k, b)
                         for k, b in zip(keys, buffers, strict=True)]
        return _gather(block_futures)

    def _one(self, direction: _Direction, op: Callable[..., list[bool]], key: BlockKey,
             buffer: Any) -> bool:
        try:
            if direction.bucket is not None:
                with self._lock:
                    wait_s = direction.bucket.reserve(self.backend.block_bytes, self._clock())
                if wait_s > 0:
                    time.sleep(wait_s)  # pacing to the emulated NIC's bandwidth
            ok = op([key], [buffer])[0]
        finally:
            with self._lock:
                direction.pending_tokens -= self.block_size
        if ok:
            with self._lock:
                direction.bytes_moved += self.backend.block_bytes
        return ok


def _utilization(direction: _Direction, elapsed_s: float) -> float | None:
    if direction.bucket is None:
        return None
    return direction.bytes_moved / (direction.bucket.rate_bytes_s * elapsed_s)


def _gather(futures: list[Future[bool]]) -> Future[list[bool]]:
    """One future that completes with every block's result, in order."""
    done: Future[list[bool]] = Future()
    remaining = [len(futures)]
    lock = threading.Lock()

    def on_done(_: Future[bool]) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if not last:
            return
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            done.set_exception(errors[0])
        else:
            done.set_result([f.result() for f in futures])

    if not futures:
        done.set_result([])
    for f in futures:
        f.add_done_callback(on_done)
    return done
