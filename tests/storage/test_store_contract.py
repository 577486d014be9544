"""The storage backend contract, checked on every backend through ``open_store``."""

import hashlib
import os
from dataclasses import replace

import numpy as np
import pytest
import torch

from dualpath.config import StorageConfig
from dualpath.errors import StorageError
from dualpath.kv.hashing import KeySpace
from dualpath.kv.host_pool import HostPool
from dualpath.kv.layout import KVLayout
from dualpath.storage import open_store
from dualpath.storage.block_file import HEADER_BYTES

SMALL = KVLayout(4, 2, 8, "float16", 16)  # 4096-byte full blocks
SMOL = KVLayout(30, 3, 64, "bfloat16", 64)  # SmolLM2-135M: 1,474,560-byte full blocks
BACKENDS = ["fs", "memory", "mooncake_store"]


def _keys(layout: KVLayout, count: int, model: str = "m", salt: int = 0):
    tokens = [salt * 7919 + i for i in range(layout.block_size * count)]
    return KeySpace(model, layout.layout_id, layout.block_size).keys(tokens)


def _payloads(layout: KVLayout, count: int) -> list[bytearray]:
    return [bytearray(os.urandom(layout.full_block_bytes)) for _ in range(count)]


def _empty(layout: KVLayout, count: int) -> list[bytearray]:
    return [bytearray(layout.full_block_bytes) for _ in range(count)]


def _open(backend: StorageConfig | str, root, layout: KVLayout = SMALL, **kwargs):
    """A store of the backend's template config at ``root`` (for mooncake_store: objects
    under a key prefix of its own, derived from ``root``)."""
    base = StorageConfig(backend=backend) if isinstance(backend, str) else backend
    prefix = "t" + hashlib.blake2b(str(root).encode(), digest_size=8).hexdigest()
    return open_store(replace(base, root=str(root), mooncake_key_prefix=prefix, **kwargs), layout)


def _capacity_gb(blocks: int, block_cost: int) -> float:
    return (blocks * block_cost + 0.5) / 1e9  # open_store truncates GB * 1e9 to bytes


def _block_cost(backend: StorageConfig, layout: KVLayout) -> int:
    """Bytes one block counts against capacity (fs files carry a 4 KiB header)."""
    return layout.full_block_bytes + (HEADER_BYTES if backend.backend == "fs" else 0)


def _needs_capacity(backend: StorageConfig) -> None:
    if backend.backend == "mooncake_store":
        pytest.skip("mooncake_store refuses capacity_gb: its capacity is the segment holders' "
                    "memory, evicted by the master (test_mooncake_store.py checks the refusal)")


def _stored(store, keys) -> list[bool]:
    return [store.exists_prefix([k]) == 1 for k in keys]


@pytest.fixture(params=BACKENDS)
def backend(request) -> StorageConfig:
    """The backend under test as a config template (mooncake_store: the session's master)."""
    if request.param == "mooncake_store":
        master = request.getfixturevalue("mooncake_store_master")
        return StorageConfig(backend="mooncake_store", mooncake_master=master)
    return StorageConfig(backend=request.param)


@pytest.fixture
def store(backend, tmp_path):
    with _open(backend, tmp_path / "store") as opened:
        yield opened


def test_open_store_rejects_unknown_backend(tmp_path):
    with pytest.raises(ValueError, match="unknown storage backend"):
        _open("s3", tmp_path)


def test_block_bytes(store):
    assert store.block_bytes == SMALL.full_block_bytes


def test_round_trip(store):
    keys, data = _keys(SMALL, 4), _payloads(SMALL, 4)
    assert store.put_from(keys, data) == [True] * 4
    out = _empty(SMALL, 4)
    assert store.get_into(keys, out) == [True] * 4
    assert out == data
    stats = store.stats.snapshot()
    assert stats["blocks_written"] == 4 and stats["bytes_written"] == 4 * 4096
    assert stats["hits"] == 4 and stats["bytes_read"] == 4 * 4096
    assert stats["misses"] == 0 and stats["corrupt"] == 0


def test_single_block_round_trip(store):
    keys, data = _keys(SMALL, 1), _payloads(SMALL, 1)
    assert store.put_from(keys, data) == [True]
    out = _empty(SMALL, 1)
    assert store.get_into(keys, out) == [True]
    assert out == data


