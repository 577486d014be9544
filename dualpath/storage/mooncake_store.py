"""The ``mooncake_store`` backend: one Mooncake Store object per full block.

Mooncake Store (``mooncake_master`` and ``mooncake.store`` from the same wheel as the transfer
engine) keeps objects in the memory *segments* that its clients contribute; a master process
knows which object lives in which segment and moves no bytes itself. Engines come and go, so a
deployment runs one or more *segment holders* apart from them
(``python -m dualpath.storage.mooncake_store serve``, see ``mooncake_service``), and engines
join with no segment of their own (``StorageConfig.mooncake_segment_mb = 0``).

An object is exactly what an ``fs`` block file holds (``block_file``): the 4 KiB header, then
the payload, under the key ``<prefix>/<model>/<layout>/bs<size>/<hash hex>``. A write sends the
header and the caller's buffer (or its scatter list) as the parts of one object; a read lands
the header in a scratch buffer and the payload straight in the caller's buffers (no staging
copy), and is verified like a file: a wrong size, header or checksum is a miss and the object
is removed so the next save rewrites it; a read that the master or a transfer failed is a miss
that leaves the object alone (``read_errors``). The header carries the block's token ids like a
file's, but Mooncake cannot list its objects: an audit of this store is given its keys.

Clients find each other by P2P handshake (no etcd, no HTTP metadata server: mooncake 0.3.13
supports ``P2PHANDSHAKE`` for the store too); TCP needs no registered buffers. Measured here
with that version: a call on a client whose master has died returns RPC_FAIL after about 4.3 s,
and ``setup`` against an absent master retries for 90 s.
So the master is probed with a plain TCP connect before ``setup`` (an unreachable master is a
``StorageError`` at once), and after an RPC failure every call first re-probes it (0.5 s at
most): while it is down, reads and lookups are misses and writes fail, without waiting.

``mooncake`` is imported when a store or segment holder is built, never when this module is.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from dualpath.errors import StorageError
from dualpath.kv.hashing import BlockKey, check_id, checked_key
from dualpath.kv.layout import KVLayout
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

OBJECT_NOT_FOUND = -704  # Mooncake's error code for an absent key
RPC_FAIL = -900  # ... and for a master that does not answer
MASTER_PROBE_S = 2.0  # how long the first connect to the master may take
REPROBE_S = 0.5  # ... and a re-probe after an RPC failure
INSTALL_HINT = "install `mooncake-transfer-engine-non-cuda` (CPU) or `mooncake-transfer-engine`"

log = logging.getLogger("dualpath.storage")


def _store_class() -> Any:
    """``mooncake.store.MooncakeDistributedStore``, or a ``StorageError`` saying what to install."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except (ImportError, OSError) as exc:  # OSError: libibverbs.so.1 missing
        raise StorageError(f"Mooncake Store is unavailable ({exc}); {INSTALL_HINT}") from exc
    return MooncakeDistributedStore


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise StorageError(f"Mooncake master address {address!r} is not host:port")
    return host.strip("[]"), int(port)


def master_reachable(address: str, timeout_s: float = MASTER_PROBE_S) -> bool:
    """Whether the master at ``host:port`` accepts a TCP connection within ``timeout_s``."""
    try:
        with socket.create_connection(_split_address(address), timeout=timeout_s):
            return True
    except OSError:
        return False


