"""Chained, stable hashes of full token blocks and the keys that name them (pure).

Block k's hash covers the parent hash and the block's token ids, so equal hashes mean equal
prefixes. Hashes are blake2b digests seeded with the model identity and KV layout, never
Python's salted ``hash()``. A ``BlockKey`` carries model id, layout id, block size and hash,
and may carry its parent's hash, its own token ids and its chain's seed hash: stores keep them
with the block, so a stored chain can be walked back to its root, its root's key checked
(salted or not) and the chain recomputed (``dualpath store verify``).
"""

from __future__ import annotations

import hashlib
import re
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

from dualpath.errors import InvalidKeyError

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


_SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_id(value: str, what: str) -> str:
    """``value`` if it is a safe identifier (letters, digits, ``._-``), else ``InvalidKeyError``."""
    if not isinstance(value, str) or not _SAFE_ID.fullmatch(value) or ".." in value:
        raise InvalidKeyError(f"{what} {value!r} must match {_SAFE_ID.pattern} without '..'")
    return value


def _check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or not 0 < block_size <= 1 << 20:
        raise InvalidKeyError(f"block size {block_size!r} out of range")


@dataclass(frozen=True)
class BlockKey:
    """Names one stored full block: model, KV layout, block size and the chained hash.

    ``parent`` (the previous block's hash, ``None`` for the first block) rides along so stores
    can keep their contents prefix-closed; ``token_ids`` (the block's own ``block_size`` token
    ids, ``None`` when unknown) ride along so a stored block can be recomputed and audited.
    Neither takes part in equality.
    """

    model_id: str
    layout_id: str
    block_size: int
    block_hash: bytes
    parent: bytes | None = field(default=None, compare=False)
    token_ids: tuple[int, ...] | None = field(default=None, compare=False, repr=False)
    seed_hash: bytes | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_id(self.model_id, "model id")
        check_id(self.layout_id, "layout id")
        _check_block_size(self.block_size)
        if not isinstance(self.block_hash, bytes) or len(self.block_hash) != DIGEST_BYTES:
            raise InvalidKeyError(f"block hash must be {DIGEST_BYTES} bytes")
        if self.seed_hash is not None and (not isinstance(self.seed_hash, bytes)
                                           or len(self.seed_hash) != DIGEST_BYTES):
            raise InvalidKeyError(f"seed hash must be {DIGEST_BYTES} bytes")
        if self.token_ids is not None and (not isinstance(self.token_ids, tuple)
                                           or len(self.token_ids) != self.block_size):
            raise InvalidKeyError(f"token ids must be a tuple of {self.block_size} ids")

    @property
    def hex(self) -> str:
        """The block hash as 32 hex digits."""
        return self.block_hash.hex()

    @property
    def name(self) -> str:
        """A printable, path-safe name of the key."""
        return f"{self.model_id}/{self.layout_id}/bs{self.block_size}/{self.hex}"


def checked_key(key: object) -> BlockKey:
    """``key`` if it is a well-formed ``BlockKey``, else ``InvalidKeyError``: stores re-check
    before naming a path or object, since a frozen dataclass can still be mutated through
    ``object.__setattr__``."""
    if not isinstance(key, BlockKey):
        raise InvalidKeyError(f"expected a BlockKey, got {type(key).__name__}")
    check_id(key.model_id, "model id")
    check_id(key.layout_id, "layout id")
    if not isinstance(key.block_size, int) or not isinstance(key.block_hash, bytes):
        raise InvalidKeyError(f"key {key!r} has a malformed block size or hash")
    return key


def salted_seed(seed: str, cache_salt: str) -> str:
    """A chain seed with a tenant's ``cache_salt`` mixed in ("" leaves it as it is): chains of
    different salts share no block, so one tenant's prefixes never hit another's."""
    return f"{seed}|salt:{cache_salt}" if cache_salt else seed


@dataclass(frozen=True)
class KeySpace:
    """All keys of one model and KV layout; seeds the hash chain with both (and a tenant's
    ``salt``, when one is set: see ``salted_seed``)."""

    model_id: str
    layout_id: str
    block_size: int
    salt: str = ""

    def __post_init__(self) -> None:
        check_id(self.model_id, "model id")
        check_id(self.layout_id, "layout id")
        _check_block_size(self.block_size)

    @property
    def seed(self) -> str:
        """The seed of every chain in this key space."""
        return salted_seed(f"{self.model_id}|{self.layout_id}|{self.block_size}", self.salt)

    @cached_property
    def seed_hash(self) -> bytes:
        """``root_hash(seed)``: the parent hash of every chain's first block, which each key
        of this space carries (a salted space's differs from its unsalted space's)."""
        return root_hash(self.seed)

    def salted(self, cache_salt: str) -> KeySpace:
        """This key space for one tenant's ``cache_salt`` ("": this one)."""
        return self if cache_salt == self.salt else replace(self, salt=cache_salt)

    def key(self, block_hash: bytes, parent: bytes | None,
            token_ids: tuple[int, ...] | None = None) -> BlockKey:
        """The key of one block given its hash, its parent's hash and (optionally) its own
        ``block_size`` token ids; it carries this space's ``seed_hash``. A store keeps all
        three with the block for audits."""
        return BlockKey(self.model_id, self.layout_id, self.block_size, block_hash, parent,
                        token_ids, self.seed_hash)

    def keys_for_hashes(self, hashes: Sequence[bytes],
                        token_ids: Sequence[int] | None = None) -> list[BlockKey]:
        """Keys of a chain of block hashes (block 0 first); with the chain's ``token_ids``,
        each key carries its block's."""
        parents: list[bytes | None] = [None, *hashes][: len(hashes)]
        bs = self.block_size
        return [self.key(h, p, None if token_ids is None
                         else tuple(token_ids[k * bs : (k + 1) * bs]))
                for k, (h, p) in enumerate(zip(hashes, parents, strict=True))]

    def keys(self, token_ids: Sequence[int]) -> list[BlockKey]:
        """Keys of every full block of ``token_ids``, each carrying its block's token ids."""
        hashes = extend_block_hashes([], token_ids, self.block_size, self.seed)
        return self.keys_for_hashes(hashes, token_ids)