def test_buffers_of_every_kind(store):
    keys, data = _keys(SMALL, 3), _payloads(SMALL, 3)
    sources = [np.frombuffer(bytes(data[0]), dtype=np.uint8),
               torch.tensor(list(data[1]), dtype=torch.uint8),
               memoryview(bytes(data[2]))]
    assert store.put_from(keys, sources) == [True] * 3
    pool = HostPool(SMALL.full_block_bytes, 3, pin=False)
    slots = pool.alloc(3)
    targets = [pool.buffer(slots[0]), pool.tensor(slots[1]),
               np.zeros(SMALL.full_block_bytes // 4, dtype=np.float32)]
    assert store.get_into(keys, targets) == [True] * 3
    assert bytes(pool.buffer(slots[0])) == data[0]
    assert bytes(pool.buffer(slots[1])) == data[1]
    assert targets[2].tobytes() == data[2]


def test_layers_of_a_full_block_read_back(store):
    layers = [os.urandom(SMALL.layer_block_bytes) for _ in range(SMALL.num_layers)]
    full = bytearray(SMALL.full_block_bytes)
    for i, layer in enumerate(layers):
        SMALL.layer_view(memoryview(full), i)[:] = layer
    keys = _keys(SMALL, 1)
    store.put_from(keys, [full])
    out = bytearray(SMALL.full_block_bytes)
    assert store.get_into(keys, [out]) == [True]
    for i, layer in enumerate(layers):
        assert SMALL.layer_view(memoryview(out), i) == layer


def test_smollm2_sized_blocks(backend, tmp_path):
    keys, data = _keys(SMOL, 3), _payloads(SMOL, 3)
    with _open(backend, tmp_path / "store", SMOL) as store:
        assert store.block_bytes == 1_474_560
        assert store.put_from(keys, data) == [True] * 3
        assert store.exists_prefix(keys) == 3
        pool = HostPool(SMOL.full_block_bytes, 3, pin=False)
        slots = pool.alloc(3)
        assert store.get_into(keys, [pool.buffer(s) for s in slots]) == [True] * 3
        for slot, payload in zip(slots, data, strict=True):
            full = pool.buffer(slot)
            assert full == payload
            for i in (0, 17, 29):
                start = SMOL.layer_offset(i)
                assert SMOL.layer_view(full, i) == payload[start : start + 49_152]


def test_exists_prefix_stops_at_first_gap(store):
    keys, data = _keys(SMALL, 6), _payloads(SMALL, 6)
    picked = [0, 1, 2, 4]
    store.put_from([keys[i] for i in picked], [data[i] for i in picked])
    assert store.exists_prefix(keys) == 3
    assert store.exists_prefix(keys[:2]) == 2
    assert store.exists_prefix(keys[3:]) == 0
    assert store.exists_prefix(keys[4:]) == 1


def test_exists_prefix_of_nothing(store):
    assert store.exists_prefix([]) == 0
    assert store.exists_prefix(_keys(SMALL, 3)) == 0


def test_keys_of_another_model_or_layout_are_absent(store):
    keys = _keys(SMALL, 2)
    store.put_from(keys, _payloads(SMALL, 2))
    assert store.exists_prefix(_keys(SMALL, 2, model="other")) == 0
    other_layout = KVLayout(4, 2, 8, "bfloat16", 16)
    assert store.exists_prefix(_keys(other_layout, 2)) == 0


def test_delete(store):
    keys = _keys(SMALL, 4)
    store.put_from(keys, _payloads(SMALL, 4))
    assert store.delete([keys[2], keys[3], _keys(SMALL, 1, salt=9)[0]]) == 2
    assert store.stats["blocks_deleted"] == 2
    assert store.exists_prefix(keys) == 2
    assert store.delete([keys[2]]) == 0
    assert store.delete([]) == 0
    assert store.delete([keys[0]]) == 1
    assert store.exists_prefix(keys) == 0
    assert store.get_into([keys[0]], _empty(SMALL, 1)) == [False]


def test_missing_block_is_a_miss_and_the_rest_still_read(store):
    keys, data = _keys(SMALL, 3), _payloads(SMALL, 3)
    store.put_from([keys[0], keys[2]], [data[0], data[2]])
    out = _empty(SMALL, 3)
    assert store.get_into(keys, out) == [True, False, True]
    assert (out[0], out[2]) == (data[0], data[2])
    assert store.stats["misses"] == 1
    assert store.stats["hits"] == 2
    assert store.stats["corrupt"] == 0


def test_get_nothing(store):
    assert store.get_into([], []) == []
    assert store.put_from([], []) == []


@pytest.mark.parametrize("op", ["put_from", "get_into"])
def test_mismatched_batch_lengths(store, op):
    keys = _keys(SMALL, 2)
    with pytest.raises(StorageError, match="2 keys but 1 buffers"):
        getattr(store, op)(keys, _empty(SMALL, 1))
    with pytest.raises(StorageError):
        getattr(store, op)(keys[:1], _empty(SMALL, 2))


@pytest.mark.parametrize("op", ["put_from", "get_into"])
@pytest.mark.parametrize("size", [0, 4095, 4097, 8192])
def test_wrong_buffer_size(store, op, size):
    keys = _keys(SMALL, 2)
    with pytest.raises(StorageError, match="a block is 4096"):
        getattr(store, op)(keys, [bytearray(4096), bytearray(size)])
    assert store.exists_prefix(keys) == 0


@pytest.mark.parametrize("op", ["put_from", "get_into"])
def test_non_key_is_refused(store, op):
    with pytest.raises(StorageError):
        getattr(store, op)(["not-a-key"], _empty(SMALL, 1))


def test_put_of_a_stored_key_is_skipped(store):
    keys = _keys(SMALL, 2)
    first, second = _payloads(SMALL, 2)
    assert store.put_from(keys[:1], [first]) == [True]
    assert store.put_from(keys, [second, second]) == [True, True]
    assert store.stats["writes_skipped"] == 1
    assert store.stats["blocks_written"] == 2
    out = _empty(SMALL, 2)
    assert store.get_into(keys, out) == [True, True]
    assert out == [first, second]  # the first write of a key stays


def test_put_copies_the_buffer(store):
    keys, data = _keys(SMALL, 1), _payloads(SMALL, 1)
    expected = bytes(data[0])
    store.put_from(keys, data)
    data[0][:] = bytes(SMALL.full_block_bytes)
    out = _empty(SMALL, 1)
    assert store.get_into(keys, out) == [True]
    assert out[0] == expected


# -- capacity ------------------------------------------------------------------------------------


def test_no_capacity_never_evicts(store):
    keys = _keys(SMALL, 12)
    store.put_from(keys, _payloads(SMALL, 12))
    assert store.exists_prefix(keys) == 12
    assert store.stats["blocks_evicted"] == 0


def test_a_chain_longer_than_capacity_evicts(backend, tmp_path):
    _needs_capacity(backend)
    gb = _capacity_gb(4, _block_cost(backend, SMALL))
    keys = _keys(SMALL, 6)
    with _open(backend, tmp_path / "store", capacity_gb=gb) as store:
        assert store.put_from(keys, _payloads(SMALL, 6)) == [True] * 6
        assert store.stats["blocks_evicted"] == 2
        stored = _stored(store, keys)
        assert sum(stored) == 4
        leading = stored.index(False) if False in stored else len(stored)
        assert store.exists_prefix(keys) == leading


def test_a_chain_longer_than_capacity_stays_prefix_closed(backend, tmp_path):
    _needs_capacity(backend)
    gb = _capacity_gb(4, _block_cost(backend, SMALL))
    keys, data = _keys(SMALL, 6), _payloads(SMALL, 6)
    with _open(backend, tmp_path / "store", capacity_gb=gb, workers=1) as store:
        for key, payload in zip(keys, data, strict=True):
            store.put_from([key], [payload])
        stored = _stored(store, keys)
        assert stored == sorted(stored, reverse=True), stored  # no block after a gap
        assert store.exists_prefix(keys) == sum(stored)


def test_eviction_removes_least_recently_used_suffixes_first(backend, tmp_path):
    _needs_capacity(backend)
    gb = _capacity_gb(8, _block_cost(backend, SMALL))
    chain_a, chain_b = _keys(SMALL, 6, salt=1), _keys(SMALL, 6, salt=2)
    data_a = _payloads(SMALL, 6)
    with _open(backend, tmp_path / "store", capacity_gb=gb) as store:
        store.put_from(chain_a, data_a)
        assert store.stats["blocks_evicted"] == 0
        out = _empty(SMALL, 2)
        assert store.get_into(chain_a[:2], out) == [True, True]  # A's prefix is now recent
        store.put_from(chain_b, _payloads(SMALL, 6))
        assert store.stats["blocks_evicted"] == 4
        assert store.exists_prefix(chain_b) == 6
        stored_a = _stored(store, chain_a)
        assert stored_a == [True, True, False, False, False, False]
        assert store.exists_prefix(chain_a) == sum(stored_a) == 2
        out = _empty(SMALL, 2)
        assert store.get_into(chain_a[:2], out) == [True, True]
        assert out == data_a[:2]


def test_eviction_across_many_chains_stays_prefix_closed(backend, tmp_path):
    _needs_capacity(backend)
    gb = _capacity_gb(5, _block_cost(backend, SMALL))
    chains = [_keys(SMALL, 4, salt=3)] + [_keys(SMALL, 2, salt=salt) for salt in (4, 5, 6)]
    with _open(backend, tmp_path / "store", capacity_gb=gb) as store:
        for chain in chains:
            store.put_from(chain, _payloads(SMALL, len(chain)))
        assert store.stats["blocks_evicted"] == 4 + 6 - 5
        assert store.exists_prefix(chains[-1]) == 2  # the newest chain is whole
        for chain in chains:
            stored = _stored(store, chain)
            assert stored == sorted(stored, reverse=True)
            assert store.exists_prefix(chain) == sum(stored)
        assert sum(sum(_stored(store, chain)) for chain in chains) == 5
