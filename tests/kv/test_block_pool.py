"""BlockPool: reference counts, prefix matching and least-recently-freed eviction."""

import pytest

from dualpath.errors import DualPathError, OutOfBlocksError
from dualpath.kv.block_pool import BlockPool


def _hashes(tag: str, count: int) -> list[bytes]:
    return [f"{tag}{i}".encode().ljust(16, b".") for i in range(count)]


def _cached_sequence(pool: BlockPool, tag: str, count: int) -> tuple[list[int], list[bytes]]:
    """Allocate ``count`` blocks and register them under fresh hashes."""
    blocks = pool.allocate(count)
    hashes = _hashes(tag, count)
    for block, h in zip(blocks, hashes, strict=True):
        pool.register(block, h)
    return blocks, hashes


# --- construction ----------------------------------------------------------------------------


def test_new_pool_is_all_free():
    pool = BlockPool(5)
    assert pool.num_free_blocks == 5
    assert pool.num_cached_blocks == 0
    assert pool.ref_counts == [0] * 5


@pytest.mark.parametrize("num_blocks", [0, -1])
def test_non_positive_size_is_rejected(num_blocks):
    with pytest.raises(ValueError, match="positive"):
        BlockPool(num_blocks)


# --- allocate / free -------------------------------------------------------------------------


def test_allocate_hands_out_distinct_blocks_with_one_reference():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert len(set(blocks)) == 3
    assert all(0 <= b < 4 for b in blocks)
    assert all(pool.ref_counts[b] == 1 for b in blocks)
    assert pool.num_free_blocks == 1


def test_allocate_zero_is_a_no_op():
    pool = BlockPool(2)
    assert pool.allocate(0) == []
    assert pool.num_free_blocks == 2


def test_free_returns_blocks_to_the_pool():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    assert pool.num_free_blocks == 0
    pool.free(blocks)
    assert pool.num_free_blocks == 4
    assert pool.ref_counts == [0] * 4


def test_exhausted_pool_raises_out_of_blocks_with_clear_message():
    pool = BlockPool(3)
    pool.allocate(1)
    with pytest.raises(OutOfBlocksError, match=r"need 3 KV blocks, 2 free"):
        pool.allocate(3)


def test_out_of_blocks_is_a_dualpath_error():
    pool = BlockPool(1)
    with pytest.raises(DualPathError):
        pool.allocate(2)


def test_failed_allocation_leaves_the_pool_unchanged():
    pool = BlockPool(3)
    pool.allocate(1)
    refs = list(pool.ref_counts)
    with pytest.raises(OutOfBlocksError):
        pool.allocate(5)
    assert pool.num_free_blocks == 2
    assert pool.ref_counts == refs
    assert len(pool.allocate(2)) == 2


def test_freeing_twice_raises_value_error():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(ValueError, match="freed twice"):
        pool.free(blocks)


def test_freeing_a_never_allocated_block_raises_value_error():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="block 1"):
        pool.free([1])


def test_uncached_free_blocks_are_reused_least_recently_freed_first():
    pool = BlockPool(3)
    a, _b, c = pool.allocate(3)
    pool.free([c])
    pool.free([a])
    assert pool.allocate(1) == [c]
    assert pool.allocate(1) == [a]


# --- register / match_prefix -----------------------------------------------------------------


def test_register_makes_blocks_findable():
    pool = BlockPool(4)
    blocks, hashes = _cached_sequence(pool, "a", 3)
    assert pool.num_cached_blocks == 3
    assert pool.match_prefix(hashes) == blocks


def test_match_prefix_returns_longest_leading_run_only():
    pool = BlockPool(6)
    blocks, hashes = _cached_sequence(pool, "a", 3)
    unknown = b"never-registered"
    # hashes[2] is cached but comes after a miss, so it must not be matched
    assert pool.match_prefix([hashes[0], hashes[1], unknown, hashes[2]]) == blocks[:2]


def test_match_prefix_with_leading_miss_matches_nothing():
    pool = BlockPool(4)
    blocks, hashes = _cached_sequence(pool, "a", 2)
    assert pool.match_prefix([b"miss", *hashes]) == []
    assert [pool.ref_counts[b] for b in blocks] == [1, 1]


def test_match_prefix_of_empty_list_is_empty():
    pool = BlockPool(2)
    _cached_sequence(pool, "a", 1)
    assert pool.match_prefix([]) == []


def test_match_prefix_takes_a_reference_on_blocks_in_use():
    pool = BlockPool(4)
    blocks, hashes = _cached_sequence(pool, "a", 2)
    free_before = pool.num_free_blocks
    assert pool.match_prefix(hashes) == blocks
    assert [pool.ref_counts[b] for b in blocks] == [2, 2]
    assert pool.num_free_blocks == free_before


def test_matching_a_free_cached_block_removes_it_from_the_free_list():
    pool = BlockPool(4)
    blocks, hashes = _cached_sequence(pool, "a", 2)
    pool.free(blocks)
    assert pool.num_free_blocks == 4
    assert pool.match_prefix(hashes) == blocks
    assert pool.num_free_blocks == 2
    assert [pool.ref_counts[b] for b in blocks] == [1, 1]
    others = pool.allocate(2)
    assert set(others).isdisjoint(blocks)
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)


