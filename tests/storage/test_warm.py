"""Warm sessions in DRAM (``storage/warm.py``) and the storage client reading them first."""

from __future__ import annotations

import os
import time

from dualpath.config import StorageConfig
from dualpath.kv.hashing import KeySpace
from dualpath.storage.client import StorageClient
from dualpath.storage.memory import MemoryStore
from dualpath.storage.warm import WarmBlocks, WarmTag

BLOCK = 4096
SPACE = KeySpace("m", "l", 4)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def keys(count: int, salt: int = 0):
    return SPACE.keys([salt * 1000 + i for i in range(4 * count)])


def payloads(count: int) -> list[bytearray]:
    return [bytearray(os.urandom(BLOCK)) for _ in range(count)]


def test_a_kept_block_comes_back_whole_even_into_a_scatter_list():
    warm = WarmBlocks(10 * BLOCK, Clock())
    k, data = keys(1), payloads(1)
    assert warm.keep(WarmTag("s"), k, data) == 1
    parts = [bytearray(1000), bytearray(BLOCK - 1000)]
    assert warm.get_into(k[0], [memoryview(p) for p in parts])
    assert bytes(parts[0] + parts[1]) == bytes(data[0])
    assert not warm.get_into(keys(1, salt=9)[0], bytearray(BLOCK))
    assert warm.snapshot()["warm_hits"] == 1 and warm.snapshot()["warm_bytes"] == BLOCK


def test_a_full_budget_drops_the_least_recent_unleased_session_whole():
    clock = Clock()
    warm = WarmBlocks(4 * BLOCK, clock)
    warm.keep(WarmTag("leased", lease_s=60), keys(2, 1), payloads(2))  # the oldest
    warm.keep(WarmTag("old"), keys(1, 2), payloads(1))
    warm.keep(WarmTag("used"), keys(1, 3), payloads(1))
    assert warm.get_into(keys(1, 2)[0], bytearray(BLOCK))  # "old" is used: now the recent one
    warm.keep(WarmTag("new"), keys(1, 4), payloads(1))
    assert not warm.holds(keys(1, 3)[0])  # "used" went: least recent among the unleased
    assert all(warm.holds(k) for k in keys(2, 1)) and warm.holds(keys(1, 2)[0])
    clock.now += 61  # the lease ran out: the leased session is the least recent one now
    warm.keep(WarmTag("newer"), keys(1, 5), payloads(1))
    assert not any(warm.holds(k) for k in keys(2, 1))
    assert warm.snapshot()["warm_sessions_dropped"] == 2


def test_a_shared_block_is_held_once_and_goes_with_its_last_session():
    warm = WarmBlocks(10 * BLOCK, Clock())
    shared = keys(1)
    warm.keep(WarmTag("a"), shared, payloads(1))
    warm.keep(WarmTag("b"), shared, payloads(1))
    assert warm.snapshot()["warm_bytes"] == BLOCK
    assert warm.drop("a") == 0 and warm.holds(shared[0])
    assert warm.drop("b") == 1 and not warm.holds(shared[0])


def test_a_session_larger_than_the_budget_keeps_its_first_blocks():
    warm = WarmBlocks(2 * BLOCK, Clock())
    assert warm.keep(WarmTag("big"), keys(3), payloads(3)) == 2
    assert [warm.holds(k) for k in keys(3)] == [True, True, False]


def test_a_damaged_copy_is_a_miss_and_is_dropped():
    warm = WarmBlocks(10 * BLOCK, Clock())
    k = keys(1)
    warm.keep(WarmTag("s"), k, payloads(1))
    block = warm._blocks[k[0].block_hash]
    block.data = bytes([block.data[0] ^ 1]) + block.data[1:]  # a flipped bit in DRAM
    assert not warm.get_into(k[0], bytearray(BLOCK))
    assert not warm.holds(k[0]) and warm.snapshot()["warm_damaged"] == 1


def client(cap_mb_s: float | None = None, warm_mb: float = 1.0) -> StorageClient:
    config = StorageConfig(backend="memory", read_cap_mb_s=cap_mb_s, read_deadline_s=2.0,
                           warm_session_mb=warm_mb)
    return StorageClient(MemoryStore(BLOCK), 4, config)


def test_a_warm_read_skips_the_storage_nic_and_its_cap():
    c = client(cap_mb_s=0.001)  # a block takes about 4 s past the cap's one-block burst
    k, data = keys(3), payloads(3)
    c.backend.put_from(k, data)
    assert c.warm is not None
    c.warm.keep(WarmTag("s"), k[:1], data[:1])
    out = [bytearray(BLOCK) for _ in k]
    began = time.monotonic()
    assert c.read(k, out) == [True, True, False]  # the burst, then the deadline
    assert out[0] == data[0] and time.monotonic() - began < 3.0
    metrics = c.metrics()
    assert metrics["warm_hits"] == 1 and metrics["snic_read_bytes"] == BLOCK
    c.close()


