"""In-process transfer backend for unit tests: ``ctypes.memmove`` between registered regions.

Every ``LocalBackend`` joins a class-level registry under a fresh endpoint name
(``local-1``, ``local-2``, ...), so several backends in one process can reach each other as if
they were engines on different hosts. Every segment is checked against the regions registered
on its side before any byte moves, so a wrong address is a ``TransferError``, not a crash.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Sequence
from typing import ClassVar

from dualpath.errors import TransferError
from dualpath.transfer.base import RegionSet, Segment, TransferBackend


class LocalBackend(TransferBackend):
    """A backend whose peers are other ``LocalBackend`` objects of this process."""

    _registry: ClassVar[dict[str, LocalBackend]] = {}
    _ids: ClassVar[itertools.count[int]] = itertools.count(1)
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self) -> None:
        self._regions = RegionSet()
        self._lock = threading.Lock()
        with LocalBackend._registry_lock:
            self.endpoint = f"local-{next(LocalBackend._ids)}"
            LocalBackend._registry[self.endpoint] = self

    def register(self, address: int, nbytes: int) -> None:
        """Make ``[address, address + nbytes)`` reachable by peers (identical repeats: no-op)."""
        with self._lock:
            self._regions.add(address, nbytes)

    def write(self, peer: str, segments: Sequence[Segment]) -> None:
        """Copy every segment from this process's region to the peer's region."""
        self._check(peer, segments)
        for local_addr, remote_addr, nbytes in segments:
            ctypes.memmove(remote_addr, local_addr, nbytes)

    def read(self, peer: str, segments: Sequence[Segment]) -> None:
        """Copy every segment from the peer's region into this process's region."""
        self._check(peer, segments)
        for local_addr, remote_addr, nbytes in segments:
            ctypes.memmove(local_addr, remote_addr, nbytes)

    def close(self) -> None:
        """Leave the registry and forget the regions; peers can no longer reach this backend."""
        with LocalBackend._registry_lock:
            if LocalBackend._registry.get(self.endpoint) is self:
                del LocalBackend._registry[self.endpoint]
        with self._lock:
            self._regions.clear()

    def _check(self, peer: str, segments: Sequence[Segment]) -> None:
        """Raise ``TransferError`` unless the peer exists and every range is registered."""
        with LocalBackend._registry_lock:
            remote = LocalBackend._registry.get(peer)
        if remote is None:
            raise TransferError(f"no local backend named {peer!r}")
        with self._lock:
            for local_addr, _, nbytes in segments:
                self._regions.check(local_addr, nbytes, "local")
        with remote._lock:
            for _, remote_addr, nbytes in segments:
                remote._regions.check(remote_addr, nbytes, f"remote ({peer})")
