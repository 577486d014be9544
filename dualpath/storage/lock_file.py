"""An exclusive lock shared by every process and host that opens the same lock file.

It is ``flock`` on the lock file; where ``flock`` is refused (ENOLCK, EOPNOTSUPP, ...) it falls
back to an ``O_EXCL`` lock file (``<path>.held``) with a lease that a waiter breaks after
``STALE_LOCK_S`` without change. :mod:`dualpath.storage.fs_capacity` takes it around its ledger
updates and its eviction passes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path

log = logging.getLogger("dualpath.storage")

STALE_LOCK_S = 30.0  # an O_EXCL lock file unchanged this long belongs to a dead holder
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF}


class LockFile:
    """An exclusive lock shared by every process and host that opens the same ``path``; its
    files are created with ``file_mode``."""

    def __init__(self, path: Path, mode: str = "flock", file_mode: int = 0o600) -> None:
        if mode not in ("flock", "excl"):
            raise ValueError(f"lock mode {mode!r} (flock, excl)")
        self.path = path
        self.mode = mode
        self.file_mode = file_mode
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
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, self.file_mode)
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
            fd = os.open(self._held, os.O_WRONLY | os.O_CREAT | os.O_EXCL, self.file_mode)
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
