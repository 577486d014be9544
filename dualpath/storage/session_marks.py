"""Session marks of an ``fs`` store, shared by every process and host that uses its root.

One small file per session, ``<root>/.sessions/<name>.mark`` (``retention.SessionMark`` as
JSON), where the name is a hash of the session's key: a client's session id never becomes a
path. A writer fills a unique temp file and renames it over the old mark, so a reader sees one
whole mark or the previous one. An eviction pass (``fs_capacity``) loads them all, dropping
marks that are damaged or stale (their session stopped being live a day ago), and keeps at
most ``MAX_MARKS`` (the most recently seen): a client that invents session ids by the million
costs the pass a bounded read, and only the oldest marks lose their claim.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import uuid
from dataclasses import replace
from pathlib import Path

from dualpath.kv.retention import BadMark, SessionMark

log = logging.getLogger("dualpath.storage")

FOLDER = ".sessions"  # a dot folder: block scans and key listings skip it
MARK_SUFFIX = ".mark"
MAX_MARK_BYTES = 4096
MAX_MARKS = 100_000


def mark_name(session_key: str) -> str:
    """The file name of a session's mark: a hash, so any key is a safe name."""
    return hashlib.sha256(session_key.encode()).hexdigest()[:40] + MARK_SUFFIX


class SessionMarks:
    """The marks under ``root``; files and the folder get the store's modes."""

    def __init__(self, root: Path, file_mode: int = 0o600, dir_mode: int = 0o700) -> None:
        self.folder = root / FOLDER
        self.file_mode = file_mode
        self.dir_mode = dir_mode
        self.dropped = 0  # marks removed by loads: damaged, stale or over MAX_MARKS

    def write(self, session_key: str, mark: SessionMark) -> None:
        """Replace ``session_key``'s mark (``OSError`` if the folder cannot be written)."""
        self._make_folder()
        self._replace(self.folder / mark_name(session_key), mark)

    def _replace(self, path: Path, mark: SessionMark) -> None:
        tmp = self.folder / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, self.file_mode)
        try:
            with contextlib.suppress(OSError):
                os.fchmod(fd, self.file_mode)  # past a umask that strips a group's bits
            os.write(fd, mark.to_json())
        finally:
            os.close(fd)
        try:
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def load(self, now_ns: int) -> dict[str, SessionMark]:
        """Every usable mark by its file name; damaged, stale and surplus ones (and dead temp
        files) are removed."""
        found: list[tuple[SessionMark, str]] = []
        try:
            entries = list(os.scandir(self.folder))
        except (FileNotFoundError, NotADirectoryError):
            return {}
        for entry in entries:
            mark = self._read(entry, now_ns)
            if mark is not None:
                found.append((mark, entry.path))
        found.sort(key=lambda item: item[0].seen_ns, reverse=True)
        for _, path in found[MAX_MARKS:]:
            self._remove(path)
        return {os.path.basename(path): mark for mark, path in found[:MAX_MARKS]}

    def retarget(self, name: str, mark: SessionMark, tip: bytes | None) -> None:
        """Move the mark ``name`` to ``tip`` (an eviction took its old one), or drop it when
        nothing of its chain is left; a mark its session replaced since ``load`` is left as it
        is. (A turn that ends between this check and the rename loses its mark to the moved
        one: its new blocks count as nobody's until the session's next turn.)"""
        path = self.folder / name
        try:
            with open(path, "rb") as f:
                if SessionMark.from_json(f.read(MAX_MARK_BYTES + 1)) != mark:
                    return
        except (OSError, BadMark):
            return
        if tip is None:
            self._remove(str(path))
            return
        self._replace(path, replace(mark, tip=tip, anchors=()))

    def _read(self, entry: os.DirEntry[str], now_ns: int) -> SessionMark | None:
        if entry.name.startswith("."):
            self._remove_dead_temp(entry, now_ns)
            return None
        if not entry.name.endswith(MARK_SUFFIX):
            return None
        try:
            with open(entry.path, "rb") as f:
                mark = SessionMark.from_json(f.read(MAX_MARK_BYTES + 1))
        except FileNotFoundError:
            return None  # replaced or removed meanwhile
        except (OSError, BadMark) as exc:
            log.warning("dropping the session mark %s: %s", entry.path, exc)
            self._remove(entry.path)
            return None
        if mark.stale(now_ns):
            self._remove(entry.path)
            return None
        return mark

    def _remove_dead_temp(self, entry: os.DirEntry[str], now_ns: int) -> None:
        """A temp file lives for one write: one an hour old belongs to a writer that died."""
        with contextlib.suppress(OSError):
            if entry.name.endswith(".tmp") and now_ns - entry.stat().st_mtime_ns > 3600e9:
                os.unlink(entry.path)

    def _remove(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self.dropped += 1

    def _make_folder(self) -> None:
        if self.folder.is_dir():
            return
        with contextlib.suppress(FileExistsError):
            os.mkdir(self.folder, self.dir_mode)
            with contextlib.suppress(OSError):
                os.chmod(self.folder, self.dir_mode)