def test_reads_and_writes_with_a_session_keep_their_blocks_warm():
    c = client()
    k, data = keys(3), payloads(3)
    assert c.submit_write(k[:2], data[:2], keep=WarmTag("s")).result() == [True, True]
    c.backend.put_from(k[2:], data[2:])
    assert c.read(k[2:], [bytearray(BLOCK)]) == [True]  # no session: not kept
    assert c.warm is not None and not c.warm.holds(k[2])
    future = c.submit_read(k[2:], [bytearray(BLOCK)], keep=WarmTag("s"))
    assert future.result() == [True]
    future.io_done.result()
    assert all(c.warm.holds(key) for key in k)
    c.backend.delete(k)  # evicted from the store: the warm copies still serve this node
    out = [bytearray(BLOCK) for _ in k]
    assert c.read(k, out) == [True] * 3 and out == data
    c.close()


def test_a_damaged_warm_copy_is_read_from_the_store_instead():
    c = client()
    k, data = keys(1), payloads(1)
    c.backend.put_from(k, data)
    assert c.warm is not None
    c.warm.keep(WarmTag("s"), k, [bytearray(BLOCK)])  # a wrong copy ...
    c.warm._blocks[k[0].block_hash].digest ^= 1  # ... that its checksum catches
    out = [bytearray(BLOCK)]
    assert c.read(k, out) == [True] and out[0] == data[0]
    assert c.metrics()["warm_damaged"] == 1
    c.close()


def test_warm_off_reads_only_the_store():
    c = client(warm_mb=0)
    assert c.warm is None
    k, data = keys(1), payloads(1)
    c.submit_write(k, data, keep=WarmTag("s")).result()
    assert c.read(k, [bytearray(BLOCK)]) == [True] and "warm_hits" not in c.metrics()
    c.close()


# -- prefetch -----------------------------------------------------------------------------------

def test_a_prefetch_brings_a_chain_into_dram_for_the_next_read():
    c = client()
    k, data = keys(3), payloads(3)
    c.backend.put_from(k, data)
    assert c.prefetch(lambda: k, WarmTag("s"), expires_s=time.monotonic() + 60).result() == 3
    assert c.metrics()["prefetch_blocks_read"] == 3
    out = [bytearray(BLOCK) for _ in k]
    assert c.read(k, out) == [True] * 3 and out == data
    metrics = c.metrics()
    assert metrics["warm_hits"] == 3 and metrics["warm_prefetch_used"] == 1
    c.close()


def test_a_prefetch_waits_while_a_request_reads():
    c = client()
    k, data = keys(2), payloads(2)
    c.backend.put_from(k, data)
    with c._lock:
        c._read.pending_tokens += 4  # a request's read is queued on this node
    future = c.prefetch(lambda: k, WarmTag("s"), expires_s=time.monotonic() + 60)
    time.sleep(0.2)
    assert not future.done() and c.prefetch_blocks_read == 0
    with c._lock:
        c._read.pending_tokens -= 4
    assert future.result(timeout=5) == 2
    c.close()


def test_an_expired_prefetch_reads_nothing_and_an_unused_one_is_dropped_as_wasted():
    clock = Clock()
    config = StorageConfig(backend="memory", warm_session_mb=1.0)
    c = StorageClient(MemoryStore(BLOCK), 4, config, clock=clock)
    k, data = keys(2), payloads(2)
    c.backend.put_from(k, data)
    assert c.prefetch(lambda: k, WarmTag("late"), expires_s=clock.now - 1).result() == 0
    assert c.prefetch(lambda: k, WarmTag("s"), expires_s=clock.now + 10).result() == 2
    clock.now += 11
    assert c.warm is not None and c.warm.expire() == 1
    assert not c.warm.holds(k[0]) and c.warm.take_dropped() == ("s",)
    assert c.metrics()["warm_prefetch_wasted"] == 1
    c.close()


def test_pressure_drops_an_unused_prefetch_before_any_kept_session():
    warm = WarmBlocks(2 * BLOCK, Clock())
    warm.keep(WarmTag("kept"), keys(1, 1), payloads(1))
    warm.keep(WarmTag("fetched"), keys(1, 2), payloads(1), prefetch_until_s=1e9)
    warm.keep(WarmTag("new"), keys(1, 3), payloads(1))  # the prefetch is newer, yet goes
    assert warm.holds(keys(1, 1)[0]) and not warm.holds(keys(1, 2)[0])
    assert warm.snapshot()["warm_prefetch_wasted"] == 1
    assert warm.take_dropped() == ("fetched",) and warm.take_dropped() == ()


def test_a_damaged_stored_block_ends_a_prefetch_and_stays_a_miss(tmp_path):
    from dualpath.kv.layout import KVLayout
    from dualpath.storage.fs import FsStore

    layout = KVLayout(4, 2, 8, "float16", 16)  # 4096-byte blocks
    space = KeySpace("m", layout.layout_id, 16)
    k, data = space.keys(list(range(48))), payloads(3)
    config = StorageConfig(root=str(tmp_path), warm_session_mb=1.0)
    c = StorageClient(FsStore(tmp_path, layout, workers=1), 16, config)
    c.backend.put_from(k, data)
    path = c.backend.path_for(k[1])
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # a flipped bit in the stored payload
    path.write_bytes(bytes(raw))
    assert c.prefetch(lambda: k, WarmTag("s"), expires_s=time.monotonic() + 60).result() == 1
    assert c.warm is not None and c.warm.holds(k[0])
    assert not c.warm.holds(k[1]) and not c.warm.holds(k[2])
    assert c.read(k[1:2], [bytearray(BLOCK)]) == [False]  # removed as damaged: a miss
    c.close()
