"""Capacity of an ``fs`` store shared by many processes on many hosts.

The block files are the truth; nothing else is trusted for long:

* **Recency** is a block file's mtime. Writing a block sets it; every use — a read hit, an
  ``exists_prefix`` hit, a skipped rewrite — sets it to now (``os.utime``). "Now" is the
  writer's or reader's wall clock in ns, not the file system's: ext4 here stamps in 4 ms
  ticks, so most uses would tie. Hosts sharing a root must keep their clocks in sync (NTP):
  a host whose clock is s seconds behind makes its uses look s seconds older.
* **Usage** is kept in a small ledger file, ``<root>/.usage``: a running total of block-file
  bytes that every writer adds to under a lock after each batch it writes. The ledger only
  steers; the eviction pass measures the directory and re-anchors it. It errs high (a write
  that lands while a pass scans may be counted twice, costing one extra pass), low only when a
  writer dies between its rename and its ledger update, or when a block is deleted while a pass
  scans — so a pass also runs after every ``RESCAN_FRACTION`` of the capacity written, whatever
  the ledger says.
* **Eviction** is a pass under the store-wide lock ``<root>/.evict.lock``: list every block file
  with its size, mtime and parent (from its header, read once per process and cached: a block's
  parent is part of its hash), then let the pure ``PrefixLRUIndex`` choose victims — orphans
  (parent gone) first, then leaves least recently used first — down to the capacity (95% of it
  for stores of 1,000 blocks or more, so passes stay rare), and unlink them.

A writer whose batch takes the ledger over the capacity waits for the lock and, once it holds
it, runs a pass unless the ledger says another writer's pass already made room. So usage stays
within the capacity plus the batch each writer has in flight (one block for ``StorageClient``,
which writes block by block). The store stays prefix-closed for readers: a pass removes leaves
only; a child written after the scan under a parent the pass then removes is an orphan, which
``exists_prefix`` never reaches (it stops at the missing parent) and the next pass removes first.

Only open/pread/pwrite/rename/unlink/stat/utime and a lock are used. The lock is ``flock`` on a
lock file; where ``flock`` is refused (ENOLCK, EOPNOTSUPP, ...) it falls back to an ``O_EXCL``
lock file with a lease that a waiter breaks after ``STALE_LOCK_S`` without change. Pass
``lock="excl"`` for mounts whose ``flock`` silently locks only the local host (NFS mounted with
``local_lock=flock``, FUSE filesystems without lock support).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dualpath.storage.block_file import HEADER_BYTES, BadBlockFile, unpack_header
from dualpath.storage.index import PrefixLRUIndex

log = logging.getLogger("dualpath.storage")

SUFFIX = ".kvb"
LEDGER_NAME = ".usage"
EVICT_LOCK_NAME = ".evict.lock"
RESCAN_FRACTION = 0.5  # a pass runs at least once per half a capacity written
LOCK_WAIT_S = 60.0  # how long a writer waits for another host's pass before giving up on it
STALE_LOCK_S = 30.0  # an O_EXCL lock file unchanged this long belongs to a dead holder
LEASE_REFRESH_ENTRIES = 4096  # a long pass refreshes its O_EXCL lease this often (entries)
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF}
_LEDGER = struct.Struct("<4sBqq")  # magic, anchored to a scan, total bytes, bytes since scan
_LEDGER_MAGIC = b"DPUL"


class LockFile:
    """An exclusive lock shared by every process and host that opens the same ``path``."""

    def __init__(self, path: Path, mode: str = "flock") -> None:
        if mode not in ("flock", "excl"):
            raise ValueError(f"lock mode {mode!r} (flock, excl)")
        self.path = path
        self.mode = mode
        self._held = path.with_name(path.name + ".held")  # the O_EXCL lock file
        self._threads = threading.Lock()  # one holder per process at a time, then per host
        self._fd: int | None = None
        self._token = b""
        self._seen: tuple[int, int] | None = None  # (inode, mtime) of a held O_EXCL file ...
        self._seen_since = 0.0  # ... and since when (local monotonic) it has not changed

    def acquire(self, timeout_s: float) -> bool:
        """Take the lock, waiting up to ``timeout_s``; False if it stayed held by another."""
        deadline = time.monotonic() + timeout_s
        if not self._threads.acquire(timeout=timeout_s):
            return False
        pause = 0.001
        while True:
            try:
                if self._try_acquire():
                    return True
            except BaseException:
                self._threads.release()
                raise
            if time.monotonic() >= deadline:
                self._threads.release()
                return False
            time.sleep(pause)  # polling: a blocking flock could hang on a dead NFS server
            pause = min(pause * 2, 0.05)

    def release(self) -> None:
        """Give the lock up (only the thread that holds it calls this)."""
        try:
            if self._fd is not None:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
                os.close(self._fd)
                self._fd = None
            elif self._token:
                self._release_excl()
        finally:
            self._threads.release()

    def _release_excl(self) -> None:
        try:
            with open(self._held, "rb") as f:
                still_ours = f.read() == self._token
            if still_ours:  # not broken as stale and taken by another meanwhile
                os.unlink(self._held)
        except OSError:
            pass
        self._token = b""

    def refresh(self) -> None:
        """Keep an O_EXCL lease alive during a long hold."""
        if self._token:
            with contextlib.suppress(OSError):
                os.utime(self._held)

    def _try_acquire(self) -> bool:
        if self.mode == "flock":
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            except OSError as exc:
                os.close(fd)
                if exc.errno not in _UNSUPPORTED:
                    raise
                log.warning("flock refused on %s (%s): using O_EXCL lock files", self.path, exc)
                self.mode = "excl"
                return self._try_excl()
            self._fd = fd
            return True
        return self._try_excl()

    def _try_excl(self) -> bool:
        token = f"{socket.gethostname()} {os.getpid()} {uuid.uuid4().hex}".encode()
        try:
            fd = os.open(self._held, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            self._break_if_stale()
            return False
        try:
            os.write(fd, token)
        finally:
            os.close(fd)
        self._token = token
        self._seen = None
        return True

    def _break_if_stale(self) -> None:
        """Remove the O_EXCL lock file once it has not changed for ``STALE_LOCK_S``."""
        try:
            st = os.stat(self._held)
        except FileNotFoundError:
            return
        seen = (st.st_ino, st.st_mtime_ns)
        now = time.monotonic()
        if seen != self._seen:  # measured on this host's clock: no cross-host clock compare
            self._seen, self._seen_since = seen, now
            return
        if now - self._seen_since < STALE_LOCK_S:
            return
        aside = self._held.with_name(f"{self._held.name}.stale.{uuid.uuid4().hex}")
        try:
            os.rename(self._held, aside)  # only one waiter wins the rename
            os.unlink(aside)
            log.warning("broke the stale lock %s", self._held)
        except OSError:
            pass
        self._seen = None


@dataclass(frozen=True)
class Usage:
    """What the ledger says."""

    anchored: bool  # set by a pass's scan (False: nobody has measured this root yet)
    total_bytes: int  # block-file bytes in the store, by the ledger
    since_scan_bytes: int  # bytes written since the last pass


class Ledger:
    """The running total of block-file bytes, in a small file every writer updates."""

    def __init__(self, path: Path, lock: LockFile) -> None:
        self.path = path
        self.lock = lock

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
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                usage = _parse(os.pread(fd, _LEDGER.size, 0))
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
    """Keeps the block files under ``root`` within ``capacity_bytes``, for every writer."""

    def __init__(self, root: Path, capacity_bytes: int, *, lock: str = "flock") -> None:
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self.root = root
        self.capacity_bytes = capacity_bytes
        self.rescan_bytes = max(1, int(capacity_bytes * RESCAN_FRACTION))
        self.ledger = Ledger(root / LEDGER_NAME, LockFile(root / (LEDGER_NAME + ".lock"), lock))
        self.evict_lock = LockFile(root / EVICT_LOCK_NAME, lock)
        self._parents: dict[bytes, bytes | None] = {}  # block hash -> parent, from headers
        self.passes = 0
        self.last_pass_s = 0.0
        self.last_scan_blocks = 0

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
            index.add(block_hash, block.parent, block.nbytes)
        measured = index.total_bytes
        freed = evicted = 0
        for block_hash in index.victims():
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
    fd = os.open(path, os.O_RDONLY)
    try:
        raw = os.pread(fd, HEADER_BYTES, 0)
    finally:
        os.close(fd)
    return unpack_header(raw).parent
