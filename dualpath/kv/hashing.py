"""Chained, stable hashes of full token blocks (pure: no torch, no clock).

Block k's hash covers the parent hash and the block's token ids, so equal hashes mean equal
prefixes. Hashes are blake2b digests seeded with a caller-given identity (model and layout),
never Python's salted ``hash()``.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

DIGEST_BYTES = 16


def root_hash(seed: str) -> bytes:
    """The parent hash of a sequence's first block, derived from ``seed``."""
    return hashlib.blake2b(seed.encode(), digest_size=DIGEST_BYTES).digest()


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Hash of one full block given its parent's hash."""
    h = hashlib.blake2b(parent, digest_size=DIGEST_BYTES)
    ids = array("Q", token_ids)
    if sys.byteorder == "big":
        ids.byteswap()  # hash little-endian bytes on every host
    h.update(ids.tobytes())
    return h.digest()


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int,
                        seed: str) -> list[bytes]:
    """Append hashes for every full block of ``token_ids`` not yet in ``hashes`` (in place)."""
    parent = hashes[-1] if hashes else root_hash(seed)
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
