"""The storage backend interface: batch-first, whole full blocks only.

A backend stores one object per full block under its ``BlockKey``. Reads that fail for any
cache reason (missing, truncated, corrupt, wrong header) are *misses*, reported per block and
counted, never raised: the caller recomputes those tokens. A damaged block (``corrupt``) is
removed so the next save rewrites it; a block that a transient error kept from being read
(``read_errors``: too many open files, an I/O error, no memory) is left alone. ``StorageError``
is for misuse (bad keys, wrong buffer sizes) and for a store that cannot work at all.

Audits (``storage/verify.py``) also list the stored blocks and read one with what the store
keeps beside it (its parent hash and token ids), without counting it as a use.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any

from dualpath.errors import StorageError
from dualpath.kv.hashing import BlockKey
from dualpath.kv.retention import SessionMark

Parts = list[memoryview]  # one block's bytes, possibly scattered over several buffers


def as_parts(obj: Any) -> Parts:
    """A block buffer as its parts: a list/tuple of buffers is a scatter-gather list."""
    if isinstance(obj, list | tuple):
        return [as_buffer(part) for part in obj]
    return [as_buffer(obj)]


def as_buffer(obj: Any) -> memoryview:
    """A flat byte memoryview over ``obj`` (bytearray, mmap, numpy array or CPU tensor)."""
    if hasattr(obj, "numpy") and not isinstance(obj, memoryview):
        obj = obj.numpy()  # a torch tensor: share its memory
    view = memoryview(obj)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class StorageStats:
    """Thread-safe counters of one store (what metrics export)."""

    FIELDS = ("hits", "misses", "corrupt", "read_errors", "bytes_read", "bytes_written",
              "blocks_written", "writes_skipped", "write_errors", "blocks_evicted",
              "blocks_deleted",
              # by the sessions' claims (kv/retention.py): live sessions' blocks evicted,
              # ended or expired ones', and live ones evicted while an ended one was kept
              # (the order promises 0)
              "live_blocks_evicted", "ended_blocks_evicted", "live_evicted_before_ended")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(self.FIELDS, 0)

    def add(self, **deltas: int) -> None:
        """Add to named counters."""
        with self._lock:
            for name, delta in deltas.items():
                self._values[name] += delta

    def __getitem__(self, name: str) -> int:
        return self._values[name]

    def snapshot(self) -> dict[str, int]:
        """A copy of every counter."""
        with self._lock:
            return dict(self._values)


class StorageBackend(ABC):
    """Where full blocks live between turns."""

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.stats = StorageStats()

    @abstractmethod
    def exists_prefix(self, keys: Sequence[BlockKey]) -> int:
        """How many leading ``keys`` are stored (stops at the first absent one)."""

    @abstractmethod
    def get_into(self, keys: Sequence[BlockKey], buffers: Sequence[Any]) -> list[bool]:
        """Read each block into its buffer; per block True if read and verified, else a miss.

        A buffer may be a list of buffers: the block's bytes are scattered over them in order
        (how a layer-major host buffer receives full blocks without a copy).
        """

    @abstractmethod
    def put_from(self, keys: Sequence[BlockKey], buffers: Sequence[Any]) -> list[bool]:
        """Store each buffer under its key; per block True if stored (or already there)."""

    @abstractmethod
    def delete(self, keys: Sequence[BlockKey]) -> int:
        """Remove the blocks; returns how many existed."""

    def mark_session(self, session_key: str, mark: SessionMark) -> bool:
        """Record that an agent session's chain ends at ``mark.tip`` and how long it is wanted
        (``retention.py``), so eviction spares live sessions and takes ended ones first;
        ``session_key`` names the session (the same key replaces its earlier mark). Returns
        whether this backend keeps it (False: it evicts without regard to sessions);
        ``OSError`` where it could not be written."""
        return False

    def close(self) -> None:  # noqa: B027 - optional hook, most backends hold nothing
        """Release worker threads and files (idempotent)."""

    def stored_keys(self) -> Iterator[BlockKey]:
        """The key of every stored block, in no set order (parent and token ids unset: see
        ``read_block``); ``StorageError`` where the backend cannot list its blocks."""
        raise StorageError(f"{type(self).__name__} cannot list its blocks")

    def read_block(self, key: BlockKey, buffer: Any = None) -> BlockKey | None:
        """The key of ``key``'s block as stored, with its parent hash and token ids (None
        where it holds none), or None when the block is absent or damaged; with a buffer, the
        block's verified payload is read into it too. For audits: nothing is counted, made
        more recent or removed."""
        raise StorageError(f"{type(self).__name__} cannot read a block for an audit")

    def _check_batch(self, keys: Sequence[BlockKey], buffers: Sequence[Any]) -> list[Parts]:
        """Each block's buffer as parts (a buffer, or a scatter list of them) of a block's size."""
        if len(keys) != len(buffers):
            raise StorageError(f"{len(keys)} keys but {len(buffers)} buffers")
        views = [as_parts(b) for b in buffers]
        for parts in views:
            nbytes = sum(p.nbytes for p in parts)
            if nbytes != self.block_bytes:
                raise StorageError(f"buffer of {nbytes} bytes, a block is {self.block_bytes}")
        for key in keys:
            if not isinstance(key, BlockKey):
                raise StorageError(f"expected a BlockKey, got {type(key).__name__}")
        return views

    def __enter__(self) -> StorageBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