def _address_of(view: memoryview) -> int:
    """The address of a buffer's first byte (read-only buffers too)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class MooncakeStore(StorageBackend):
    """Full blocks as objects of a Mooncake Store.

    The bytes live in the memory segments that Mooncake clients contribute — the segment
    holders (``mooncake_service.serve``), plus this process's own ``segment_mb`` when it is
    not 0 — and the master at ``master`` maps each key to its segment. Blocks survive this
    store and its process; they go when their holder goes or when the master evicts them (at
    90% of the segments, its default), which makes them misses. ``local_host`` is the address
    this client registers with its peers (the engine's advertised host on a multi-host
    cluster). ``register_buffers`` (default: on for every protocol but TCP, which needs none)
    registers the caller's buffers with Mooncake for the duration of each call.
    """

    def __init__(self, layout: KVLayout, *, master: str = "127.0.0.1:50051",
                 metadata_server: str = "P2PHANDSHAKE", local_host: str = "127.0.0.1",
                 protocol: str = "tcp", device_name: str = "", segment_mb: int = 0,
                 local_buffer_mb: int = 0, key_prefix: str = "dualpath",
                 register_buffers: bool | None = None) -> None:
        super().__init__(layout.full_block_bytes)
        self.layout = layout
        self.master = master
        self.key_prefix = check_id(key_prefix, "Mooncake key prefix")
        self._register = protocol != "tcp" if register_buffers is None else register_buffers
        self._object_bytes = HEADER_BYTES + self.block_bytes
        self._lock = threading.Lock()
        self._master_down = False
        self._client: Any = connect(master, metadata_server=metadata_server,
                                    local_host=local_host, protocol=protocol,
                                    device_name=device_name, segment_mb=segment_mb,
                                    local_buffer_mb=local_buffer_mb)

    # -- keys --------------------------------------------------------------------------------
    def object_key(self, key: BlockKey) -> str:
        """The Mooncake key of ``key``'s block (``InvalidKeyError`` if the key is malformed)."""
        return f"{self.key_prefix}/{checked_key(key).name}"

    # -- interface ---------------------------------------------------------------------------
    def exists_prefix(self, keys: Sequence[BlockKey]) -> int:
        """How many leading ``keys`` the store holds (one lookup for the whole batch)."""
        names = [self.object_key(k) for k in keys]
        if not names or not self._usable():
            return 0
        found = self._call("batch_is_exist", names)
        count = 0
        for code in found:
            if code != 1:
                break
            count += 1
        return count

    def get_into(self, keys: Sequence[BlockKey], buffers: Sequence[Any]) -> list[bool]:
        """Read each block straight into its buffer(s) and verify it; a bad block is a miss."""
        views = self._check_batch(keys, buffers)
        names = [self.object_key(k) for k in keys]
        if not names:
            return []
        if not self._usable():  # the master is down: misses, and the blocks stay
            self.stats.add(misses=len(names), read_errors=len(names))
            return [False] * len(names)
        headers, codes = self._get(names, views)
        return [self._verify(name, key, header, parts, code) for name, key, header, parts, code
                in zip(names, keys, headers, views, codes, strict=True)]

    def put_from(self, keys: Sequence[BlockKey], buffers: Sequence[Any]) -> list[bool]:
        """Store each block not yet stored (header + payload as one object)."""
        views = self._check_batch(keys, buffers)
        names = [self.object_key(k) for k in keys]
        if not names:
            return []
        if not self._usable():
            self.stats.add(write_errors=len(names))
            return [False] * len(names)
        todo = self._absent(names)
        if self._master_down:  # the lookup failed: a write would wait as long again
            self.stats.add(write_errors=len(names))
            return [False] * len(names)
        stored = [True] * len(names)
        if todo:
            sources = [[memoryview(key_header(keys[i], self.layout, _payload(views[i]))),
                        *views[i]] for i in todo]
            with self._registered(sources):
                codes = self._call("batch_put_from_multi_buffers", [names[i] for i in todo],
                                   [[_address_of(p) for p in s] for s in sources],
                                   [[p.nbytes for p in s] for s in sources])
            for i, code in zip(todo, codes, strict=True):
                stored[i] = code == 0
            written = sum(code == 0 for code in codes)
            self.stats.add(blocks_written=written, bytes_written=written * self.block_bytes,
                           write_errors=len(todo) - written)
        self.stats.add(writes_skipped=len(names) - len(todo))
        return stored

    def delete(self, keys: Sequence[BlockKey]) -> int:
        """Remove the blocks (even ones read in the last lease period); returns how many existed."""
        names = list(dict.fromkeys(self.object_key(k) for k in keys))
        if not names or not self._usable():
            return 0
        removed = sum(code == 0 for code in self._call("batch_remove", names, True))
        self.stats.add(blocks_deleted=removed)
        return removed

    def close(self) -> None:
        """Leave the Mooncake cluster (idempotent); the stored blocks stay with their holders."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def read_block(self, key: BlockKey, buffer: Any = None) -> BlockKey | None:
        """The block as stored (see ``StorageBackend.read_block``). Mooncake cannot list its
        objects, so an audit of this store needs the keys it is to check."""
        parts = (self._check_batch([key], [buffer])[0] if buffer is not None
                 else [memoryview(bytearray(self.block_bytes))])
        name = self.object_key(key)
        if not self._usable():
            return None
        (header,), (code,) = self._get([name], [parts])
        try:
            found = self._checked(key, header, parts, code)
        except BadBlockFile:
            return None
        return stored_key(key, found)

    # -- helpers -----------------------------------------------------------------------------
    def _get(self, names: list[str], views: list[Parts]) -> tuple[list[memoryview], list[int]]:
        """Read each object: its header into a scratch buffer, its payload into its parts;
        the headers and Mooncake's result codes (the bytes read, or an error)."""
        headers = [memoryview(bytearray(HEADER_BYTES)) for _ in names]
        targets = [[header, *parts] for header, parts in zip(headers, views, strict=True)]
        with self._registered(targets):
            codes = self._call("batch_get_into_multi_buffers", names,
                               [[_address_of(p) for p in t] for t in targets],
                               [[p.nbytes for p in t] for t in targets])
        return headers, codes

    def _checked(self, key: BlockKey, header: memoryview, parts: Parts,
                 code: int) -> BlockHeader:
        """The header of a block read back whole and valid; ``BadBlockFile`` otherwise."""
        if code != self._object_bytes:
            raise BadBlockFile(f"read returned {code}")
        found = unpack_header(header)
        check_header(found, key.name, self.layout)
        if checksum(_payload(parts)) != found.checksum:
            raise BadBlockFile("checksum mismatch")
        return found

    def _absent(self, names: list[str]) -> list[int]:
        """Indices of the names not stored yet (a name repeated in the batch: its first)."""
        present = self._call("batch_is_exist", names)
        seen: set[str] = set()
        todo = []
        for i, (name, code) in enumerate(zip(names, present, strict=True)):
            if code != 1 and name not in seen:
                todo.append(i)
            seen.add(name)
        return todo

    def _verify(self, name: str, key: BlockKey, header: memoryview, parts: Parts,
                code: int) -> bool:
        """Whether one block read back whole and valid; counts it and removes a bad object."""
        try:
            self._checked(key, header, parts, code)
        except BadBlockFile:
            damaged = code >= 0 or self._damaged(name, code)
            failed = not damaged and code != OBJECT_NOT_FOUND  # the master or a transfer
            self.stats.add(misses=1, corrupt=int(damaged), read_errors=int(failed))
            if damaged:
                self._call("batch_remove", [name], True)
            return False
        self.stats.add(hits=1, bytes_read=self.block_bytes)
        return True

    def _damaged(self, name: str, code: int) -> bool:
        """Whether a failed read was of an object of the wrong size (rather than absent or
        unreachable): Mooncake fails such a read with a transfer error."""
        if code in (OBJECT_NOT_FOUND, RPC_FAIL):
            return False
        size = self._call("get_size", name)
        return size >= 0 and size != self._object_bytes

    def _call(self, method: str, *args: Any) -> Any:
        """Call the Mooncake client; an RPC failure marks the master down (``_usable``)."""
        client = self._client
        if client is None:
            raise StorageError(f"Mooncake store at {self.master} is closed")
        result = getattr(client, method)(*args)
        codes = result if isinstance(result, list) else [result]
        if RPC_FAIL in codes and not self._master_down:
            log.warning("Mooncake master %s does not answer (%s): reads are misses and writes "
                        "fail until it is back", self.master, method)
            self._master_down = True
        return result

    def _usable(self) -> bool:
        """False while the master is known down and still refuses connections."""
        if self._master_down and master_reachable(self.master, REPROBE_S):
            log.info("Mooncake master %s is back", self.master)
            self._master_down = False
        return not self._master_down

    @contextlib.contextmanager
    def _registered(self, groups: list[list[memoryview]]) -> Iterator[None]:
        """Register every buffer with Mooncake for the call (RDMA needs it; TCP does not)."""
        if not self._register:
            yield
            return
        addresses = [(_address_of(p), p.nbytes) for g in groups for p in g if p.nbytes]
        done = []
        try:
            for address, nbytes in addresses:
                if self._call("register_buffer", address, nbytes) != 0:
                    raise StorageError(f"Mooncake register_buffer({address:#x}, {nbytes}) failed")
                done.append(address)
            yield
        finally:
            for address in done:
                self._call("unregister_buffer", address)


