"""The on-disk format of one full block: a 4 KiB header, then the payload.

Header: magic ``DPKV``, format version, the key's name and parent hash, layer count, tokens,
bytes per token per layer, dtype, payload size and an xxh3-64 checksum of the payload. The
header is padded to 4 KiB so the payload starts aligned (O_DIRECT reads land in place).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from dualpath.kv.layout import KVLayout

MAGIC = b"DPKV"
VERSION = 1
HEADER_BYTES = 4096
_FIXED = struct.Struct("<4sHHIII16sQQ16sH")  # ... parent hash, key-name length


class BadBlockFile(Exception):
    """A block file is not a valid block for the expected key (internal: becomes a miss)."""


@dataclass(frozen=True)
class BlockHeader:
    """What the header of a block file says."""

    key_name: str
    parent: bytes | None
    num_layers: int
    tokens: int
    bytes_per_token_per_layer: int
    dtype: str
    payload_bytes: int
    checksum: int


def checksum(payload: memoryview | Sequence[memoryview]) -> int:
    """xxh3-64 of the payload, whole or in parts (tens of GB/s: never a read's bottleneck)."""
    if isinstance(payload, memoryview):
        return xxhash.xxh3_64_intdigest(payload)
    digest = xxhash.xxh3_64()
    for part in payload:
        digest.update(part)
    return digest.intdigest()


def pack_header(key_name: str, parent: bytes | None, layout: KVLayout,
                payload: memoryview | Sequence[memoryview]) -> bytes:
    """The 4 KiB header for ``payload`` (whole or in parts) stored under ``key_name``."""
    name = key_name.encode()
    nbytes = payload.nbytes if isinstance(payload, memoryview) else sum(p.nbytes for p in payload)
    fixed = _FIXED.pack(MAGIC, VERSION, HEADER_BYTES, layout.num_layers, layout.block_size,
                        layout.bytes_per_token_per_layer, layout.dtype.encode(), nbytes,
                        checksum(payload), parent or bytes(16), len(name))
    header = fixed + name
    if len(header) > HEADER_BYTES:
        raise ValueError("key name too long for the header")
    return header + bytes(HEADER_BYTES - len(header))


def unpack_header(raw: bytes | memoryview) -> BlockHeader:
    """Parse a header; ``BadBlockFile`` if it is not one."""
    if len(raw) < HEADER_BYTES:
        raise BadBlockFile("short header")
    (magic, version, header_bytes, layers, tokens, bpt, dtype, payload_bytes, digest, parent,
     name_len) = _FIXED.unpack_from(raw, 0)
    if magic != MAGIC or version != VERSION or header_bytes != HEADER_BYTES:
        raise BadBlockFile("bad magic or version")
    if _FIXED.size + name_len > HEADER_BYTES:
        raise BadBlockFile("bad key length")
    name = bytes(raw[_FIXED.size : _FIXED.size + name_len]).decode(errors="replace")
    return BlockHeader(name, None if parent == bytes(16) else parent, layers, tokens, bpt,
                       dtype.rstrip(b"\0").decode(errors="replace"), payload_bytes, digest)


def check_header(header: BlockHeader, key_name: str, layout: KVLayout) -> None:
    """``BadBlockFile`` unless the header describes ``key_name`` in ``layout``."""
    expected = (key_name, layout.num_layers, layout.block_size, layout.bytes_per_token_per_layer,
                layout.dtype, layout.full_block_bytes)
    found = (header.key_name, header.num_layers, header.tokens,
             header.bytes_per_token_per_layer, header.dtype, header.payload_bytes)
    if found != expected:
        raise BadBlockFile(f"header {found} != expected {expected}")
