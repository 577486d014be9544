"""Capacity of an ``fs`` store shared by many processes on many hosts.

The block files are the truth. **Recency** is a block file's mtime, set to the writer's or
reader's wall clock in ns on every write and use (``os.utime``); hosts sharing a root keep their
clocks in sync. **Usage** is a ledger, ``<root>/.usage``, that writers add to under a lock; it
only steers, and a pass also runs after every ``RESCAN_FRACTION`` of the capacity written.
**Eviction** is a pass under ``<root>/.evict.lock``: scan block files (size, mtime, parent), let
``PrefixLRUIndex`` choose orphans first, then leaves by their sessions' claims (the marks in
``<root>/.sessions``, ``session_marks``: ended sessions' chains first, live ones last,
``kv/retention``) and least recently used first, down to the capacity (95% of it from 1,000
blocks), and unlink them. A writer whose batch takes the ledger over the
capacity runs a pass unless another writer's already made room; passes remove leaves only, so
the store stays prefix-closed for readers. The lock (:mod:`dualpath.storage.lock_file`) is
``flock``, falling back to an ``O_EXCL`` lease file broken after ``STALE_LOCK_S``; pass
``lock="excl"`` where ``flock`` locks only the local host (NFS ``local_lock=flock``, some FUSE).

Why it holds (clock ticks, the ledger's errors, prefix-closure): docs/derivations.md,
'storage/fs_capacity.py'.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dualpath.kv.retention import (
    DEFAULT_RANK,
    Rank,
    Retention,
    SessionMark,
    block_ranks,
    block_recency,
    surviving_tip,
)
from dualpath.storage.base import StorageStats
from dualpath.storage.block_file import HEADER_BYTES, BadBlockFile, unpack_header
from dualpath.storage.file_reads import preadv_full, read_file_into
from dualpath.storage.index import PrefixLRUIndex
from dualpath.storage.lock_file import LockFile
from dualpath.storage.session_marks import SessionMarks

log = logging.getLogger("dualpath.storage")

SUFFIX = ".kvb"
LEDGER_NAME = ".usage"
EVICT_LOCK_NAME = ".evict.lock"
RESCAN_FRACTION = 0.5  # a pass runs at least once per half a capacity written
LOCK_WAIT_S = 60.0  # how long a writer waits for another host's pass before giving up on it
LEASE_REFRESH_ENTRIES = 4096  # a long pass refreshes its O_EXCL lease this often (entries)
_LEDGER = struct.Struct("<4sBqq")  # magic, anchored to a scan, total bytes, bytes since scan
_LEDGER_MAGIC = b"DPUL"


@dataclass(frozen=True)
class Usage:
    """What the ledger says."""

    anchored: bool  # set by a pass's scan (False: nobody has measured this root yet)
    total_bytes: int  # block-file bytes in the store, by the ledger
    since_scan_bytes: int  # bytes written since the last pass


class Ledger:
    """The running total of block-file bytes, in a small file every writer updates (created
    with ``file_mode``)."""

    def __init__(self, path: Path, lock: LockFile, file_mode: int = 0o600) -> None:
        self.path = path
        self.lock = lock
        self.file_mode = file_mode

    def read(self) -> Usage | None:
        """The current usage (None if the ledger's lock stayed held)."""
        return self._update(None)

    def add(self, nbytes: int) -> Usage | None:
        """Add written (positive) or removed (negative) bytes; returns the new usage."""
        return self._update(lambda u: Usage(u.anchored, u.total_bytes + nbytes,
                                            u.since_scan_bytes + max(0, nbytes)))

    def anchor(self, before: Usage, measured_bytes: int) -> Usage | None:
        """Set the total to a scan's measurement plus what others recorded since ``before``."""
        return self._update(lambda u: Usage(
            True, max(0, measured_bytes + u.total_bytes - before.total_bytes),
            max(0, u.since_scan_bytes - before.since_scan_bytes)))

    def _update(self, change: Callable[[Usage], Usage] | None) -> Usage | None:
        if not self.lock.acquire(LOCK_WAIT_S):
            log.warning("the ledger lock %s stayed held for %.0f s", self.lock.path, LOCK_WAIT_S)
            return None
        try:
            # opened per update: NFS close-to-open consistency then shows every host's write
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, self.file_mode)
            try:
                raw = bytearray(_LEDGER.size)
                usage = _parse(bytes(raw[: preadv_full(fd, [raw])]))
                if change is not None:
                    usage = change(usage)
                    os.pwrite(fd, _LEDGER.pack(_LEDGER_MAGIC, usage.anchored,
                                               usage.total_bytes, usage.since_scan_bytes), 0)
                return usage
            finally:
                os.close(fd)
        finally:
            self.lock.release()


