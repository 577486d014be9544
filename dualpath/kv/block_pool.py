"""Reference-counted pool of fixed-size KV blocks with prefix caching (pure).

A block is *in use* while its reference count is positive. A freed block that holds a full,
hashed block of tokens stays findable by its hash until it is handed out again; free blocks
are reused least-recently-freed first, so recently used prefixes survive longest.

Anything that still reads a block after its sequence may end — a queued device → host save —
takes a reference of its own (``hold``) and drops it (``free``) when it is done: whatever ends
the sequence (finish, abort, preemption), the block is not handed out again under the read.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from dualpath.errors import OutOfBlocksError


class BlockPool:
    """Allocation, sharing and freeing of ``num_blocks`` block ids."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._block_by_hash: dict[bytes, int] = {}
        self._hash_by_block: dict[int, bytes] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, cached or not)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently findable by hash (in use or free)."""
        return len(self._block_by_hash)

    def allocate(self, count: int) -> list[int]:
        """Hand out ``count`` fresh blocks (ref count 1); evicts the oldest cached free blocks."""
        if count > len(self._free):
            raise OutOfBlocksError(f"need {count} KV blocks, {len(self._free)} free")
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            self._forget_hash(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def match_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """Take a reference on the cached blocks of the longest leading run of ``hashes``."""
        blocks = []
        for h in hashes:
            block = self._block_by_hash.get(h)
            if block is None:
                break
            blocks.append(block)
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1
        return blocks

    def hold(self, blocks: Sequence[int]) -> None:
        """Take one more reference on each block — in use, or freed and not yet handed out
        again (its contents are still what was last written) — released by ``free``."""
        for block in blocks:
            if not 0 <= block < self.num_blocks:
                raise ValueError(f"block {block} out of range [0, {self.num_blocks})")
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1

    def register(self, block: int, block_hash: bytes) -> None:
        """Record that ``block`` now holds the full block named ``block_hash``."""
        if self.ref_counts[block] <= 0:
            raise ValueError(f"block {block} is not in use")
        if block_hash in self._block_by_hash or block in self._hash_by_block:
            return  # an identical block is cached already; keep the first copy
        self._block_by_hash[block_hash] = block
        self._hash_by_block[block] = block_hash

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block; unreferenced blocks become reusable."""
        for block in reversed(blocks):  # tail blocks are evicted before their prefix
            if self.ref_counts[block] <= 0:
                raise ValueError(f"block {block} freed twice")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None

    def _forget_hash(self, block: int) -> None:
        block_hash = self._hash_by_block.pop(block, None)
        if block_hash is not None:
            del self._block_by_hash[block_hash]
