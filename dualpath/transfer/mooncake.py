"""Mooncake Transfer Engine backend: TCP here, RDMA where the hardware has it.

Peers find each other by P2P handshake (no etcd, no metadata server): a backend's endpoint is
``host:rpc_port`` and is all a peer needs. The ``mooncake`` package (PyPI
``mooncake-transfer-engine-non-cuda`` on CPU machines, ``mooncake-transfer-engine`` with CUDA)
is imported when a backend is built, never when this module is imported. Mooncake logs through
glog on stderr.

Mooncake's TCP transport checks remote addresses against the peer's registered buffers but does
not check local ones, so this backend checks local ranges itself before submitting.

Mooncake's synchronous batch calls busy-poll until the transfer ends: measured here, a read
from a peer that answered after 1 s burned 0.83 s of CPU, and on a 2-core testbed that spinning
starves the engines whose work the transfer waits for. So each segment is submitted as its own
asynchronous batch and polled with ``transfer_check_status`` (non-blocking; it checks a batch's
first task, hence one segment per batch): ``start_write``/``start_read`` return the batches as a
``PendingTransfer`` for the caller to poll beside others (several transfers in flight from one
thread), and ``write``/``read`` poll theirs, spinning only briefly and then sleeping with backoff.

Mooncake listens on every interface whatever address it is given (its handshake port and its
TCP data port: ``transfer/firewall.py``), so a backend learns the ports its engine opened
(this process's listeners before and after) and guards them (``transfer/guard.py``): fenced to
loopback and the hosts ``allow_hosts`` names where this process can install firewall rules,
else refused on a non-loopback address unless ``open_listeners`` (``transfer_open_listeners``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

from dualpath.errors import TransferError
from dualpath.transfer.base import PendingTransfer, RegionSet, Segment, TransferBackend
from dualpath.transfer.guard import ListenerGuard, guard_listeners
from dualpath.transfer.listeners import listeners

SPIN_CHECKS = 20  # status checks before the first sleep (a small transfer ends within these)
POLL_MIN_S = 50e-6
POLL_MAX_S = 1e-3
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
    """One Mooncake Transfer Engine, advertised at ``hostname`` on a port it picks, its
    listeners guarded (module docstring)."""

    def __init__(self, hostname: str = "127.0.0.1", protocol: str = "tcp",
                 device_name: str = "", open_listeners: bool = False) -> None:
        """``open_listeners``: leave the listeners unfenced (the operator firewalls them);
        without it a backend on a non-loopback address that cannot be fenced is a
        ``ListenerError``."""
        engine_class = _engine_class()
        before = set(listeners())
        engine = engine_class()
        rc = engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise TransferError(f"Mooncake initialize({hostname!r}, {protocol!r}) returned {rc}")
        self._engine: Any = engine
        self._regions = RegionSet()
        self._lock = threading.Lock()
        self.endpoint = f"{hostname}:{engine.get_rpc_port()}"
        opened = [item for item in listeners() if item not in before]
        try:
            self.guard: ListenerGuard = guard_listeners(opened, hostname, open_listeners)
        except BaseException:
            self._engine = None
            del engine
            raise

    def allow_hosts(self, hosts: Iterable[str]) -> None:
        """Admit ``hosts`` (the cluster's other engines' hosts) to this engine's listeners,
        besides loopback, instead of the previous set (no-op when they are not fenced)."""
        self.guard.allow(hosts)

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
        """All segments local → peer, submitted together; returns when all have landed."""
        wait_landed(self.start_write(peer, segments))

    def read(self, peer: str, segments: Sequence[Segment]) -> None:
        """All segments peer → local, submitted together; returns when all have landed."""
        wait_landed(self.start_read(peer, segments))

    def start_write(self, peer: str, segments: Sequence[Segment]) -> PendingTransfer:
        """Submit all segments local → peer; returns at once with the transfer to poll."""
        return self._start("write", peer, segments)

    def start_read(self, peer: str, segments: Sequence[Segment]) -> PendingTransfer:
        """Submit all segments peer → local; returns at once with the transfer to poll."""
        return self._start("read", peer, segments)

    def close(self) -> None:
        """Unregister every region, drop the engine (its threads and listeners stop with it)
        and remove its listeners' fence."""
        with self._lock:
            engine, self._engine = self._engine, None
            if engine is None:
                return
            regions = self._regions.regions()
            self._regions.clear()
        if regions:
            engine.batch_unregister_memory([address for address, _ in regions])
        del engine  # its listeners close ...
        self.guard.close()  # ... then their fence goes

    def _start(self, kind: str, peer: str, segments: Sequence[Segment]) -> PendingTransfer:
        """Check local ranges, then submit every segment as its own asynchronous batch."""
        with self._lock:
            engine = self._live()
            for local_addr, _, nbytes in segments:
                self._regions.check(local_addr, nbytes, "local")
        submit = (engine.batch_transfer_async_write if kind == "write"
                  else engine.batch_transfer_async_read)
        total = sum(s[2] for s in segments)
        what = f"Mooncake {kind} of {len(segments)} segments ({total} bytes) with {peer}"
        batches: list[int] = []
        for local, remote, nbytes in segments:
            batch = submit(peer, [local], [remote], [nbytes])
            if not batch:
                with contextlib.suppress(TransferError):  # nothing may still write into the
                    wait_landed(MooncakeTransfer(engine, batches, what))  # caller's buffer
                raise TransferError(f"Mooncake could not submit a {kind} of {nbytes} bytes "
                                    f"with {peer}")
            batches.append(batch)
        return MooncakeTransfer(engine, batches, what)

    def _live(self) -> Any:
        if self._engine is None:
            raise TransferError(f"Mooncake backend {self.endpoint} is closed")
        return self._engine


class MooncakeTransfer(PendingTransfer):
    """Submitted Mooncake batches (one segment each) that have not all settled yet."""

    def __init__(self, engine: Any, batches: list[int], what: str) -> None:
        self._engine = engine
        self._batches = batches
        self._failed = 0
        self._what = what

    def poll(self) -> bool:
        """Check each unsettled batch once; True when all landed, ``TransferError`` when all
        settled and any failed or timed out."""
        still = []
        for batch in self._batches:
            status = self._engine.transfer_check_status(batch)
            if status == 0:
                still.append(batch)
            elif status < 0:
                self._failed += 1
        self._batches = still
        if still:
            return False
        if self._failed:
            raise TransferError(f"{self._what}: {self._failed} failed or timed out")
        return True


def wait_landed(pending: PendingTransfer) -> None:
    """Poll ``pending`` until it has landed (a short spin, then sleeps backing off to
    ``POLL_MAX_S``); raises its ``TransferError``."""
    spins, sleep_s = 0, POLL_MIN_S
    while not pending.poll():
        spins += 1
        if spins > SPIN_CHECKS:
            time.sleep(sleep_s)
            sleep_s = min(2 * sleep_s, POLL_MAX_S)