def _parse(raw: bytes) -> Usage:
    if len(raw) == _LEDGER.size:
        magic, anchored, total, since = _LEDGER.unpack(raw)
        if magic == _LEDGER_MAGIC:
            return Usage(bool(anchored), total, since)
    return Usage(False, 0, 0)  # absent or damaged: unknown until the next scan


@dataclass(frozen=True)
class BlockFile:
    """One block file as a scan found it."""

    path: str
    parent: bytes | None
    nbytes: int
    mtime_ns: int


class SharedCapacity:
    """Keeps the block files under ``root`` within ``capacity_bytes``, for every writer; its
    ledger and lock files are created with ``file_mode`` (the store's)."""

    def __init__(self, root: Path, capacity_bytes: int, *, lock: str = "flock",
                 file_mode: int = 0o600, marks: SessionMarks | None = None,
                 stats: StorageStats | None = None, by_sessions: bool = True) -> None:
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self.root = root
        self.capacity_bytes = capacity_bytes
        self.rescan_bytes = max(1, int(capacity_bytes * RESCAN_FRACTION))
        self.ledger = Ledger(root / LEDGER_NAME,
                             LockFile(root / (LEDGER_NAME + ".lock"), lock, file_mode), file_mode)
        self.evict_lock = LockFile(root / EVICT_LOCK_NAME, lock, file_mode)
        self.marks = marks or SessionMarks(root, file_mode)
        self.stats = stats or StorageStats()  # the store's: passes add eviction counts by claim
        # False: evict by recency alone (the marks still count what each pass took)
        self.by_sessions = by_sessions
        self._parents: dict[bytes, bytes | None] = {}  # block hash -> parent, from headers
        self.passes = 0
        self.last_pass_s = 0.0
        self.last_scan_blocks = 0
        self.last_pass_marks = 0  # session marks the last pass ranked blocks by

    def added(self, nbytes: int) -> int:
        """Account ``nbytes`` of new block files; evicts if due. Returns the blocks evicted.

        Never raises for a store problem (a lock or ledger that cannot be written): that is
        logged, and the next writer's pass catches up.
        """
        try:
            usage = self.ledger.add(nbytes)
            return self.evict() if usage is None or self._due(usage) else 0
        except OSError as exc:
            log.warning("capacity accounting failed under %s: %s", self.root, exc)
            return 0

    def removed(self, nbytes: int) -> None:
        """Account block files removed outside a pass (deletes, corrupt blocks)."""
        if not nbytes:
            return
        try:
            self.ledger.add(-nbytes)
        except OSError as exc:
            log.warning("capacity accounting failed under %s: %s", self.root, exc)

    def evict(self, force: bool = False) -> int:
        """Run a pass if one is still due (or ``force``); returns the blocks it evicted."""
        if not self.evict_lock.acquire(LOCK_WAIT_S):
            log.warning("no eviction: %s stayed held for %.0f s", self.evict_lock.path,
                        LOCK_WAIT_S)
            return 0
        try:
            before = self.ledger.read()
            if before is None or not (force or self._due(before)):
                return 0  # another writer's pass made room while this one waited
            return self._pass(before)
        finally:
            self.evict_lock.release()

    def _due(self, usage: Usage) -> bool:
        return (not usage.anchored or usage.total_bytes > self.capacity_bytes
                or usage.since_scan_bytes >= self.rescan_bytes)

    def _pass(self, before: Usage) -> int:
        start = time.perf_counter()
        blocks = self.scan()
        index = PrefixLRUIndex(self.capacity_bytes)
        for block_hash, block in sorted(blocks.items(), key=lambda kv: kv[1].mtime_ns):
            index.add(block_hash, block.parent, block.nbytes, block.mtime_ns)
        now_ns = time.time_ns()  # marks hold wall-clock times, like the files' mtimes
        marks = self.marks.load(now_ns)
        parents = {h: block.parent for h, block in blocks.items()} if marks else {}
        ranks = block_ranks(parents, marks.values(), now_ns) if marks else {}
        if self.by_sessions and marks:
            index.set_ranks(ranks, block_recency(parents, marks.values(), now_ns))
        self.last_pass_marks = len(marks)
        measured = index.total_bytes
        victims = index.victims()
        self.stats.add(**claims_evicted(ranks, victims, index.orphans_evicted))
        self._follow_chains(marks, parents, set(victims))
        freed = evicted = 0
        for block_hash in victims:
            block = blocks[block_hash]
            try:
                os.unlink(block.path)
            except FileNotFoundError:
                continue  # deleted meanwhile: whoever deleted it accounted for it
            except OSError as exc:
                log.warning("could not evict %s: %s", block.path, exc)
                continue
            freed += block.nbytes
            evicted += 1
            self._parents.pop(block_hash, None)
        self.ledger.anchor(before, measured - freed)
        self.passes += 1
        self.last_pass_s = time.perf_counter() - start
        self.last_scan_blocks = len(blocks)
        return evicted

    def _follow_chains(self, marks: dict[str, SessionMark], parents: dict[bytes, bytes | None],
                       gone: set[bytes]) -> None:
        """A mark whose tip this pass takes moves to what is left of its chain, so the next
        pass still knows whose blocks they are."""
        for name, mark in marks.items():
            start = mark.start(parents)
            if start is not None and start in gone:
                try:
                    self.marks.retarget(name, mark, surviving_tip(parents, start, gone))
                except OSError as exc:
                    log.warning("could not move the session mark %s: %s", name, exc)

    def scan(self) -> dict[bytes, BlockFile]:
        """Every block file under ``root`` (dot files — temp, ledger, locks — skipped)."""
        found: dict[bytes, BlockFile] = {}
        parents: dict[bytes, bytes | None] = {}
        stack = [str(self.root)]
        seen = 0
        while stack:
            try:
                entries = list(os.scandir(stack.pop()))
            except (FileNotFoundError, NotADirectoryError):
                continue  # a directory removed meanwhile
            for entry in entries:
                if entry.name.startswith("."):
                    continue
                seen += 1
                if seen % LEASE_REFRESH_ENTRIES == 0:
                    self.evict_lock.refresh()
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                    continue
                block = self._block(entry, parents)
                if block is not None:
                    found[block[0]] = block[1]
        self._parents = parents  # forget the blocks that are gone
        return found

    def _block(self, entry: os.DirEntry[str],
               parents: dict[bytes, bytes | None]) -> tuple[bytes, BlockFile] | None:
        if not entry.name.endswith(SUFFIX):
            return None
        try:
            block_hash = bytes.fromhex(entry.name[: -len(SUFFIX)])
            st = entry.stat(follow_symlinks=False)
        except (ValueError, OSError):
            return None  # not a block file name, or removed meanwhile
        if block_hash in self._parents:
            parent = self._parents[block_hash]
        else:
            try:
                parent = _read_parent(entry.path)
            except FileNotFoundError:
                return None  # evicted or deleted meanwhile
            except (OSError, BadBlockFile):
                # a damaged block still takes space: counted, and evicted as a chain of its
                # own; not cached, so a rewrite under this name is read again
                return block_hash, BlockFile(entry.path, None, st.st_size, st.st_mtime_ns)
        parents[block_hash] = parent  # a block's parent is part of its hash: cache it
        return block_hash, BlockFile(entry.path, parent, st.st_size, st.st_mtime_ns)


