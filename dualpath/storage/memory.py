"""In-memory store: the same contract as ``fs`` without a disk (tests, simulator)."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

from dualpath.kv.hashing import BlockKey
from dualpath.storage.base import StorageBackend
from dualpath.storage.index import PrefixLRUIndex


class MemoryStore(StorageBackend):
    """Blocks kept as bytes in a dict, with optional capacity and LRU suffix eviction."""

    def __init__(self, block_bytes: int, capacity_bytes: int | None = None) -> None:
        super().__init__(block_bytes)
        self._blocks: dict[bytes, bytes] = {}  # by block hash (seeded by model and layout)
        self._keys: dict[bytes, BlockKey] = {}  # each block's key as saved (parent, token ids)
        self._index = PrefixLRUIndex(capacity_bytes)
        self._lock = threading.Lock()

    def exists_prefix(self, keys: Sequence[BlockKey]) -> int:
        with self._lock:
            count = 0
            for key in keys:
                if key.block_hash not in self._blocks:
                    break
                self._index.touch(key.block_hash)
                count += 1
            return count

    def get_into(self, keys: Sequence[BlockKey], buffers: Sequence[Any]) -> list[bool]:
        views = self._check_batch(keys, buffers)
        found = []
        for key, parts in zip(keys, views, strict=True):
            with self._lock:
                data = self._blocks.get(key.block_hash)
                self._index.touch(key.block_hash)
            if data is None:
                self.stats.add(misses=1)
                found.append(False)
                continue
            offset = 0
            for part in parts:
                part[:] = data[offset : offset + part.nbytes]
                offset += part.nbytes
            self.stats.add(hits=1, bytes_read=len(data))
            found.append(True)
        return found

    def put_from(self, keys: Sequence[BlockKey], buffers: Sequence[Any]) -> list[bool]:
        views = self._check_batch(keys, buffers)
        for key, parts in zip(keys, views, strict=True):
            with self._lock:
                if key.block_hash in self._blocks:
                    self._index.touch(key.block_hash)
                    self.stats.add(writes_skipped=1)
                    continue
                self._blocks[key.block_hash] = b"".join(parts)
                self._keys[key.block_hash] = key
                self._index.add(key.block_hash, key.parent, self.block_bytes)
                self._evict()
            self.stats.add(blocks_written=1, bytes_written=self.block_bytes)
        return [True] * len(keys)

    def delete(self, keys: Sequence[BlockKey]) -> int:
        with self._lock:
            removed = 0
            for key in keys:
                if self._blocks.pop(key.block_hash, None) is not None:
                    del self._keys[key.block_hash]
                    self._index.remove(key.block_hash)
                    removed += 1
        self.stats.add(blocks_deleted=removed)
        return removed

    def stored_keys(self) -> Iterator[BlockKey]:
        with self._lock:
            keys = list(self._keys.values())
        for key in keys:
            yield BlockKey(key.model_id, key.layout_id, key.block_size, key.block_hash)

    def read_block(self, key: BlockKey, buffer: Any = None) -> BlockKey | None:
        parts = None if buffer is None else self._check_batch([key], [buffer])[0]
        with self._lock:
            data = self._blocks.get(key.block_hash)
            stored = self._keys.get(key.block_hash)
        if data is None or stored is None or stored != key:
            return None
        offset = 0
        for part in parts or ():
            part[:] = data[offset : offset + part.nbytes]
            offset += part.nbytes
        return stored

    def _evict(self) -> None:
        victims = self._index.victims()
        for block_hash in victims:
            del self._blocks[block_hash]
            del self._keys[block_hash]
        self.stats.add(blocks_evicted=len(victims))