def _payload(parts: Parts) -> memoryview | Parts:
    return parts[0] if len(parts) == 1 else parts


def connect(master: str, *, metadata_server: str = "P2PHANDSHAKE",
            local_host: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "",
            segment_mb: int = 0, local_buffer_mb: int = 0) -> Any:
    """A set-up ``MooncakeDistributedStore`` client of the master at ``master``.

    ``StorageError`` when the package is missing, the master does not accept connections
    within ``MASTER_PROBE_S`` (Mooncake's own setup would retry for 90 s), or setup fails.
    """
    store_class = _store_class()
    if not master_reachable(master):
        raise StorageError(f"Mooncake master {master} is unreachable (no TCP connection in "
                           f"{MASTER_PROBE_S:.0f} s); start one with `python -m "
                           "dualpath.storage.mooncake_store master --port PORT`")
    client = store_class()
    rc = client.setup(local_host, metadata_server, segment_mb << 20, local_buffer_mb << 20,
                      protocol, device_name, master)
    if rc != 0:
        raise StorageError(f"Mooncake Store setup as {local_host!r} with master {master}, "
                           f"metadata {metadata_server!r}, protocol {protocol!r} returned {rc}")
    return client


if __name__ == "__main__":  # `python -m dualpath.storage.mooncake_store serve|master ...`
    from dualpath.cli import main

    sys.exit(main(["mooncake", *sys.argv[1:]]))
