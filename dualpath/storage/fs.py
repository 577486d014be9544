"""The ``fs`` store: one file per full block in a directory tree.

Works on a local disk and on shared POSIX mounts (3FS FUSE, NFS, Lustre, CephFS): it relies
only on open/pread/write/rename/unlink/utime (and, with a capacity, lock files). Paths are built
from validated key parts and the hex hash, sharded two levels deep; a writer fills a unique temp
file and renames it into place, so a reader sees a whole block or none. A temp file's name
carries its writer's host and pid; opening a store removes, in the background, those of this
host's writers that no longer exist, and any left older than ``STALE_TEMP_S`` (another host's).
Reads verify header and checksum; anything wrong is a miss (and the bad file is removed so the
next save rewrites it). A short read goes on where it stopped (``file_reads``): only a file
that is shorter than a block is damage. Reads run in parallel on a worker pool, optionally
with O_DIRECT into 4 KiB-aligned buffers.
Block files hold prompt token ids: they are created 0600 in folders of 0700, or 0640 and 0750
in a group-shared store (its root carries the setgid bit, ``chmod g+s``, or the store is opened
with ``group_shared=True``); whoever can read the files can read the prompts.
Every use of a block (a read hit, an ``exists_prefix`` hit, a skipped rewrite) sets its file's
mtime to now: the recency that capacity eviction goes by, shared by every process and host
that uses the root (``fs_capacity``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import re
import socket
import stat
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dualpath.errors import InvalidKeyError
from dualpath.kv.hashing import BlockKey, checked_key
from dualpath.kv.layout import KVLayout
from dualpath.kv.retention import SessionMark
from dualpath.storage.base import Parts, StorageBackend
from dualpath.storage.block_file import (
    HEADER_BYTES,
    BadBlockFile,
    BlockHeader,
    check_header,
    checksum,
    key_header,
    stored_key,
    unpack_header,
)
from dualpath.storage.file_reads import preadv_full, read_file_into
from dualpath.storage.fs_capacity import SUFFIX, SharedCapacity, pid_alive
from dualpath.storage.session_marks import SessionMarks

log = logging.getLogger("dualpath.storage")

ALIGN = 4096
O_DIRECT = getattr(os, "O_DIRECT", 0)
_WRITTEN, _SKIPPED, _FAILED = "written", "skipped", "failed"  # one block's save
FILE_OVERHEAD = HEADER_BYTES  # a block file is its header and the payload
# A writer's temp file: ``.<hash>.kvb.<host>.<pid>.<uuid>.tmp`` (older writers left out the host).
HOST = re.sub(r"[^A-Za-z0-9-]", "_", socket.gethostname())[:64] or "host"
_TEMP_NAME = re.compile(r"\.[0-9a-f]+" + re.escape(SUFFIX)
                        + r"\.(?:(?P<host>[A-Za-z0-9_-]+)\.)?(?P<pid>[0-9]+)\.[0-9a-f]{32}\.tmp")
# A temp file lives for one block write (milliseconds); one this old belongs to a writer that
# died, whichever host it ran on (its pid can be checked only on its own host).
STALE_TEMP_S = 3600.0
PRIVATE_MODES = (0o600, 0o700)  # a store's files and folders: its owner's only ...
GROUP_MODES = (0o640, 0o750)  # ... or readable by its group too (a group-shared store)


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class FsStore(StorageBackend):
    """Full blocks as files under ``root``.

    ``capacity_bytes`` caps the block files of the whole root, for every process (on every
    host) that writes it with a cap: see ``fs_capacity`` for how. ``lock`` is how those
    processes exclude each other: ``flock`` (falls back to ``excl`` where refused) or ``excl``
    (O_EXCL lock files, for mounts whose flock is host-local). ``group_shared``: files 0640 and
    folders 0750 rather than 0600 and 0700 (None: whether the root carries the setgid bit; a
    root this creates for ``True`` gets it, so later openers share it too). ``by_sessions``:
    eviction ranks blocks by the session marks (``mark_session``); False evicts by recency
    alone and only counts what each pass took by the marks.
    """

    def __init__(self, root: str | Path, layout: KVLayout, *, fsync: bool = False,
                 o_direct: bool = False, workers: int = 4,
                 capacity_bytes: int | None = None, lock: str = "flock",
                 group_shared: bool | None = None, by_sessions: bool = True) -> None:
        super().__init__(layout.full_block_bytes)
        self.root = Path(root).absolute()
        self.group_shared = _open_root(self.root, group_shared)
        self.file_mode, self.dir_mode = GROUP_MODES if self.group_shared else PRIVATE_MODES
        self._root_str = str(self.root)
        self.layout = layout
        self.fsync = fsync
        self.o_direct = bool(o_direct and O_DIRECT)
        self._pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="fs-store")
        self._local = threading.local()
        self._file_bytes = self.block_bytes + FILE_OVERHEAD
        self._can_touch = True  # False once the mount turns out read-only
        self.marks = SessionMarks(self.root, self.file_mode, self.dir_mode)
        self.capacity: SharedCapacity | None = None
        if capacity_bytes is not None:
            self.capacity = SharedCapacity(self.root, capacity_bytes, lock=lock,
                                           file_mode=self.file_mode, marks=self.marks,
                                           stats=self.stats, by_sessions=by_sessions)
        self._closing = threading.Event()
        self.swept = threading.Event()  # set once the temp-file sweep of the open has ended
        threading.Thread(target=self._sweep_at_open, name="fs-temp-sweep", daemon=True).start()

    # -- paths -------------------------------------------------------------------------------
    def path_for(self, key: BlockKey) -> Path:
        """The file of ``key``; never outside ``root`` (``InvalidKeyError`` otherwise)."""
        return Path(self._path_str(key))

    def _path_str(self, key: BlockKey) -> str:
        key = checked_key(key)
        h = key.hex
        return (f"{self._root_str}/{key.model_id}/{key.layout_id}/bs{key.block_size}/{h[:2]}/"
                f"{h[2:4]}/{h}{SUFFIX}")

    # -- interface ---------------------------------------------------------------------------
    def exists_prefix(self, keys: Sequence[BlockKey]) -> int:
        count = 0
        for key in keys:
            if not self._touch(self._path_str(key)):  # a lookup hit is a use
                break
            count += 1
        return count

    def get_into(self, keys: Sequence[BlockKey], buffers: Sequence[Any]) -> list[bool]:
        views = self._check_batch(keys, buffers)
        if len(keys) == 1:
            return [self._read_one(keys[0], views[0])]
        return list(self._pool.map(self._read_one, keys, views))

    def put_from(self, keys: Sequence[BlockKey], buffers: Sequence[Any]) -> list[bool]:
        views = self._check_batch(keys, buffers)
        if len(keys) == 1:
            outcomes = [self._write_one(keys[0], views[0])]
        else:
            outcomes = list(self._pool.map(self._write_one, keys, views))
        new_files = outcomes.count(_WRITTEN)
        if self.capacity is not None and new_files:
            # once per batch, after all of it landed: a pass never sees this batch half-written
            evicted = self.capacity.added(new_files * self._file_bytes)
            self.stats.add(blocks_evicted=evicted)
        return [outcome != _FAILED for outcome in outcomes]

    def delete(self, keys: Sequence[BlockKey]) -> int:
        removed = sum(self._unlink(self._path_str(k)) for k in keys)
        self.stats.add(blocks_deleted=removed)
        return removed

    def mark_session(self, session_key: str, mark: SessionMark) -> bool:
        """Kept where a capacity makes eviction possible; every process sharing the root ranks
        its blocks by it (``session_marks``)."""
        if self.capacity is None:
            return False
        self.marks.write(session_key, mark)
        return True

    def close(self) -> None:
        self._closing.set()  # a sweep still walking the tree stops at its next folder
        self._pool.shutdown(wait=True)

    def _sweep_at_open(self) -> None:
        try:
            removed = remove_dead_temp_files(self.root, self._closing)
            if removed:
                log.info("removed %d temp files of dead writers under %s", removed, self.root)
        finally:
            self.swept.set()

    def stored_keys(self) -> Iterator[BlockKey]:
        return keys_under(self.root)

    def read_block(self, key: BlockKey, buffer: Any = None) -> BlockKey | None:
        path = self._path_str(key)
        try:
            if buffer is None:
                header = self._read_header(path, key)
            else:
                header = self._read_verified(path, key, self._check_batch([key], [buffer])[0])
        except (OSError, BadBlockFile):
            return None
        return stored_key(key, header)

    # -- reads -------------------------------------------------------------------------------
    def _read_one(self, key: BlockKey, parts: Parts) -> bool:
        path = self._path_str(key)
        try:
            self._read_verified(path, key, parts)
        except FileNotFoundError:
            self.stats.add(misses=1)
            return False
        except BadBlockFile:  # damaged: remove it, so the next save rewrites it
            self.stats.add(misses=1, corrupt=1)
            self._unlink(path)
            return False
        except OSError:  # the system's error, not the file's: a miss that leaves it alone
            self.stats.add(misses=1, read_errors=1)
            return False
        self.stats.add(hits=1, bytes_read=self.block_bytes)
        self._touch(path)  # a read is a use
        return True

    def _read_header(self, path: str, key: BlockKey) -> BlockHeader:
        """The checked header of the block file at ``path`` (its payload unread)."""
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            raw = bytearray(HEADER_BYTES)
            header = unpack_header(raw[: preadv_full(fd, [raw])])
        finally:
            os.close(fd)
        check_header(header, key.name, self.layout)
        if size != self._file_bytes:
            raise BadBlockFile(f"a file of {size} bytes, a block's is {self._file_bytes}")
        return header

    def _read_verified(self, path: str, key: BlockKey, parts: Parts) -> BlockHeader:
        header_buf = self._header_buffer()
        direct = self.o_direct and all(p.nbytes % ALIGN == 0 and _address(p) % ALIGN == 0
                                       for p in parts)
        try:
            got = read_file_into(path, [header_buf, *parts], O_DIRECT if direct else 0)
        except OSError as exc:
            if not direct or exc.errno != errno.EINVAL:
                raise
            self.o_direct = False  # this filesystem refuses O_DIRECT: read through the cache
            got = read_file_into(path, [header_buf, *parts], 0)
        if got != HEADER_BYTES + self.block_bytes:
            raise BadBlockFile("truncated")  # the file ends early (short reads went on)
        header = unpack_header(header_buf)
        check_header(header, key.name, self.layout)
        if checksum(parts[0] if len(parts) == 1 else parts) != header.checksum:
            raise BadBlockFile("checksum mismatch")
        return header

    def _header_buffer(self) -> mmap.mmap:
        buf = getattr(self._local, "header", None)
        if buf is None:
            buf = self._local.header = mmap.mmap(-1, HEADER_BYTES)  # page aligned
        return buf

    # -- writes ------------------------------------------------------------------------------
    def _write_one(self, key: BlockKey, parts: Parts) -> str:
        """Store one block; returns ``_WRITTEN``, ``_SKIPPED`` (already there) or ``_FAILED``."""
        path = self.path_for(key)
        if self._touch(str(path)):  # already stored: a save of it is a use
            self.stats.add(writes_skipped=1)
            return _SKIPPED
        tmp = path.with_name(f".{path.name}.{HOST}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
        try:
            self._make_dirs(path.parent)
            header = key_header(key, self.layout, parts[0] if len(parts) == 1 else parts)
            self._write_file(tmp, header, parts)
            os.replace(tmp, path)
            if self.fsync:
                _fsync_dir(path.parent)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            self.stats.add(write_errors=1)
            return _FAILED
        self.stats.add(blocks_written=1, bytes_written=self.block_bytes)
        return _WRITTEN

    def _make_dirs(self, folder: Path) -> None:
        """Create ``folder`` and the missing folders above it (inside the root) in the store's
        folder mode."""
        if folder.is_dir():
            return
        if folder != self.root and folder.parent != folder:
            self._make_dirs(folder.parent)
        try:
            os.mkdir(folder, self.dir_mode)
        except FileExistsError:
            return  # another writer made it meanwhile
        if self.group_shared:  # past a umask that would strip the group's bits
            with contextlib.suppress(OSError):
                os.chmod(folder, self.dir_mode)

    def _write_file(self, tmp: Path, header: bytes, parts: Parts) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, self.file_mode)
        try:
            if self.group_shared:
                with contextlib.suppress(OSError):
                    os.fchmod(fd, self.file_mode)
            for chunk in (memoryview(header), *parts):
                while chunk.nbytes:
                    chunk = chunk[os.write(fd, chunk):]
            now = time.time_ns()
            os.utime(fd, ns=(now, now))  # recency in the same fine clock as a use (_touch)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    # -- recency and removal ------------------------------------------------------------------
    def _touch(self, path: str) -> bool:
        """Mark the block at ``path`` as just used; returns whether it exists.

        One metadata call either way: ``utime`` doubles as the existence check. The stamp is
        this host's wall clock in ns, like a write's (``_write_file``): file systems stamp
        in coarse ticks (4 ms on this machine's ext4), which would tie most uses. Where the
        mtime cannot be set (a read-only mount) the block still exists; it just does not get
        younger.
        """
        if self._can_touch:
            now = time.time_ns()
            try:
                os.utime(path, ns=(now, now))
                return True
            except FileNotFoundError:
                return False
            except PermissionError:  # another user's file: "now" needs only write access
                with contextlib.suppress(OSError):
                    os.utime(path)
                    return True
            except OSError as exc:
                if exc.errno == errno.EROFS:
                    self._can_touch = False
        return os.path.isfile(path)

    def _unlink(self, path: str) -> bool:
        """Remove a block file (deleted or corrupt); returns whether one was removed."""
        try:
            nbytes = os.stat(path).st_size
            os.unlink(path)
        except OSError:  # already gone, or not a file we can remove: nothing to count
            return False
        if self.capacity is not None:
            self.capacity.removed(nbytes)
        return True


def _open_root(root: Path, group_shared: bool | None) -> bool:
    """Make the store's ``root`` if it is missing (0700, or 2750 when ``group_shared``) and
    say whether the store is group-shared (None: the root's setgid bit says). A root of ours
    found empty (a launcher's ``mkdir``) gets the store's folder mode; one that other users may
    still read is reported: its block files hold prompts."""
    if not root.is_dir():
        root.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(root, GROUP_MODES[1] if group_shared else PRIVATE_MODES[1])
            if group_shared:
                with contextlib.suppress(OSError):  # a mount that refuses it: mode 0750 only
                    os.chmod(root, GROUP_MODES[1] | stat.S_ISGID)
    st = os.stat(root)
    shared = bool(st.st_mode & stat.S_ISGID) if group_shared is None else group_shared
    folder_mode = GROUP_MODES[1] if shared else PRIVATE_MODES[1]
    if stat.S_IMODE(st.st_mode) & 0o777 & ~folder_mode and st.st_uid == os.getuid() \
            and not any(os.scandir(root)):
        with contextlib.suppress(OSError):
            os.chmod(root, folder_mode | (st.st_mode & stat.S_ISGID))
            st = os.stat(root)
    if st.st_mode & (stat.S_IROTH | stat.S_IXOTH):
        log.warning("the store root %s is open to other users (mode %o): its block files hold "
                    "prompt token ids (chmod o-rwx %s)", root, stat.S_IMODE(st.st_mode), root)
    return shared


def keys_under(root: str | Path) -> Iterator[BlockKey]:
    """The key of every block file under ``root``, of any model and layout (found by its path,
    ``root/model/layout/bs<N>/xx/yy/<hash>.kvb``; parent and token ids unset)."""
    for model in _subdirs(Path(root)):
        for layout in _subdirs(model):
            for size in _subdirs(layout):
                for shard in _subdirs(size):
                    for sub in _subdirs(shard):
                        yield from _keys_in(sub, model.name, layout.name, size.name)


def _subdirs(folder: Path) -> list[Path]:
    """The folders in ``folder`` (none if it is gone), skipping hidden ones."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    return sorted(Path(e.path) for e in entries
                  if not e.name.startswith(".") and e.is_dir(follow_symlinks=False))


def _keys_in(folder: Path, model_id: str, layout_id: str, size: str) -> Iterator[BlockKey]:
    """The keys of the block files in one shard folder (names that are not keys: skipped)."""
    try:
        names = sorted(e.name for e in os.scandir(folder) if e.name.endswith(SUFFIX))
    except OSError:
        return
    for name in names:
        try:
            yield BlockKey(model_id, layout_id, int(size.removeprefix("bs")),
                           bytes.fromhex(name[: -len(SUFFIX)]))
        except (ValueError, InvalidKeyError):
            continue  # a temp file (hidden, ".tmp"), or not one of ours


def remove_dead_temp_files(root: str | Path, stop: threading.Event | None = None,
                           now_s: float | None = None) -> int:
    """Remove the writers' temp files under ``root`` that no writer will finish: this host's
    whose pid no longer exists, and any older than ``STALE_TEMP_S``. Returns how many.

    A live writer's file is never removed (a pid that exists, even another user's, counts as
    live). Only names a writer of this module makes are considered; ``stop`` ends the walk
    early.
    """
    now_s = time.time() if now_s is None else now_s
    removed = 0
    for folder, dirs, files in os.walk(root):
        if stop is not None and stop.is_set():
            break
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            match = _TEMP_NAME.fullmatch(name) if name.endswith(".tmp") else None
            if match is None:
                continue
            path = os.path.join(folder, name)
            dead = match["host"] == HOST and not pid_alive(int(match["pid"]))
            try:
                if dead or now_s - os.stat(path).st_mtime > STALE_TEMP_S:
                    os.unlink(path)
                    removed += 1
            except OSError:  # renamed into place or removed meanwhile, or not ours to remove
                continue
    return removed


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
