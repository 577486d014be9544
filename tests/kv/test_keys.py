"""BlockKey and KeySpace: what a key carries, how keys chain, and which ids are refused."""

import itertools

import pytest

from dualpath.errors import InvalidKeyError, StorageError
from dualpath.kv.hashing import (
    DIGEST_BYTES,
    BlockKey,
    KeySpace,
    check_id,
    extend_block_hashes,
    root_hash,
)
from dualpath.kv.layout import KVLayout

LAYOUT = KVLayout(4, 2, 8, "float16", 16)
MODEL = "SmolLM2-135M-Instruct"
SPACE = KeySpace(MODEL, LAYOUT.layout_id, 16)
TOKENS = list(range(1000, 1000 + 16 * 5 + 3))  # 5 full blocks and a partial one
HASH = bytes(range(DIGEST_BYTES))

HOSTILE = ["../x", "a/b", "/abs", "..", "", "a\\b", "a\x00b", "x" * 200, ".", ".hidden",
           "a..b", "a\n", "-x", "a b"]
NOT_STR = [5, None, b"abc", 1.5, ["a"]]


def test_keys_carry_model_layout_block_size_and_hash():
    keys = SPACE.keys(TOKENS)
    hashes = extend_block_hashes([], TOKENS, 16, SPACE.seed)
    assert len(keys) == 5
    for key, digest in zip(keys, hashes, strict=True):
        assert (key.model_id, key.layout_id, key.block_size) == (MODEL, LAYOUT.layout_id, 16)
        assert key.block_hash == digest
        assert key.hex == digest.hex()
        assert key.name == f"{MODEL}/{LAYOUT.layout_id}/bs16/{digest.hex()}"


def test_only_full_blocks_get_keys():
    assert len(SPACE.keys(TOKENS[:16])) == 1
    assert len(SPACE.keys(TOKENS[:31])) == 1
    assert len(SPACE.keys(TOKENS[:32])) == 2


@pytest.mark.parametrize("count", [0, 1, 15])
def test_fewer_tokens_than_a_block_give_no_keys(count):
    assert SPACE.keys(TOKENS[:count]) == []


def test_parents_chain():
    keys = SPACE.keys(TOKENS)
    assert keys[0].parent is None
    for prev, key in itertools.pairwise(keys):
        assert key.parent == prev.block_hash


def test_keys_for_hashes_matches_keys():
    hashes = extend_block_hashes([], TOKENS, 16, SPACE.seed)
    by_hash = SPACE.keys_for_hashes(hashes)
    assert by_hash == SPACE.keys(TOKENS)
    assert [k.parent for k in by_hash] == [None, *hashes[:-1]]


def test_keys_for_no_hashes():
    assert SPACE.keys_for_hashes([]) == []


def test_parent_takes_no_part_in_equality():
    a = BlockKey(MODEL, LAYOUT.layout_id, 16, HASH, None)
    b = BlockKey(MODEL, LAYOUT.layout_id, 16, HASH, b"\x01" * DIGEST_BYTES)
    assert a == b
    assert hash(a) == hash(b)
    assert len({a, b}) == 1


def test_every_other_field_takes_part_in_equality():
    base = BlockKey(MODEL, LAYOUT.layout_id, 16, HASH)
    assert base != BlockKey("other", LAYOUT.layout_id, 16, HASH)
    assert base != BlockKey(MODEL, "other", 16, HASH)
    assert base != BlockKey(MODEL, LAYOUT.layout_id, 32, HASH)
    assert base != BlockKey(MODEL, LAYOUT.layout_id, 16, bytes(DIGEST_BYTES))


def test_keys_carry_their_blocks_token_ids():
    keys = SPACE.keys(TOKENS)
    for k, key in enumerate(keys):
        assert key.token_ids == tuple(TOKENS[16 * k : 16 * (k + 1)])
    hashes = [key.block_hash for key in keys]
    assert [k.token_ids for k in SPACE.keys_for_hashes(hashes)] == [None] * 5
    assert SPACE.keys_for_hashes(hashes, TOKENS) == keys


def test_key_takes_the_token_ids_the_decode_engine_passes():
    keys = SPACE.keys(TOKENS)
    key = SPACE.key(keys[1].block_hash, keys[0].block_hash, token_ids=tuple(TOKENS[16:32]))
    assert key.token_ids == keys[1].token_ids and key.parent == keys[0].block_hash


def test_token_ids_take_no_part_in_equality():
    key = SPACE.keys(TOKENS)[0]
    bare = BlockKey(MODEL, LAYOUT.layout_id, 16, key.block_hash)
    assert bare == key and hash(bare) == hash(key)


def test_keys_carry_their_key_spaces_seed_hash_salted_or_not():
    salted = SPACE.salted("tenant-a")
    assert SPACE.seed_hash == root_hash(SPACE.seed)
    assert salted.seed_hash == root_hash(salted.seed) != SPACE.seed_hash
    for space in (SPACE, salted):
        keys = space.keys(TOKENS)
        assert {k.seed_hash for k in keys} == {space.seed_hash}
        assert {k.seed_hash for k in space.keys_for_hashes([k.block_hash for k in keys])} == {
            space.seed_hash}
        assert space.key(HASH, None).seed_hash == space.seed_hash


