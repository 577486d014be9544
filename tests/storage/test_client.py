"""The node storage client: read queue in tokens, NIC caps, counters; the token bucket."""

from __future__ import annotations

import itertools
import time

import pytest

from dualpath.config import StorageConfig
from dualpath.kv.hashing import KeySpace
from dualpath.kv.host_pool import HostPool
from dualpath.kv.layout import KVLayout
from dualpath.storage.client import StorageClient
from dualpath.storage.fs import FsStore
from dualpath.storage.memory import MemoryStore
from dualpath.storage.throttle import TokenBucket

LAYOUT = KVLayout(30, 3, 64, "bfloat16", 64)  # SmolLM2: 1,474,560-byte full blocks
NUM_BLOCKS = 136  # 200.5 MB


@pytest.fixture(scope="module")
def blocks():
    keys = KeySpace("cap-test", LAYOUT.layout_id, 64).keys(list(range(64 * NUM_BLOCKS)))
    pool = HostPool(LAYOUT.full_block_bytes, 2 * NUM_BLOCKS, pin=False)
    pool.slab.random_(0, 256)
    slots = pool.alloc(2 * NUM_BLOCKS)
    return keys, pool, slots[:NUM_BLOCKS], slots[NUM_BLOCKS:]


def test_read_cap_holds_and_read_queue_drains(tmp_path, blocks):
    keys, pool, src, dst = blocks
    store = FsStore(tmp_path, LAYOUT)
    assert all(store.put_from(keys, [pool.buffer(s) for s in src]))
    client = StorageClient(store, 64, StorageConfig(read_cap_mb_s=100))
    start = time.monotonic()
    future = client.submit_read(keys, [pool.buffer(s) for s in dst])
    queue = [client.read_queue_tokens]
    while not future.done():
        queue.append(client.read_queue_tokens)
        time.sleep(0.05)  # sampling the queue, not standing in for work
    elapsed = time.monotonic() - start
    assert all(future.result())
    assert queue[0] >= (NUM_BLOCKS - 2) * 64  # counted at submission (the burst may be done)
    assert all(a >= b for a, b in itertools.pairwise(queue))  # drains monotonically
    assert len(set(queue)) > 5  # and gradually
    assert client.read_queue_tokens == 0
    assert 1.8 <= elapsed <= 2.2, f"200.5 MB at 100 MB/s took {elapsed:.2f} s"
    metrics = client.metrics()
    assert metrics["snic_read_bytes"] == NUM_BLOCKS * LAYOUT.full_block_bytes
    assert metrics["hits"] == NUM_BLOCKS
    assert 0.8 <= metrics["snic_read_utilization"] <= 1.05
    assert all(bytes(pool.buffer(a)) == bytes(pool.buffer(b))
               for a, b in zip(src, dst, strict=True))
    client.close()


def test_write_cap_holds(blocks):
    keys, pool, src, _ = blocks
    client = StorageClient(MemoryStore(LAYOUT.full_block_bytes), 64,
                           StorageConfig(write_cap_mb_s=100))
    start = time.monotonic()
    assert all(client.write(keys[:34], [pool.buffer(s) for s in src[:34]]))  # 50.1 MB
    elapsed = time.monotonic() - start
    assert 0.45 <= elapsed <= 0.56
    assert client.write_queue_tokens == 0
    assert client.metrics()["snic_write_bytes"] == 34 * LAYOUT.full_block_bytes


def test_uncapped_client_reports_no_utilization_and_counts_misses(blocks):
    keys, pool, src, dst = blocks
    client = StorageClient(MemoryStore(LAYOUT.full_block_bytes), 64)
    client.write(keys[:2], [pool.buffer(s) for s in src[:2]])
    assert client.exists_prefix(keys[:5]) == 2
    assert client.read(keys[:3], [pool.buffer(s) for s in dst[:3]]) == [True, True, False]
    metrics = client.metrics()
    assert metrics["snic_read_utilization"] is None
    assert metrics["misses"] == 1 and metrics["snic_read_bytes"] == 2 * LAYOUT.full_block_bytes
    assert client.read([], []) == []


def test_token_bucket_paces_to_rate():
    bucket = TokenBucket(rate_bytes_s=100.0, burst_bytes=50.0)
    assert bucket.reserve(50, now_s=0.0) == 0.0  # the burst goes at once
    assert bucket.reserve(100, now_s=0.0) == pytest.approx(1.0)  # then debt is paid in time
    assert bucket.reserve(100, now_s=0.0) == pytest.approx(2.0)
    assert bucket.reserve(10, now_s=10.0) == 0.0  # refilled, capped at the burst
    assert bucket.reserve(40, now_s=10.0) == 0.0
    assert bucket.reserve(1, now_s=10.0) == pytest.approx(0.01)


def test_token_bucket_long_run_average():
    bucket = TokenBucket(rate_bytes_s=1000.0, burst_bytes=100.0)
    now = 0.0
    for _ in range(100):
        now += bucket.reserve(100, now)  # each transfer starts when its wait ends
    assert now == pytest.approx(9.9)  # 10,000 bytes at 1,000 B/s, first 100 free


def test_token_bucket_rejects_bad_rates():
    with pytest.raises(ValueError):
        TokenBucket(0.0, 10.0)
