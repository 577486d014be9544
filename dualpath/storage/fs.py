"""The ``fs`` store: one file per full block in a directory tree.

Works on a local disk and on shared POSIX mounts (3FS FUSE, NFS, Lustre, CephFS): it relies
only on open/pread/write/rename/unlink. Paths are built from validated key parts and the hex
hash, sharded two levels deep; a writer fills a unique temp file and renames it into place, so a
reader sees a whole block or none. Reads verify header and checksum; anything wrong is a miss
(and the bad file is removed so the next save rewrites it). Reads run in parallel on a worker
pool, optionally with O_DIRECT into 4 KiB-aligned buffers.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dualpath.errors import InvalidKeyError
from dualpath.kv.hashing import BlockKey, check_id
from dualpath.kv.layout import KVLayout
from dualpath.storage.base import Parts, StorageBackend
from dualpath.storage.block_file import (
    HEADER_BYTES,
    BadBlockFile,
    check_header,
    checksum,
    pack_header,
    unpack_header,
)
from dualpath.storage.index import PrefixLRUIndex

SUFFIX = ".kvb"
ALIGN = 4096
O_DIRECT = getattr(os, "O_DIRECT", 0)


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class FsStore(StorageBackend):
    """Full blocks as files under ``root``."""

    def __init__(self, root: str | Path, layout: KVLayout, *, fsync: bool = False,
                 o_direct: bool = False, workers: int = 4,
                 capacity_bytes: int | None = None) -> None:
        super().__init__(layout.full_block_bytes)
        self.root = Path(root).absolute()
        self.root.mkdir(parents=True, exist_ok=True)
        self._root_str = str(self.root)
        self.layout = layout
        self.fsync = fsync
        self.o_direct = bool(o_direct and O_DIRECT)
        self._pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="fs-store")
        self._local = threading.local()
        self._lock = threading.Lock()
        self._index: PrefixLRUIndex | None = None
        self._paths: dict[bytes, Path] = {}  # block hash -> file, for eviction
        if capacity_bytes is not None:
            self._index = PrefixLRUIndex(capacity_bytes)
            self._scan()

    # -- paths -------------------------------------------------------------------------------
    def path_for(self, key: BlockKey) -> Path:
        """The file of ``key``; never outside ``root`` (``InvalidKeyError`` otherwise)."""
        return Path(self._path_str(key))

    def _path_str(self, key: BlockKey) -> str:
        if not isinstance(key, BlockKey):
            raise InvalidKeyError(f"expected a BlockKey, got {type(key).__name__}")
        # re-checked here: a frozen dataclass can still be mutated through object.__setattr__
        model_id = check_id(key.model_id, "model id")
        layout_id = check_id(key.layout_id, "layout id")
        if not isinstance(key.block_size, int) or not isinstance(key.block_hash, bytes):
            raise InvalidKeyError(f"key {key!r} has a malformed block size or hash")
        h = key.block_hash.hex()
        return (f"{self._root_str}/{model_id}/{layout_id}/bs{key.block_size}/{h[:2]}/"
                f"{h[2:4]}/{h}{SUFFIX}")

    # -- interface ---------------------------------------------------------------------------
    def exists_prefix(self, keys: Sequence[BlockKey]) -> int:
        count = 0
        for key in keys:
            if not self.path_for(key).is_file():
                break
            self._touch(key)
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
            written = [self._write_one(keys[0], views[0])]
        else:
            written = list(self._pool.map(self._write_one, keys, views))
        self._record(keys, written)  # in chain order, whatever order the writes finished in
        return written

    def delete(self, keys: Sequence[BlockKey]) -> int:
        removed = sum(self._unlink(self.path_for(k), k) for k in keys)
        self.stats.add(blocks_deleted=removed)
        return removed

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # -- reads -------------------------------------------------------------------------------
    def _read_one(self, key: BlockKey, parts: Parts) -> bool:
        path = self._path_str(key)
        try:
            self._read_verified(path, key, parts)
        except FileNotFoundError:
            self.stats.add(misses=1)
            self._forget(key)
            return False
        except (OSError, BadBlockFile):
            self.stats.add(misses=1, corrupt=1)
            self._unlink(path, key)
            return False
        self.stats.add(hits=1, bytes_read=self.block_bytes)
        self._touch(key)
        return True

    def _read_verified(self, path: str, key: BlockKey, parts: Parts) -> None:
        header_buf = self._header_buffer()
        direct = self.o_direct and all(p.nbytes % ALIGN == 0 and _address(p) % ALIGN == 0
                                       for p in parts)
        try:
            got = _preadv_file(path, [header_buf, *parts], O_DIRECT if direct else 0)
        except OSError as exc:
            if not direct or exc.errno != errno.EINVAL:
                raise
            self.o_direct = False  # this filesystem refuses O_DIRECT: read through the cache
            got = _preadv_file(path, [header_buf, *parts], 0)
        if got != HEADER_BYTES + self.block_bytes:
            raise BadBlockFile("short read")
        header = unpack_header(header_buf)
        check_header(header, key.name, self.layout)
        if checksum(parts[0] if len(parts) == 1 else parts) != header.checksum:
            raise BadBlockFile("checksum mismatch")

    def _header_buffer(self) -> mmap.mmap:
        buf = getattr(self._local, "header", None)
        if buf is None:
            buf = self._local.header = mmap.mmap(-1, HEADER_BYTES)  # page aligned
        return buf

    # -- writes ------------------------------------------------------------------------------
    def _write_one(self, key: BlockKey, parts: Parts) -> bool:
        path = self.path_for(key)
        if path.is_file():
            self.stats.add(writes_skipped=1)
            self._touch(key)
            return True
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            header = pack_header(key.name, key.parent, self.layout,
                                 parts[0] if len(parts) == 1 else parts)
            self._write_file(tmp, header, parts)
            os.replace(tmp, path)
            if self.fsync:
                _fsync_dir(path.parent)
        except OSError:
            tmp.unlink(missing_ok=True)
            self.stats.add(write_errors=1)
            return False
        self.stats.add(blocks_written=1, bytes_written=self.block_bytes)
        return True

    def _write_file(self, tmp: Path, header: bytes, parts: Parts) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for chunk in (memoryview(header), *parts):
                while chunk.nbytes:
                    chunk = chunk[os.write(fd, chunk):]
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    # -- capacity ----------------------------------------------------------------------------
    def _touch(self, key: BlockKey) -> None:
        if self._index is not None:
            with self._lock:
                self._index.touch(key.block_hash)

    def _forget(self, key: BlockKey) -> None:
        if self._index is not None:
            with self._lock:
                self._index.remove(key.block_hash)
                self._paths.pop(key.block_hash, None)

    def _record(self, keys: Sequence[BlockKey], written: list[bool]) -> None:
        """Account newly stored blocks and evict beyond the capacity."""
        if self._index is None:
            return
        with self._lock:
            for key, ok in zip(keys, written, strict=True):
                if ok:
                    self._index.add(key.block_hash, key.parent, self.block_bytes + HEADER_BYTES)
                    self._paths[key.block_hash] = self.path_for(key)
            victims = [self._paths.pop(h) for h in self._index.victims()]
        for path in victims:
            path.unlink(missing_ok=True)
        self.stats.add(blocks_evicted=len(victims))

    def _unlink(self, path: str | Path, key: BlockKey) -> bool:
        self._forget(key)
        try:
            os.unlink(path)
        except OSError:  # already gone, or not a file we can remove: nothing to count
            return False
        return True

    def _scan(self) -> None:
        """Rebuild the capacity index from the block files already under ``root``."""
        assert self._index is not None
        for path in sorted(self.root.rglob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime):
            try:
                with path.open("rb") as f:
                    header = unpack_header(f.read(HEADER_BYTES))
                block_hash = bytes.fromhex(path.stem)
            except (OSError, ValueError, BadBlockFile):
                continue
            self._index.add(block_hash, header.parent, header.payload_bytes + HEADER_BYTES)
            self._paths[block_hash] = path


def _preadv_file(path: str, buffers: list[Any], extra_flags: int) -> int:
    """Read a whole file from offset 0 into ``buffers``; returns the bytes read."""
    fd = os.open(path, os.O_RDONLY | extra_flags)
    try:
        return os.preadv(fd, buffers, 0)  # a truncated file reads short
    finally:
        os.close(fd)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
