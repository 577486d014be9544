"""Capacity accounting with least-recently-used eviction that keeps a store prefix-closed.

Pure (no clock: recency is a logical counter). Only *leaves* — blocks no stored block extends
— are evicted, least recently used first, so whole suffixes go before their prefixes and every
block that stays still has its prefix stored.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass


@dataclass
class _Entry:
    nbytes: int
    parent: bytes | None
    last_used: int


class PrefixLRUIndex:
    """Which blocks a store holds, their sizes, parents and recency."""

    def __init__(self, capacity_bytes: int | None) -> None:
        self.capacity_bytes = capacity_bytes
        self.total_bytes = 0
        self._entries: dict[bytes, _Entry] = {}
        self._children: dict[bytes, set[bytes]] = {}
        self._clock = 0

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, block_hash: bytes, parent: bytes | None, nbytes: int) -> None:
        """Record a stored block (or refresh its recency if known)."""
        if block_hash in self._entries:
            self.touch(block_hash)
            return
        self._clock += 1
        self._entries[block_hash] = _Entry(nbytes, parent, self._clock)
        self.total_bytes += nbytes
        if parent is not None:
            self._children.setdefault(parent, set()).add(block_hash)

    def touch(self, block_hash: bytes) -> None:
        """Mark a block as just used."""
        entry = self._entries.get(block_hash)
        if entry is not None:
            self._clock += 1
            entry.last_used = self._clock

    def remove(self, block_hash: bytes) -> bool:
        """Forget a block; returns whether it was known."""
        entry = self._entries.pop(block_hash, None)
        if entry is None:
            return False
        self.total_bytes -= entry.nbytes
        if entry.parent is not None:
            siblings = self._children.get(entry.parent)
            if siblings is not None:
                siblings.discard(block_hash)
                if not siblings:
                    del self._children[entry.parent]
        return True

    def is_leaf(self, block_hash: bytes) -> bool:
        """True when no stored block has this one as its parent."""
        return not self._children.get(block_hash)

    def victims(self, target_bytes: int | None = None) -> list[bytes]:
        """Remove and return blocks, leaves LRU-first, until ``total_bytes <= target``.

        ``target`` defaults to the capacity; nothing is evicted without a capacity.
        """
        target = self.capacity_bytes if target_bytes is None else target_bytes
        if target is None or self.total_bytes <= target:
            return []
        heap = [(e.last_used, h) for h, e in self._entries.items() if self.is_leaf(h)]
        heapq.heapify(heap)
        evicted = []
        while heap and self.total_bytes > target:
            last_used, block_hash = heapq.heappop(heap)
            entry = self._entries.get(block_hash)
            if entry is None or entry.last_used != last_used or not self.is_leaf(block_hash):
                continue
            self.remove(block_hash)
            evicted.append(block_hash)
            parent = entry.parent
            if parent in self._entries and self.is_leaf(parent):
                heapq.heappush(heap, (self._entries[parent].last_used, parent))
        return evicted
