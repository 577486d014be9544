"""The on-disk format of one full block: a 4 KiB header, then the payload.

Header: magic ``DPKV``, format version, the key's name and parent hash, layer count, tokens,
bytes per token per layer, dtype, payload size and an xxh3-64 checksum of the payload. The
header is padded to 4 KiB so the payload starts aligned (O_DIRECT reads land in place).

Version 2 adds the block's own token ids (uint32, little-endian, after the key's name) and an
xxh3-64 of the parent hash and token ids, so a stored chain can be walked to its root and
recomputed (``storage/verify.py``); a block saved without token ids holds none (count 0). The
ids live inside the 4 KiB header, so a block file's size and its payload's offset are those of
version 1 (up to ``max_header_tokens``: about 950 tokens per block; a larger block is stored
without them). Version-1 files read as damaged, hence misses that are deleted and rewritten:
they carry no token ids, and they were written before the decode engine stopped saving another
request's KV under a request's keys (commit d50effb), so none of them can be trusted or audited.

After the token ids a block may hold its chain's *seed hash* (``BlockKey.seed_hash``): the
marker ``SEED``, the 16-byte hash and an xxh3-64 of it. An audit needs it to check a chain's
first block, whose key hashes the tenant's ``cache_salt``: with it, the first block's ids are
checked against its key under its own seed, and a salted root (a seed other than the unsalted
one) is told from an unsalted root under a wrong key. It lives in what was zero padding, so the
format stays version 2 both ways: older readers ignore it, and a file without it (written by
older code) reads with ``seed_hash`` None. Any other bytes where it would be are damage.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from dualpath.kv.hashing import BlockKey
from dualpath.kv.layout import KVLayout

MAGIC = b"DPKV"
VERSION = 2
HEADER_BYTES = 4096
_FIXED = struct.Struct("<4sHHIII16sQQ16sH")  # ... parent hash, key-name length
_TOKENS = struct.Struct("<IQ")  # token ids stored (0 or the block's tokens), their checksum
_TOKEN = 4  # bytes per stored token id (uint32)
_SEED = struct.Struct("<4s16sQ")  # after the ids: marker, the chain's seed hash, its xxh3-64
_SEED_MARKER = b"SEED"


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
    token_ids: tuple[int, ...] | None = None  # the block's token ids, None if not stored
    seed_hash: bytes | None = None  # its chain's seed hash, None if not stored


def checksum(payload: memoryview | Sequence[memoryview]) -> int:
    """xxh3-64 of the payload, whole or in parts (tens of GB/s: never a read's bottleneck)."""
    if isinstance(payload, memoryview):
        return xxhash.xxh3_64_intdigest(payload)
    digest = xxhash.xxh3_64()
    for part in payload:
        digest.update(part)
    return digest.intdigest()


def max_header_tokens(key_name: str) -> int:
    """How many token ids fit in the header of a block stored under ``key_name``."""
    return (HEADER_BYTES - _FIXED.size - _TOKENS.size - _SEED.size
            - len(key_name.encode())) // _TOKEN


def _token_bytes(token_ids: Sequence[int] | None, room: int) -> bytes:
    """The ids as stored, or nothing when there are none, too many, or one is not a uint32
    (the block is then stored without them: still a valid block, just not auditable)."""
    if token_ids is None or len(token_ids) > room:
        return b""
    try:
        return struct.pack(f"<{len(token_ids)}I", *token_ids)
    except struct.error:
        return b""


def _meta_checksum(parent: bytes, ids: bytes) -> int:
    return xxhash.xxh3_64_intdigest(parent + ids)


def _seed_bytes(seed_hash: bytes | None) -> bytes:
    """The seed trailer of ``seed_hash`` (nothing when there is none)."""
    if seed_hash is None:
        return b""
    if len(seed_hash) != 16:
        raise ValueError("a seed hash is 16 bytes")
    return _SEED.pack(_SEED_MARKER, seed_hash, xxhash.xxh3_64_intdigest(seed_hash))


def _unpack_seed(raw: bytes | memoryview, offset: int) -> bytes | None:
    """The seed hash stored at ``offset`` (None where the bytes are zero, or too few for one:
    none was stored); ``BadBlockFile`` for anything else than a trailer that passes its
    checksum."""
    trailer = bytes(raw[offset : min(offset + _SEED.size, HEADER_BYTES)])
    if len(trailer) < _SEED.size or not any(trailer):
        return None
    marker, seed_hash, digest = _SEED.unpack(trailer)
    if marker != _SEED_MARKER or xxhash.xxh3_64_intdigest(seed_hash) != digest:
        raise BadBlockFile("seed trailer damaged")
    return seed_hash


def pack_header(key_name: str, parent: bytes | None, layout: KVLayout,
                payload: memoryview | Sequence[memoryview],
                token_ids: Sequence[int] | None = None,
                seed_hash: bytes | None = None) -> bytes:
    """The 4 KiB header for ``payload`` (whole or in parts) stored under ``key_name``, with
    the block's ``token_ids`` when given (and they fit: ``max_header_tokens``) and its chain's
    ``seed_hash`` when given."""
    name = key_name.encode()
    nbytes = payload.nbytes if isinstance(payload, memoryview) else sum(p.nbytes for p in payload)
    parent = parent or bytes(16)
    ids = _token_bytes(token_ids, max(0, max_header_tokens(key_name)))
    fixed = _FIXED.pack(MAGIC, VERSION, HEADER_BYTES, layout.num_layers, layout.block_size,
                        layout.bytes_per_token_per_layer, layout.dtype.encode(), nbytes,
                        checksum(payload), parent, len(name))
    header = (fixed + _TOKENS.pack(len(ids) // _TOKEN, _meta_checksum(parent, ids)) + name + ids
              + _seed_bytes(seed_hash))
    if len(header) > HEADER_BYTES:
        raise ValueError("key name too long for the header")
    return header + bytes(HEADER_BYTES - len(header))


def key_header(key: BlockKey, layout: KVLayout,
               payload: memoryview | Sequence[memoryview]) -> bytes:
    """The header of ``payload`` stored under ``key``, with what the key carries beside its
    name (parent, token ids, seed hash)."""
    return pack_header(key.name, key.parent, layout, payload, key.token_ids, key.seed_hash)


def stored_key(key: BlockKey, header: BlockHeader) -> BlockKey:
    """``key`` as its block was stored: with the parent, token ids and seed hash of
    ``header``."""
    return BlockKey(key.model_id, key.layout_id, key.block_size, key.block_hash, header.parent,
                    header.token_ids, header.seed_hash)


def unpack_header(raw: bytes | memoryview) -> BlockHeader:
    """Parse a header; ``BadBlockFile`` if it is not one of this version, or if its parent
    hash, token ids or seed hash fail their checksum."""
    if len(raw) < HEADER_BYTES:
        raise BadBlockFile("short header")
    (magic, version, header_bytes, layers, tokens, bpt, dtype, payload_bytes, digest, parent,
     name_len) = _FIXED.unpack_from(raw, 0)
    if magic != MAGIC or version != VERSION or header_bytes != HEADER_BYTES:
        raise BadBlockFile("bad magic or version")
    num_ids, meta_digest = _TOKENS.unpack_from(raw, _FIXED.size)
    start = _FIXED.size + _TOKENS.size
    ids_start = start + name_len
    ids_end = ids_start + num_ids * _TOKEN
    if ids_end > HEADER_BYTES:
        raise BadBlockFile("bad key or token-id length")
    ids = bytes(raw[ids_start:ids_end])
    if _meta_checksum(parent, ids) != meta_digest:
        raise BadBlockFile("parent or token-id checksum mismatch")
    name = bytes(raw[start:ids_start]).decode(errors="replace")
    token_ids = struct.unpack(f"<{num_ids}I", ids) if num_ids else None
    return BlockHeader(name, None if parent == bytes(16) else parent, layers, tokens, bpt,
                       dtype.rstrip(b"\0").decode(errors="replace"), payload_bytes, digest,
                       token_ids, _unpack_seed(raw, ids_end))


def check_header(header: BlockHeader, key_name: str, layout: KVLayout) -> None:
    """``BadBlockFile`` unless the header describes ``key_name`` in ``layout``."""
    expected = (key_name, layout.num_layers, layout.block_size, layout.bytes_per_token_per_layer,
                layout.dtype, layout.full_block_bytes)
    found = (header.key_name, header.num_layers, header.tokens,
             header.bytes_per_token_per_layer, header.dtype, header.payload_bytes)
    if found != expected:
        raise BadBlockFile(f"header {found} != expected {expected}")
    if header.token_ids is not None and len(header.token_ids) != layout.block_size:
        raise BadBlockFile(f"{len(header.token_ids)} token ids in a block of {layout.block_size}")
