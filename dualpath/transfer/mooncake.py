"""Mooncake Transfer Engine backend: TCP here, RDMA where the hardware has it.

Peers find each other by P2P handshake (no etcd, no metadata server): a backend's endpoint is
``host:rpc_port`` and is all a peer needs. The ``mooncake`` package (PyPI
``mooncake-transfer-engine-non-cuda`` on CPU machines, ``mooncake-transfer-engine`` with CUDA)
is imported when a backend is built, never when this module is imported. Mooncake logs through
glog on stderr.

Mooncake's TCP transport checks remote addresses against the peer's registered buffers but does
not check local ones, so this backend checks local ranges itself before submitting.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from dualpath.errors import TransferError
from dualpath.transfer.base import RegionSet, Segment, TransferBackend

_INSTALL_HINT = ("install `mooncake-transfer-engine-non-cuda` (CPU) or "
                 "`mooncake-transfer-engine` (CUDA), plus Debian's `libibverbs1`")


def _engine_class() -> Any:
    """``mooncake.engine.TransferEngine``, or a ``TransferError`` saying what to install."""
    try:
        from mooncake.engine import TransferEngine
    except (ImportError, OSError) as exc:  # OSError: libibverbs.so.1 missing
        raise TransferError(f"Mooncake Transfer Engine is unavailable ({exc}); "
                            f"{_INSTALL_HINT}") from exc
    return TransferEngine


class MooncakeBackend(TransferBackend):
    """One Mooncake Transfer Engine, listening on ``hostname`` and a port it picks."""

    def __init__(self, hostname: str = "127.0.0.1", protocol: str = "tcp",
                 device_name: str = "") -> None:
        engine = _engine_class()()
        rc = engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise TransferError(f"Mooncake initialize({hostname!r}, {protocol!r}) returned {rc}")
        self._engine: Any = engine
        self._regions = RegionSet()
        self._lock = threading.Lock()
        self.endpoint = f"{hostname}:{engine.get_rpc_port()}"

    def register(self, address: int, nbytes: int) -> None:
        """Register ``[address, address + nbytes)`` with Mooncake (identical repeats: no-op)."""
        with self._lock:
            if not self._regions.add(address, nbytes):
                return
            rc = self._live().register_memory(address, nbytes)
            if rc != 0:
                self._regions.remove(address)
                raise TransferError(f"Mooncake register_memory({address:#x}, {nbytes}) "
                                    f"returned {rc}")

    def write(self, peer: str, segments: Sequence[Segment]) -> None:
        """All segments local → peer in one ``batch_transfer_sync_write``."""
        self._batch("write", peer, segments)

    def read(self, peer: str, segments: Sequence[Segment]) -> None:
        """All segments peer → local in one ``batch_transfer_sync_read``."""
        self._batch("read", peer, segments)

    def close(self) -> None:
        """Unregister every region and drop the engine (its threads stop with it)."""
        with self._lock:
            engine, self._engine = self._engine, None
            if engine is None:
                return
            regions = self._regions.regions()
            self._regions.clear()
        if regions:
            engine.batch_unregister_memory([address for address, _ in regions])
        del engine

    def _batch(self, kind: str, peer: str, segments: Sequence[Segment]) -> None:
        """Check local ranges, then submit every segment in one synchronous batch."""
        if not segments:
            return
        with self._lock:
            engine = self._live()
            for local_addr, _, nbytes in segments:
                self._regions.check(local_addr, nbytes, "local")
        local = [s[0] for s in segments]
        remote = [s[1] for s in segments]
        lengths = [s[2] for s in segments]
        submit = (engine.batch_transfer_sync_write if kind == "write"
                  else engine.batch_transfer_sync_read)
        rc = submit(peer, local, remote, lengths)
        if rc != 0:
            raise TransferError(f"Mooncake batch {kind} of {len(segments)} segments "
                                f"({sum(lengths)} bytes) with {peer} returned {rc}")

    def _live(self) -> Any:
        if self._engine is None:
            raise TransferError(f"Mooncake backend {self.endpoint} is closed")
        return self._engine
