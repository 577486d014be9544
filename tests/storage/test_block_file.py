"""The block file format: a 4 KiB header naming key, layout, payload and the block's token ids,
then the payload."""

import os

import pytest

from dualpath.kv.hashing import KeySpace
from dualpath.kv.layout import KVLayout
from dualpath.storage.block_file import (
    HEADER_BYTES,
    MAGIC,
    BadBlockFile,
    BlockHeader,
    check_header,
    checksum,
    key_header,
    max_header_tokens,
    pack_header,
    stored_key,
    unpack_header,
)

LAYOUT = KVLayout(4, 2, 8, "float16", 16)
KEYS = KeySpace("model-a", LAYOUT.layout_id, 16).keys(list(range(16 * 3)))
PAYLOAD = memoryview(os.urandom(LAYOUT.full_block_bytes))


def _header(key=KEYS[1], layout=LAYOUT, payload=PAYLOAD) -> bytes:
    return pack_header(key.name, key.parent, layout, payload, key.token_ids, key.seed_hash)


def test_header_is_exactly_4k():
    assert HEADER_BYTES == 4096
    assert len(_header()) == 4096
    assert len(_header(KEYS[0])) == 4096
    assert _header().startswith(MAGIC)


def test_round_trip():
    header = unpack_header(_header())
    assert header == BlockHeader(
        key_name=KEYS[1].name, parent=KEYS[0].block_hash, num_layers=4, tokens=16,
        bytes_per_token_per_layer=LAYOUT.bytes_per_token_per_layer, dtype="float16",
        payload_bytes=LAYOUT.full_block_bytes, checksum=checksum(PAYLOAD),
        token_ids=tuple(range(16, 32)), seed_hash=KEYS[1].seed_hash)
    check_header(header, KEYS[1].name, LAYOUT)  # no exception


def test_a_block_saved_without_token_ids_holds_none():
    raw = pack_header(KEYS[1].name, KEYS[1].parent, LAYOUT, PAYLOAD)
    assert unpack_header(raw).token_ids is None
    check_header(unpack_header(raw), KEYS[1].name, LAYOUT)


def test_token_ids_that_do_not_fit_or_are_not_uint32_are_left_out():
    room = max_header_tokens(KEYS[1].name)
    assert 900 < room < 1000  # ~950 tokens per block fit in the 4 KiB header
    assert len(unpack_header(pack_header("k", None, LAYOUT, PAYLOAD, range(room))).token_ids
               ) == room
    assert unpack_header(pack_header(KEYS[1].name, None, LAYOUT, PAYLOAD,
                                     range(room + 1))).token_ids is None
    assert unpack_header(pack_header("k", None, LAYOUT, PAYLOAD, [-1] * 16)).token_ids is None
    assert unpack_header(pack_header("k", None, LAYOUT, PAYLOAD, [2**32] * 16)).token_ids is None


@pytest.mark.parametrize("where", ["parent", "token id"])
def test_a_flipped_parent_or_token_id_fails_the_header_checksum(where):
    raw = bytearray(_header())
    name_end = 70 + 12 + len(KEYS[1].name)  # fixed fields, token count and checksum, name
    raw[52 + 3 if where == "parent" else name_end + 5] ^= 0x01  # parent: bytes 52-67
    with pytest.raises(BadBlockFile, match="checksum"):
        unpack_header(raw)


SALTED = KeySpace("model-a", LAYOUT.layout_id, 16).salted("tenant-a").keys(list(range(16 * 2)))


@pytest.mark.parametrize("key", [KEYS[0], KEYS[1], SALTED[0]], ids=["root", "block", "salted"])
def test_a_keys_parent_token_ids_and_seed_hash_round_trip(key):
    header = unpack_header(key_header(key, LAYOUT, PAYLOAD))
    assert header.seed_hash == key.seed_hash is not None
    back = stored_key(KeySpace("model-a", LAYOUT.layout_id, 16).key(key.block_hash, None), header)
    assert (back, back.parent, back.token_ids, back.seed_hash) == (
        key, key.parent, key.token_ids, key.seed_hash)
    assert SALTED[0].seed_hash != KEYS[0].seed_hash


def _seed_trailer_at(key=KEYS[1]) -> int:
    return 70 + 12 + len(key.name) + 4 * len(key.token_ids)  # after the name and the ids