def claims_evicted(ranks: dict[bytes, Rank], victims: list[bytes],
                   orphans: set[bytes] = frozenset()) -> dict[str, int]:  # type: ignore[assignment]
    """A pass's victims counted by their sessions' claims, and the live ones it took while an
    ended or expired session's block stayed (the order promises none; orphans, which no
    lookup reaches, go first whoever they belong to and are not counted as live)."""
    live = sum(ranks.get(h, DEFAULT_RANK)[0] == Retention.LIVE for h in victims
               if h not in orphans)
    ended = sum(ranks.get(h, DEFAULT_RANK)[0] == Retention.ENDED for h in victims)
    ended_kept = sum(r[0] == Retention.ENDED for r in ranks.values()) - ended
    return {"live_blocks_evicted": live, "ended_blocks_evicted": ended,
            "live_evicted_before_ended": live if ended_kept else 0}


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (one we may not signal exists too)."""
    if pid <= 0:
        return False  # 0 and negatives name process groups, never a file's owner
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    except OverflowError:  # not a pid this system can have
        return False
    return True


def stored_bytes(root: Path) -> int:
    """The block-file bytes under ``root``: the ledger's total once a pass has measured it,
    else a walk of the tree (a store that was never capped; an empty one is quick)."""
    try:
        usage = _parse((root / LEDGER_NAME).read_bytes()[: _LEDGER.size])
    except OSError:
        usage = Usage(False, 0, 0)
    if usage.anchored:
        return usage.total_bytes
    total = 0
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            if name.endswith(SUFFIX) and not name.startswith("."):
                with contextlib.suppress(OSError):
                    total += os.stat(os.path.join(folder, name)).st_size
    return total


def _read_parent(path: str) -> bytes | None:
    """The parent hash in a block file's header (None for a sequence's first block)."""
    raw = bytearray(HEADER_BYTES)
    return unpack_header(raw[: read_file_into(path, [raw])]).parent
