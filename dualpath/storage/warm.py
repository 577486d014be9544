"""Warm sessions: verified copies of an agent session's blocks kept in this node's host DRAM.

After a turn, the blocks an engine read or stored for a session may stay here, so the
session's next turn, placed on this engine, reads its hit from memory instead of through the
storage NIC (``StorageClient`` asks this first). A *prefetch* brings a session's stored chain
here during the agent's tool time (``StorageClient.prefetch``); it is wanted only until its
expiry, and a prefetch dropped (expired or pushed out) before any use is counted as wasted.
The budget is bounded (bytes); what goes when it is full is a whole session: expired
prefetches, then prefetches not used yet, then the least recently used session whose lease ran
out, then leased ones. A block shared by several sessions is kept once and goes with the last
of them. Each copy carries its payload's checksum and is checked on every use: a damaged copy
is dropped and read from storage (a miss here, never wrong KV). Sessions dropped for room or
expiry are listed for the router (``take_dropped``), which then stops sending their turns
here. Thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dualpath.kv.hashing import BlockKey
from dualpath.storage.base import as_parts
from dualpath.storage.block_file import checksum

WARM_FIELDS = ("warm_hits", "warm_damaged", "warm_kept_blocks", "warm_sessions_dropped",
               "warm_prefetch_used", "warm_prefetch_wasted")
MAX_DROPPED_LISTED = 1024  # drop notices kept for the router between two heartbeats


@dataclass(frozen=True)
class WarmTag:
    """Which session a request's blocks belong to, and how long they are wanted at least."""

    session: str  # the router's key of the session (a hash: no client text)
    lease_s: float = 0.0  # kept before any unleased session's blocks for this long


def warm_tag(session: str, lease_s: float) -> WarmTag | None:
    """The tag a request message carries (None: it names no session)."""
    return WarmTag(session, max(0.0, lease_s)) if session else None


@dataclass
class _Block:
    data: bytes
    digest: int
    sessions: set[str] = field(default_factory=set)


@dataclass
class _Session:
    blocks: set[bytes] = field(default_factory=set)
    lease_until_s: float = 0.0
    prefetch_until_s: float | None = None  # a prefetch not used yet: wanted until then