def test_shared_block_stays_in_use_until_both_sequences_free_it():
    pool = BlockPool(4)
    blocks_a, hashes = _cached_sequence(pool, "a", 2)
    blocks_b = pool.match_prefix(hashes)
    assert blocks_b == blocks_a
    pool.free(blocks_a)
    assert [pool.ref_counts[b] for b in blocks_a] == [1, 1]
    assert pool.num_free_blocks == 2
    # still in use: a fresh allocation must not hand them out
    assert set(pool.allocate(2)).isdisjoint(blocks_a)
    pool.free(blocks_b)
    assert [pool.ref_counts[b] for b in blocks_a] == [0, 0]
    assert pool.num_free_blocks == 2


def test_free_cached_block_stays_findable_until_reallocated():
    pool = BlockPool(3)
    blocks, hashes = _cached_sequence(pool, "a", 1)
    pool.free(blocks)
    assert pool.num_cached_blocks == 1
    assert pool.match_prefix(hashes) == blocks


def test_register_on_a_free_block_raises_value_error():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="not in use"):
        pool.register(0, b"h")


def test_register_after_free_raises_value_error():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(ValueError, match="not in use"):
        pool.register(blocks[0], b"h")
    assert pool.num_cached_blocks == 0


def test_registering_a_hash_already_cached_keeps_the_first_copy():
    pool = BlockPool(3)
    (first,) = pool.allocate(1)
    (second,) = pool.allocate(1)
    pool.register(first, b"same")
    pool.register(second, b"same")
    assert pool.num_cached_blocks == 1
    assert pool.match_prefix([b"same"]) == [first]
    # recycling the duplicate must not drop the cached first copy
    pool.free([second])
    pool.allocate(2)
    assert pool.num_cached_blocks == 1
    assert pool.match_prefix([b"same"]) == [first]


# --- eviction --------------------------------------------------------------------------------


def test_allocation_evicts_cached_free_blocks():
    pool = BlockPool(2)
    blocks, hashes = _cached_sequence(pool, "a", 2)
    pool.free(blocks)
    pool.allocate(2)
    assert pool.num_cached_blocks == 0
    assert pool.match_prefix(hashes) == []


def test_never_used_blocks_go_before_a_recently_freed_cached_block():
    pool = BlockPool(3)
    blocks, hashes = _cached_sequence(pool, "a", 1)
    pool.free(blocks)
    assert set(pool.allocate(2)).isdisjoint(blocks)
    assert pool.num_cached_blocks == 1
    assert pool.match_prefix(hashes) == blocks


def test_tail_blocks_are_evicted_before_their_prefix():
    pool = BlockPool(3)
    blocks, hashes = _cached_sequence(pool, "a", 3)
    pool.free(blocks)
    assert pool.allocate(1) == [blocks[2]]
    assert pool.match_prefix(hashes) == blocks[:2]
    pool.free(blocks[:2])
    # blocks[1] is freed again before blocks[0] (reverse walk), so it goes next
    assert pool.allocate(1) == [blocks[1]]
    assert pool.match_prefix(hashes) == blocks[:1]


def test_eviction_stops_prefix_match_at_the_evicted_block():
    pool = BlockPool(4)
    blocks, hashes = _cached_sequence(pool, "a", 4)
    pool.free(blocks)
    pool.allocate(2)  # evicts the two tail blocks
    assert pool.num_cached_blocks == 2
    assert pool.match_prefix(hashes) == blocks[:2]


def test_least_recently_freed_sequence_is_evicted_first():
    pool = BlockPool(4)
    blocks_a, hashes_a = _cached_sequence(pool, "a", 2)
    blocks_b, hashes_b = _cached_sequence(pool, "b", 2)
    pool.free(blocks_a)
    pool.free(blocks_b)
    assert sorted(pool.allocate(2)) == sorted(blocks_a)
    assert pool.match_prefix(hashes_a) == []
    assert pool.match_prefix(hashes_b) == blocks_b


def test_reusing_a_prefix_refreshes_its_eviction_order():
    pool = BlockPool(4)
    blocks_a, hashes_a = _cached_sequence(pool, "a", 2)
    blocks_b, hashes_b = _cached_sequence(pool, "b", 2)
    pool.free(blocks_a)
    pool.free(blocks_b)
    # a later request reuses A's prefix and finishes: A is now the most recently freed
    pool.free(pool.match_prefix(hashes_a))
    assert sorted(pool.allocate(2)) == sorted(blocks_b)
    assert pool.match_prefix(hashes_b) == []
    assert pool.match_prefix(hashes_a) == blocks_a


def test_a_held_block_is_not_handed_out_until_the_hold_ends():
    """A block freed by its sequence while a save still reads it stays out of the free list."""
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    pool.hold([blocks[1]])  # a queued save of block 1
    pool.free(blocks)  # the sequence ends
    assert pool.num_free_blocks == 2
    assert blocks[1] not in pool.allocate(2)
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)
    pool.free([blocks[1]])  # the save has read it
    assert pool.allocate(1) == [blocks[1]]


def test_hold_takes_a_freed_block_back_before_it_is_handed_out():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.free([block])
    pool.hold([block])  # the sequence finished in this step; its last block is saved now
    assert pool.num_free_blocks == 1 and block not in pool.allocate(1)
    with pytest.raises(ValueError):
        pool.hold([5])