def test_the_seed_hash_lies_where_older_code_wrote_zeros():
    """Older writers left the bytes after the ids zero, and older readers never look there:
    a header with a seed hash differs from one without only in its 28-byte trailer, and one
    without it (an older writer's) reads with seed hash None."""
    with_seed, without = _header(), pack_header(
        KEYS[1].name, KEYS[1].parent, LAYOUT, PAYLOAD, KEYS[1].token_ids)
    at = _seed_trailer_at()
    assert with_seed == key_header(KEYS[1], LAYOUT, PAYLOAD)
    assert with_seed[:at] == without[:at]
    assert with_seed[at + 28 :] == without[at + 28 :] == bytes(HEADER_BYTES - at - 28)
    assert without[at : at + 28] == bytes(28) and with_seed[at : at + 4] == b"SEED"
    assert unpack_header(without).seed_hash is None


@pytest.mark.parametrize("offset", [0, 4, 19, 20, 27], ids=["marker", "hash", "hash end",
                                                              "checksum", "checksum end"])
def test_a_damaged_seed_trailer_is_a_bad_block(offset):
    raw = bytearray(_header())
    raw[_seed_trailer_at() + offset] ^= 0x01
    with pytest.raises(BadBlockFile, match="seed"):
        unpack_header(raw)


def test_check_header_rejects_token_ids_of_another_block_size():
    raw = pack_header(KEYS[1].name, KEYS[1].parent, LAYOUT, PAYLOAD, range(8))
    with pytest.raises(BadBlockFile, match="token ids"):
        check_header(unpack_header(raw), KEYS[1].name, LAYOUT)


def test_first_block_has_no_parent():
    assert unpack_header(_header(KEYS[0])).parent is None


def test_unpack_accepts_a_memoryview_of_a_whole_file():
    raw = memoryview(_header() + bytes(PAYLOAD))
    assert unpack_header(raw).key_name == KEYS[1].name


def test_check_header_rejects_another_key():
    header = unpack_header(_header(KEYS[1]))
    with pytest.raises(BadBlockFile):
        check_header(header, KEYS[2].name, LAYOUT)


def test_check_header_rejects_same_hash_of_another_model():
    other = KeySpace("model-b", LAYOUT.layout_id, 16).key(KEYS[1].block_hash, None)
    with pytest.raises(BadBlockFile):
        check_header(unpack_header(_header()), other.name, LAYOUT)


@pytest.mark.parametrize("other", [
    KVLayout(2, 2, 8, "float32", 16),  # same block bytes, other layer count and dtype
    KVLayout(4, 1, 8, "float32", 16),  # same bytes per token per layer, other dtype
    KVLayout(4, 2, 8, "bfloat16", 16),  # same sizes, other dtype
    KVLayout(4, 2, 8, "float16", 32),
    KVLayout(8, 2, 8, "float16", 16),
])
def test_check_header_rejects_another_layout(other):
    header = unpack_header(_header())
    with pytest.raises(BadBlockFile):
        check_header(header, KEYS[1].name, other)


def test_check_header_rejects_another_payload_size():
    short = memoryview(bytes(LAYOUT.full_block_bytes - 1))
    header = unpack_header(_header(payload=short))
    assert header.payload_bytes == LAYOUT.full_block_bytes - 1
    with pytest.raises(BadBlockFile):
        check_header(header, KEYS[1].name, LAYOUT)


def test_unpack_rejects_short_header():
    with pytest.raises(BadBlockFile):
        unpack_header(_header()[:HEADER_BYTES - 1])


def test_unpack_rejects_bad_magic():
    raw = bytearray(_header())
    raw[:4] = b"XXXX"
    with pytest.raises(BadBlockFile):
        unpack_header(raw)


@pytest.mark.parametrize(("offset", "value"),
                         [(4, b"\x01\x00"), (4, b"\x03\x00"), (6, b"\x00\x08")])
def test_unpack_rejects_other_version_or_header_size(offset, value):
    raw = bytearray(_header())
    raw[offset : offset + 2] = value
    with pytest.raises(BadBlockFile):
        unpack_header(raw)


def test_unpack_rejects_a_zeroed_header():
    with pytest.raises(BadBlockFile):
        unpack_header(bytes(HEADER_BYTES))


@pytest.mark.parametrize("index", [0, 1, 2047, LAYOUT.full_block_bytes - 1])
def test_checksum_changes_when_one_byte_flips(index):
    flipped = bytearray(PAYLOAD)
    flipped[index] ^= 0x01
    assert checksum(memoryview(flipped)) != checksum(PAYLOAD)
    assert checksum(memoryview(bytearray(PAYLOAD))) == checksum(PAYLOAD)
