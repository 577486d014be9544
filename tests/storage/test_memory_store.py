"""The memory store: the fs contract without a disk, with payload-only capacity accounting."""

import os
import threading

import pytest

from dualpath.config import StorageConfig
from dualpath.kv.hashing import KeySpace
from dualpath.kv.layout import KVLayout
from dualpath.storage import open_store
from dualpath.storage.memory import MemoryStore

SMALL = KVLayout(4, 2, 8, "float16", 16)  # 4096-byte full blocks
BLOCK = SMALL.full_block_bytes


def _keys(count: int, salt: int = 0):
    tokens = [salt * 7919 + i for i in range(SMALL.block_size * count)]
    return KeySpace("m", SMALL.layout_id, SMALL.block_size).keys(tokens)


def _payloads(count: int) -> list[bytearray]:
    return [bytearray(os.urandom(BLOCK)) for _ in range(count)]


def _empty(count: int) -> list[bytearray]:
    return [bytearray(BLOCK) for _ in range(count)]


def _stored(store, keys) -> list[bool]:
    return [store.exists_prefix([k]) == 1 for k in keys]


def test_open_store_builds_a_memory_store(tmp_path):
    config = StorageConfig(backend="memory", root=str(tmp_path / "unused"), capacity_gb=1e-3)
    with open_store(config, SMALL) as store:
        assert isinstance(store, MemoryStore)
        assert store.block_bytes == BLOCK
        keys = _keys(1)
        store.put_from(keys, _payloads(1))
        assert store.exists_prefix(keys) == 1
    assert not (tmp_path / "unused").exists()  # nothing touches the disk


def test_capacity_counts_payload_bytes_only():
    keys = _keys(4)
    store = MemoryStore(BLOCK, capacity_bytes=3 * BLOCK)
    store.put_from(keys[:3], _payloads(3))
    assert store.stats["blocks_evicted"] == 0
    store.put_from(_keys(1, salt=9), _payloads(1))
    assert store.stats["blocks_evicted"] == 1


def test_eviction_removes_least_recently_used_suffixes_first():
    chain_a, chain_b = _keys(6, salt=1), _keys(6, salt=2)
    data_a = _payloads(6)
    store = MemoryStore(BLOCK, capacity_bytes=8 * BLOCK)
    store.put_from(chain_a, data_a)
    assert store.exists_prefix(chain_a[:2]) == 2  # touches A's prefix
    store.put_from(chain_b, _payloads(6))
    assert store.stats["blocks_evicted"] == 4
    assert _stored(store, chain_a) == [True, True, False, False, False, False]
    assert store.exists_prefix(chain_a) == 2
    assert store.exists_prefix(chain_b) == 6
    out = _empty(2)
    assert store.get_into(chain_a[:2], out) == [True, True]
    assert out == data_a[:2]


def test_get_into_refreshes_recency():
    chain_a, chain_b, chain_c = _keys(2, salt=1), _keys(2, salt=2), _keys(2, salt=3)
    store = MemoryStore(BLOCK, capacity_bytes=4 * BLOCK)
    store.put_from(chain_a, _payloads(2))
    store.put_from(chain_b, _payloads(2))
    assert store.get_into(chain_a, _empty(2)) == [True, True]  # now B is the LRU chain
    store.put_from(chain_c, _payloads(2))
    assert store.exists_prefix(chain_a) == 2
    assert store.exists_prefix(chain_b) == 0
    assert store.exists_prefix(chain_c) == 2


def test_a_skipped_put_refreshes_recency():
    chain_a, chain_b, chain_c = _keys(1, salt=1), _keys(1, salt=2), _keys(1, salt=3)
    store = MemoryStore(BLOCK, capacity_bytes=2 * BLOCK)
    store.put_from(chain_a, _payloads(1))
    store.put_from(chain_b, _payloads(1))
    store.put_from(chain_a, _payloads(1))  # already there: skipped, but used
    store.put_from(chain_c, _payloads(1))
    assert _stored(store, [*chain_a, *chain_b, *chain_c]) == [True, False, True]


def test_delete_frees_capacity():
    keys = _keys(4)
    store = MemoryStore(BLOCK, capacity_bytes=4 * BLOCK)
    store.put_from(keys, _payloads(4))
    assert store.delete(keys[2:]) == 2
    store.put_from(_keys(2, salt=5), _payloads(2))
    assert store.stats["blocks_evicted"] == 0
    assert store.exists_prefix(keys) == 2


def test_no_capacity_keeps_everything():
    keys = _keys(50)
    store = MemoryStore(BLOCK)
    store.put_from(keys, _payloads(50))
    assert store.exists_prefix(keys) == 50
    assert store.stats["blocks_evicted"] == 0


def test_reads_are_copies():
    keys, data = _keys(1), _payloads(1)
    store = MemoryStore(BLOCK)
    store.put_from(keys, data)
    first = _empty(1)
    store.get_into(keys, first)
    first[0][:] = bytes(BLOCK)
    second = _empty(1)
    assert store.get_into(keys, second) == [True]
    assert second == data


def test_concurrent_writers_and_readers():
    chains = [_keys(4, salt=s) for s in range(4)]
    payloads = [_payloads(4) for _ in chains]
    store = MemoryStore(BLOCK)
    barrier = threading.Barrier(8)
    errors: list[str] = []

    def write(i: int) -> None:
        barrier.wait(timeout=30)
        for _ in range(20):
            store.put_from(chains[i], payloads[i])

    def read(i: int) -> None:
        out = _empty(4)
        barrier.wait(timeout=30)
        for _ in range(50):
            found = store.get_into(chains[i], out)
            for ok, got, want in zip(found, out, payloads[i], strict=True):
                if ok and got != want:
                    errors.append(f"chain {i}: wrong data")

    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    threads += [threading.Thread(target=read, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == []
    assert store.stats["blocks_written"] == 16
    assert store.stats["writes_skipped"] == 16 * 19
    assert all(store.exists_prefix(chain) == 4 for chain in chains)


@pytest.mark.parametrize("capacity_blocks", [1, 2, 3])
def test_every_survivor_has_its_prefix_across_many_chains(capacity_blocks):
    store = MemoryStore(BLOCK, capacity_bytes=capacity_blocks * BLOCK)
    chains = [_keys(2, salt=s) for s in range(5)]
    for chain in chains:
        store.put_from(chain, _payloads(2))
    assert sum(sum(_stored(store, chain)) for chain in chains) == capacity_blocks
    for chain in chains:
        stored = _stored(store, chain)
        assert stored == sorted(stored, reverse=True)


def test_an_audit_read_gives_the_key_as_saved_and_counts_nothing():
    store = MemoryStore(BLOCK)
    keys, data = _keys(2), _payloads(2)
    store.put_from(keys, data)
    assert sorted(k.hex for k in store.stored_keys()) == sorted(k.hex for k in keys)
    out = _empty(1)
    found = store.read_block(keys[1], out[0])
    assert out[0] == data[1]
    assert (found.parent, found.token_ids) == (keys[0].block_hash, keys[1].token_ids)
    assert store.read_block(keys[0]).token_ids == keys[0].token_ids
    assert store.read_block(_keys(1, salt=3)[0]) is None
    assert store.stats["hits"] == 0