def test_a_seed_hash_takes_no_part_in_equality():
    key = SPACE.salted("tenant-a").key(HASH, None)
    bare = BlockKey(MODEL, LAYOUT.layout_id, 16, HASH)
    assert bare.seed_hash is None and bare == key and hash(bare) == hash(key)


@pytest.mark.parametrize("seed_hash", [b"", bytes(15), bytes(17), "0" * 16])
def test_block_key_rejects_a_seed_hash_that_is_not_a_digest(seed_hash):
    with pytest.raises(InvalidKeyError, match="seed hash"):
        BlockKey(MODEL, LAYOUT.layout_id, 16, HASH, None, None, seed_hash)


@pytest.mark.parametrize("ids", [tuple(range(15)), tuple(range(17)), list(range(16)), ()])
def test_block_key_rejects_token_ids_that_are_not_one_blocks(ids):
    with pytest.raises(InvalidKeyError):
        BlockKey(MODEL, LAYOUT.layout_id, 16, HASH, None, ids)


def test_keys_are_frozen():
    key = SPACE.keys(TOKENS)[0]
    with pytest.raises(AttributeError):
        key.model_id = "x"


def test_same_tokens_same_keys():
    assert SPACE.keys(TOKENS) == KeySpace(MODEL, LAYOUT.layout_id, 16).keys(list(TOKENS))


def test_hashes_depend_on_model_id():
    ours = {k.block_hash for k in SPACE.keys(TOKENS)}
    theirs = {k.block_hash for k in KeySpace("other-model", LAYOUT.layout_id, 16).keys(TOKENS)}
    assert ours.isdisjoint(theirs)


def test_hashes_depend_on_layout_id():
    other = KVLayout(4, 2, 8, "bfloat16", 16)
    assert other.layout_id != LAYOUT.layout_id
    ours = {k.block_hash for k in SPACE.keys(TOKENS)}
    theirs = {k.block_hash for k in KeySpace(MODEL, other.layout_id, 16).keys(TOKENS)}
    assert ours.isdisjoint(theirs)


def test_a_changed_token_changes_its_block_and_all_later_ones():
    changed = list(TOKENS)
    changed[16 * 2 + 5] += 1
    ours, theirs = SPACE.keys(TOKENS), SPACE.keys(changed)
    assert ours[:2] == theirs[:2]
    assert all(a != b for a, b in zip(ours[2:], theirs[2:], strict=True))


@pytest.mark.parametrize("value", ["a", "SmolLM2-135M-Instruct", "kv-bfloat16-L30", "a.b_c-d",
                                   "9", "x" * 128])
def test_check_id_accepts_safe_ids(value):
    assert check_id(value, "model id") == value
    assert BlockKey(value, value, 16, HASH).model_id == value


@pytest.mark.parametrize("value", [*HOSTILE, "x" * 129])
def test_check_id_rejects_hostile_ids(value):
    with pytest.raises(InvalidKeyError):
        check_id(value, "model id")


@pytest.mark.parametrize("value", HOSTILE + NOT_STR)
def test_block_key_rejects_hostile_model_id(value):
    with pytest.raises(InvalidKeyError):
        BlockKey(value, LAYOUT.layout_id, 16, HASH)


@pytest.mark.parametrize("value", HOSTILE + NOT_STR)
def test_block_key_rejects_hostile_layout_id(value):
    with pytest.raises(InvalidKeyError):
        BlockKey(MODEL, value, 16, HASH)


@pytest.mark.parametrize("value", HOSTILE + NOT_STR)
def test_key_space_rejects_hostile_ids(value):
    with pytest.raises(InvalidKeyError):
        KeySpace(value, LAYOUT.layout_id, 16)
    with pytest.raises(InvalidKeyError):
        KeySpace(MODEL, value, 16)


def test_invalid_key_error_is_a_storage_error():
    with pytest.raises(StorageError):
        BlockKey("../x", LAYOUT.layout_id, 16, HASH)


@pytest.mark.parametrize("digest", [b"", HASH[:15], HASH + b"\x00", HASH.hex(), bytearray(HASH),
                                    None])
def test_block_key_rejects_bad_hash(digest):
    with pytest.raises(InvalidKeyError):
        BlockKey(MODEL, LAYOUT.layout_id, 16, digest)


@pytest.mark.parametrize("size", [0, -1, (1 << 20) + 1, "16", 16.0, None])
def test_block_key_rejects_bad_block_size(size):
    with pytest.raises(InvalidKeyError):
        BlockKey(MODEL, LAYOUT.layout_id, size, HASH)


@pytest.mark.parametrize("size", [1, 64, 1 << 20])
def test_block_key_accepts_block_sizes_in_range(size):
    assert BlockKey(MODEL, LAYOUT.layout_id, size, HASH).block_size == size


def test_key_space_key_validates_hash():
    with pytest.raises(InvalidKeyError):
        SPACE.key(b"short", None)


@pytest.mark.parametrize("size", [0, -1])
def test_key_space_rejects_bad_block_size(size):
    with pytest.raises(InvalidKeyError):
        KeySpace(MODEL, LAYOUT.layout_id, size).keys(TOKENS)