class WarmBlocks:
    """Blocks of recent sessions in DRAM, within ``budget_bytes``."""

    def __init__(self, budget_bytes: int, clock: Callable[[], float]) -> None:
        self.budget_bytes = budget_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self._blocks: dict[bytes, _Block] = {}
        self._sessions: OrderedDict[str, _Session] = OrderedDict()  # least recent first
        self.held_bytes = 0
        self.counts = dict.fromkeys(WARM_FIELDS, 0)
        self._dropped: list[str] = []  # sessions let go for room or expiry, for the router

    def keep(self, tag: WarmTag, keys: Sequence[BlockKey], buffers: Sequence[Any],
             prefetch_until_s: float | None = None) -> int:
        """Copy the blocks in as ``tag``'s session's (the session becomes the most recent);
        returns how many are held now. A session larger than the budget keeps its first
        blocks only. ``prefetch_until_s``: a prefetch's blocks, wanted until then unless used
        (a session already here stays what it was). A buffer of None adopts the block if it is
        here already (no copy)."""
        with self._lock:
            fresh = tag.session not in self._sessions
            session = self._sessions.pop(tag.session, None) or _Session()
            self._sessions[tag.session] = session
            if fresh and prefetch_until_s is not None:
                session.prefetch_until_s = prefetch_until_s
            session.lease_until_s = max(session.lease_until_s, self._clock() + tag.lease_s)
            kept = 0
            for key, buffer in zip(keys, buffers, strict=True):
                if self._hold(tag.session, session, key.block_hash, buffer):
                    kept += 1
            self.counts["warm_kept_blocks"] += kept
            return kept

    def get_into(self, key: BlockKey, buffer: Any) -> bool:
        """Copy a warm block into ``buffer`` (a buffer or a scatter list); False when it is
        not here or its copy is damaged (then dropped)."""
        with self._lock:
            block = self._blocks.get(key.block_hash)
            if block is None:
                return False
            if checksum(memoryview(block.data)) != block.digest:
                self.counts["warm_damaged"] += 1
                self._forget(key.block_hash)
                return False
            for name in block.sessions:  # a use: its sessions become the most recent
                self._sessions.move_to_end(name)
                if self._sessions[name].prefetch_until_s is not None:
                    self._sessions[name].prefetch_until_s = None  # a prefetch that paid off
                    self.counts["warm_prefetch_used"] += 1
            data = memoryview(block.data)
        offset = 0
        for part in as_parts(buffer):
            part[:] = data[offset:offset + part.nbytes]
            offset += part.nbytes
        with self._lock:
            self.counts["warm_hits"] += 1
        return True

    def holds(self, key: BlockKey) -> bool:
        """Whether a copy of the block is here (unchecked)."""
        with self._lock:
            return key.block_hash in self._blocks

    def drop(self, session: str) -> int:
        """Let a session's blocks go (those no other session holds); returns how many went."""
        with self._lock:
            return self._drop(session)

    def expire(self) -> int:
        """Drop the prefetches whose expiry passed unused; returns how many went."""
        now = self._clock()
        with self._lock:
            gone = [n for n, s in self._sessions.items()
                    if s.prefetch_until_s is not None and s.prefetch_until_s <= now]
            for name in gone:
                self._let_go(name)
            return len(gone)

    def take_dropped(self) -> tuple[str, ...]:
        """The sessions let go for room or expiry since the last call (at most
        ``MAX_DROPPED_LISTED``, the latest)."""
        with self._lock:
            dropped, self._dropped = self._dropped[-MAX_DROPPED_LISTED:], []
            return tuple(dropped)

    def snapshot(self) -> dict[str, int]:
        """The counters, with the bytes and sessions held."""
        with self._lock:
            return {**self.counts, "warm_bytes": self.held_bytes,
                    "warm_sessions": len(self._sessions)}

    def _hold(self, name: str, session: _Session, block_hash: bytes, buffer: Any) -> bool:
        """Hold one block for ``name`` (a copy of ``buffer`` unless it is here already)."""
        block = self._blocks.get(block_hash)
        if block is None and buffer is None:
            return False  # adopting a block that went meanwhile
        if block is None:
            parts = as_parts(buffer)
            nbytes = sum(p.nbytes for p in parts)
            if nbytes > self.budget_bytes or not self._make_room(nbytes, name):
                return False
            data = b"".join(bytes(p) for p in parts) if len(parts) > 1 else bytes(parts[0])
            block = _Block(data, checksum(memoryview(data)))
            self._blocks[block_hash] = block
            self.held_bytes += len(data)
        block.sessions.add(name)
        session.blocks.add(block_hash)
        return True

    def _make_room(self, nbytes: int, keeping: str) -> bool:
        """Drop whole sessions until ``nbytes`` fit, never the session being kept: expired
        prefetches, unused prefetches, then the least recent unleased session, then any."""
        now = self._clock()
        while self.held_bytes + nbytes > self.budget_bytes:
            others = [(n, s) for n, s in self._sessions.items() if n != keeping]
            if not others:
                return False
            self._let_go(min(others, key=lambda item: _drop_order(item[1], now))[0])
        return True

    def _let_go(self, name: str) -> None:
        """Drop a session for room or expiry: counted, and listed for the router."""
        session = self._sessions.get(name)
        if session is not None and session.prefetch_until_s is not None:
            self.counts["warm_prefetch_wasted"] += 1
        self._drop(name)
        self.counts["warm_sessions_dropped"] += 1
        self._dropped.append(name)
        del self._dropped[:-MAX_DROPPED_LISTED]

    def _drop(self, name: str) -> int:
        """Forget a session and the blocks only it held."""
        session = self._sessions.pop(name, None)
        if session is None:
            return 0
        gone = 0
        for block_hash in session.blocks:
            block = self._blocks.get(block_hash)
            if block is None:
                continue
            block.sessions.discard(name)
            if not block.sessions:
                self._forget(block_hash)
                gone += 1
        return gone

    def _forget(self, block_hash: bytes) -> None:
        block = self._blocks.pop(block_hash, None)
        if block is None:
            return
        self.held_bytes -= len(block.data)
        for name in block.sessions:
            session = self._sessions.get(name)
            if session is not None:
                session.blocks.discard(block_hash)


def _drop_order(session: _Session, now: float) -> int:
    """Which sessions go first: expired prefetches (0), unused prefetches (1), unleased (2),
    leased (3); ``min`` over the sessions in recency order picks the least recent of a class."""
    if session.prefetch_until_s is not None:
        return 0 if session.prefetch_until_s <= now else 1
    return 2 if session.lease_until_s <= now else 3
