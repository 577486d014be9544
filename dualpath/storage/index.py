"""Capacity accounting with least-recently-used eviction that keeps a store prefix-closed.

Pure (no clock: recency is a logical counter, or a time the caller gives). Only *leaves* —
blocks no stored block extends — are evicted, least recently used first, so whole suffixes
go before their prefixes; blocks whose prefix is gone (*orphans*, which no lookup can reach)
are evicted before anything else. With ranks (``set_ranks``: agent sessions' claims,
``retention.py``), leaves of a lower rank go first and recency orders leaves of one rank;
``set_ranks`` may also replace some blocks' recency (``retention.block_recency``: live
chains with an expected return).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass

from dualpath.kv.retention import DEFAULT_RANK, Rank

LOW_WATERMARK = 0.95  # large stores evict down to this fraction of the capacity
WATERMARK_MIN_ENTRIES = 1000


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
        self._ranks: Mapping[bytes, Rank] = {}
        self._recency: Mapping[bytes, int] = {}
        self.orphans_evicted: set[bytes] = set()  # the last ``victims`` call's orphans

    def set_ranks(self, ranks: Mapping[bytes, Rank],
                  recency: Mapping[bytes, int] | None = None) -> None:
        """Each block's rank for the next ``victims`` (absent blocks: ``DEFAULT_RANK``) and,
        for some, the recency to order them by in place of their last use (same units)."""
        self._ranks = ranks
        self._recency = recency or {}

    def _order(self, block_hash: bytes, entry: _Entry) -> tuple[int, int]:
        """Where a leaf stands in the eviction order within its rank: its recency."""
        return self._recency.get(block_hash, entry.last_used), entry.last_used

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, block_hash: bytes, parent: bytes | None, nbytes: int,
            last_used: int | None = None) -> None:
        """Record a stored block (or refresh its recency if known); ``last_used``: its
        recency from outside (a file's mtime in ns; the clock moves past it), else the next
        tick of the index's clock."""
        if block_hash in self._entries:
            self.touch(block_hash)
            return
        self._clock = max(self._clock + 1, last_used or 0)
        self._entries[block_hash] = _Entry(nbytes, parent,
                                           self._clock if last_used is None else last_used)
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

    def is_orphan(self, block_hash: bytes) -> bool:
        """True when the block's parent is not stored: lookups can never reach it."""
        parent = self._entries[block_hash].parent
        return parent is not None and parent not in self._entries

    def victims(self, target_bytes: int | None = None) -> list[bytes]:
        """Remove and return blocks until ``total_bytes <= target`` (default: once over capacity).

        Orphans go first (a chain may arrive out of order, so they are kept until space is
        needed), then leaves, lowest rank first, least recently used first. Large stores
        evict down to a low watermark (95% of capacity) so the scan here stays rare.
        """
        if target_bytes is not None:
            target = target_bytes
        elif self.capacity_bytes is None or self.total_bytes <= self.capacity_bytes:
            return []
        else:
            target = self._default_target()
        ranks = self._ranks
        heap = [(not self.is_orphan(h), ranks.get(h, DEFAULT_RANK), self._order(h, e), h)
                for h, e in self._entries.items() if self.is_leaf(h) or self.is_orphan(h)]
        heapq.heapify(heap)
        evicted = []
        self.orphans_evicted = set()
        while heap and self.total_bytes > target:
            reachable, _, (_, last_used), block_hash = heapq.heappop(heap)
            entry = self._entries.get(block_hash)
            if entry is None or entry.last_used != last_used:
                continue
            if not (self.is_leaf(block_hash) or self.is_orphan(block_hash)):
                continue
            self.remove(block_hash)
            evicted.append(block_hash)
            descendants = self._evict_descendants(block_hash)
            evicted.extend(descendants)
            if not reachable:
                self.orphans_evicted.update([block_hash, *descendants])
            parent = entry.parent
            if parent in self._entries and self.is_leaf(parent):
                heapq.heappush(heap, (True, ranks.get(parent, DEFAULT_RANK),
                                      self._order(parent, self._entries[parent]), parent))
        return evicted

    def _default_target(self) -> int:
        """Large stores evict to the low watermark so the scan is rare; small ones exactly."""
        assert self.capacity_bytes is not None
        if len(self._entries) < WATERMARK_MIN_ENTRIES:
            return self.capacity_bytes
        return int(self.capacity_bytes * LOW_WATERMARK)

    def _evict_descendants(self, block_hash: bytes) -> list[bytes]:
        """An evicted orphan's descendants are orphans too: drop them with it."""
        evicted, stack = [], list(self._children.get(block_hash, ()))
        while stack:
            child = stack.pop()
            stack.extend(self._children.get(child, ()))
            if self.remove(child):
                evicted.append(child)
        return evicted
