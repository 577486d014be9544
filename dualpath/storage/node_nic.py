"""One storage-NIC account per node, shared by every engine process of that node.

Engines of one host share its storage NIC (docs/design.md §2), whichever process they run in, so an
emulated NIC cap must pace them together: the token bucket's state lives in a small file in
``/dev/shm`` that each engine of the node maps, and every reservation takes an exclusive
``flock`` on it. The file is named by the router's run (``cluster_id``) and the node id, so
two clusters on one host, or two runs one after the other, never share an account.
``time.monotonic`` is one clock for every process of a host, which the shared state relies on.

Each process that opens an account's file also makes an empty holder file beside it, named
with its pid (``<file>.<pid>.<token>.pid``), and removes it when it closes. A killed cluster
leaves both behind; ``remove_dead_accounts`` (run as a local cluster starts) removes the
holders of processes that no longer exist and every account file no live process holds.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import re
import struct
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dualpath.storage.fs_capacity import pid_alive
from dualpath.traffic.token_bucket import TokenBucket

_STATE = struct.Struct("<dd?")  # tokens, last reservation time, whether last is set
_SHM = Path("/dev/shm")
PREFIX = "dualpath-nic-"
_ACCOUNT_FILE = re.compile(re.escape(PREFIX) + r"[0-9A-Za-z_-]{1,64}-node[0-9]+-(read|write)")
_HOLDER_FILE = re.compile(r"(?P<account>.+)\.(?P<pid>[0-9]+)\.[0-9a-f]{8}\.pid")


@dataclass(frozen=True)
class NodeNicAccount:
    """Where the storage-NIC state of one node lives (a path prefix; one file per direction)."""

    prefix: Path

    def bucket(self, direction: str, rate_bytes_s: float, burst_bytes: float) -> SharedBucket:
        """The shared bucket of ``direction`` (``read`` or ``write``)."""
        return SharedBucket(Path(f"{self.prefix}-{direction}"), rate_bytes_s, burst_bytes)


def node_nic_account(cluster_id: str, node_id: int) -> NodeNicAccount:
    """The account of node ``node_id`` in the cluster run ``cluster_id``."""
    if not re.fullmatch(r"[0-9A-Za-z_-]{1,64}", cluster_id) or node_id < 0:
        raise ValueError(f"bad cluster id {cluster_id!r} or node id {node_id}")
    return NodeNicAccount(account_folder() / f"{PREFIX}{cluster_id}-node{node_id}")


def account_folder() -> Path:
    """Where this host's accounts live: ``/dev/shm``, else the temp folder."""
    return _SHM if _SHM.is_dir() else Path(tempfile.gettempdir())


def remove_dead_accounts(folder: Path | None = None) -> int:
    """Remove the account files (and holder files) in ``folder`` that no live process holds;
    returns how many files went. A file a live process holds is never removed; an account
    file without any holder (a killed cluster's, or one from before holders) is."""
    folder = account_folder() if folder is None else folder
    try:
        names = [n for n in os.listdir(folder) if n.startswith(PREFIX)]
    except OSError:
        return 0
    removed = 0
    for name in names:
        holder = _HOLDER_FILE.fullmatch(name)
        if holder is not None and not pid_alive(int(holder["pid"])):
            removed += _unlink(folder / name)
    for name in names:
        if _ACCOUNT_FILE.fullmatch(name) and not _live_holders(folder, name):
            removed += _unlink(folder / name)
    return removed


def _live_holders(folder: Path, account: str) -> bool:
    """Whether a live process holds ``account`` (its holders listed afresh)."""
    for holder in folder.glob(f"{account}.*.pid"):
        match = _HOLDER_FILE.fullmatch(holder.name)
        if match is not None and match["account"] == account and pid_alive(int(match["pid"])):
            return True
    return False


def _unlink(path: Path) -> int:
    try:
        path.unlink()
    except OSError:  # gone meanwhile, or not ours to remove
        return 0
    return 1


class SharedBucket:
    """A ``TokenBucket`` whose state every process that opens ``path`` shares."""

    def __init__(self, path: Path, rate_bytes_s: float, burst_bytes: float) -> None:
        self.path = path
        self._bucket = TokenBucket(rate_bytes_s, burst_bytes)
        self.rate_bytes_s = rate_bytes_s
        # the holder first: a sweep that sees the account then sees it held
        self._holder = path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.pid")
        os.close(os.open(self._holder, os.O_WRONLY | os.O_CREAT, 0o600))
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        with self._locked():
            if os.fstat(self._fd).st_size < _STATE.size:  # the node's first engine: a full bucket
                os.ftruncate(self._fd, _STATE.size)
                os.pwrite(self._fd, _STATE.pack(burst_bytes, 0.0, False), 0)
        self._map = mmap.mmap(self._fd, _STATE.size)

    def reserve(self, nbytes: int, now_s: float) -> float:
        """As ``TokenBucket.reserve``, counted against every process's reservations."""
        with self._locked():
            tokens, last_s, has_last = _STATE.unpack_from(self._map, 0)
            self._bucket.restore(tokens, last_s if has_last else None)
            wait_s = self._bucket.reserve(nbytes, now_s)
            tokens, last = self._bucket.state
            _STATE.pack_into(self._map, 0, tokens, last or 0.0, last is not None)
        return wait_s

    def close(self, unlink: bool = False) -> None:
        """Unmap; ``unlink`` removes the account (the node's engines are all stopping)."""
        self._map.close()
        os.close(self._fd)
        with contextlib.suppress(FileNotFoundError):
            self._holder.unlink()
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
