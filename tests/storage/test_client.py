"""The node storage client: read queue in tokens, NIC caps, counters; the token bucket."""

from __future__ import annotations

import errno
import itertools
import threading
import time

import pytest

from dualpath.config import StorageConfig
from dualpath.kv.hashing import KeySpace
from dualpath.kv.host_pool import HostPool
from dualpath.kv.layout import KVLayout
from dualpath.storage.base import StorageBackend
from dualpath.storage.client import BURST_BLOCKS, StorageClient
from dualpath.storage.fs import FsStore
from dualpath.storage.memory import MemoryStore
from dualpath.traffic.token_bucket import TokenBucket

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
    # counted at submission: only the burst and what a slow first sample let through are gone
    assert queue[0] >= (NUM_BLOCKS - BURST_BLOCKS - 8) * 64
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


# -- faults: deadlines, errors -------------------------------------------------------------------

BLOCK = 4096
TOKENS = 16  # tokens per block


class FakeStore(StorageBackend):
    """A store whose blocks named in ``slow`` block until ``release`` is set, and whose calls
    raise ``error`` when it is set."""

    def __init__(self, slow: set[int] = frozenset(), error: Exception | None = None) -> None:
        super().__init__(BLOCK)
        self.slow = slow
        self.error = error
        self.release = threading.Event()
        self.started: list[int] = []  # block indexes whose read began
        self.finished: list[int] = []

    def exists_prefix(self, keys):
        if self.error is not None:
            raise self.error
        return len(keys)

    def get_into(self, keys, buffers):
        if self.error is not None:
            raise self.error
        index = _INDEX[keys[0]]
        self.started.append(index)
        if index in self.slow:
            assert self.release.wait(timeout=30)
        memoryview(buffers[0])[:] = bytes([index + 1]) * BLOCK
        self.finished.append(index)
        return [True]

    def put_from(self, keys, buffers):
        if self.error is not None:
            raise self.error
        if _INDEX[keys[0]] in self.slow:
            assert self.release.wait(timeout=30)
        return [True] * len(keys)

    def delete(self, keys):
        return 0


_KEYS = KeySpace("fault-test", "l", TOKENS).keys(list(range(TOKENS * 8)))
_INDEX = {key: i for i, key in enumerate(_KEYS)}


def _buffers(count: int) -> list[bytearray]:
    return [bytearray(BLOCK) for _ in range(count)]


def test_a_read_resolves_by_its_deadline_and_skips_what_has_not_started():
    store = FakeStore(slow={2, 3})
    client = StorageClient(store, TOKENS, StorageConfig(workers=2, read_deadline_s=0.3))
    buffers = _buffers(5)
    start = time.monotonic()
    future = client.submit_read(_KEYS[:5], buffers)
    result = future.result(timeout=5)  # blocks 2 and 3 hold both workers; 4 waits behind them
    elapsed = time.monotonic() - start
    assert result == [True, True, False, False, False]
    assert 0.3 <= elapsed < 1.5, elapsed
    assert not future.io_done.done()  # blocks 2 and 3 are still being read into their buffers
    assert client.read_queue_tokens == 2 * TOKENS  # block 4's tokens went at the deadline
    store.release.set()
    assert future.io_done.result(timeout=5) is None
    assert client.read_queue_tokens == 0
    assert sorted(store.started) == [0, 1, 2, 3]  # block 4 never started: after the deadline
    assert buffers[4] == bytearray(BLOCK)  # ... so nothing was written into its buffer
    assert future.result() == [True, True, False, False, False]  # late blocks stay misses
    metrics = client.metrics()
    assert metrics["read_deadline_misses"] == 3
    assert metrics["snic_read_bytes"] == 4 * BLOCK  # what did move, late or not
    client.close()


def test_a_read_in_time_reports_with_its_io_done():
    client = StorageClient(FakeStore(), TOKENS, StorageConfig(read_deadline_s=5.0))
    buffers = _buffers(3)
    future = client.submit_read(_KEYS[:3], buffers)
    assert not future.cancel()  # reads under way cannot be called off
    assert future.result(timeout=5) == [True, True, True]
    assert future.io_done.result(timeout=5) is None
    assert [bytes(b) for b in buffers] == [bytes([i + 1]) * BLOCK for i in range(3)]
    assert client.read_queue_tokens == 0
    assert client.metrics()["read_deadline_misses"] == 0
    client.close()


def test_without_a_deadline_a_read_waits_for_the_store():
    store = FakeStore(slow={0})
    client = StorageClient(store, TOKENS, StorageConfig(read_deadline_s=None))
    future = client.submit_read(_KEYS[:2], _buffers(2))
    time.sleep(0.3)  # a slow store, not a stand-in for work
    assert not future.done()
    store.release.set()
    assert future.result(timeout=5) == [True, True]
    client.close()


def test_a_capped_nic_that_would_start_a_block_after_the_deadline_skips_it():
    # 8 blocks of 4 KiB at 0.02 MB/s: one block every 0.2 s, so a 0.5 s deadline reads 3
    store = FakeStore()
    client = StorageClient(store, TOKENS, StorageConfig(workers=1, read_cap_mb_s=0.02,
                                                        read_deadline_s=0.5))
    future = client.submit_read(_KEYS[:8], _buffers(8))
    result = future.result(timeout=5)
    future.io_done.result(timeout=5)
    assert result[:2] == [True, True] and not any(result[4:])
    assert len(store.started) == sum(result)
    assert client.read_queue_tokens == 0
    client.close()


ERRORS = [OSError(errno.EIO, "I/O error"), ConnectionError("store down"),
          PermissionError(errno.EACCES, "Permission denied"),
          OSError(errno.ENOSPC, "No space left on device"), RuntimeError("backend bug")]


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_backend_errors_are_misses_and_dropped_writes(error):
    client = StorageClient(FakeStore(error=error), TOKENS, StorageConfig(workers=2))
    future = client.submit_read(_KEYS[:3], _buffers(3))
    assert future.result(timeout=5) == [False, False, False]
    assert future.io_done.result(timeout=5) is None
    assert client.write(_KEYS[:2], _buffers(2)) == [False, False]
    assert client.exists_prefix(_KEYS[:3]) == 0
    metrics = client.metrics()
    assert (metrics["read_errors"], metrics["write_errors"], metrics["lookup_errors"]) == (3, 2, 1)
    assert client.read_queue_tokens == 0 and client.write_queue_tokens == 0
    assert metrics["snic_read_bytes"] == 0 and metrics["snic_write_bytes"] == 0
    client.close()


def _chmod_is_enforced(folder) -> bool:
    """False when this process may write into a read-only folder anyway (root)."""
    probe = folder / "probe"
    try:
        probe.write_bytes(b"")
    except PermissionError:
        return True
    probe.unlink()
    return False


def test_writes_to_a_read_only_store_are_counted_not_raised(tmp_path):
    root = tmp_path / "store"
    store = FsStore(root, LAYOUT)
    root.chmod(0o555)
    try:
        if not _chmod_is_enforced(root):  # as root: a store that refuses the same way
            store = FakeStore(error=PermissionError(errno.EACCES, "Permission denied"))
        client = StorageClient(store, 64, StorageConfig(workers=2))
        keys = KeySpace("ro", LAYOUT.layout_id, 64).keys(list(range(64 * 3)))
        buffers = [bytearray(store.block_bytes) for _ in keys]
        assert client.write(keys, buffers) == [False, False, False]
        futures = [client.submit_write([k], [b]) for k, b in zip(keys, buffers, strict=True)]
        assert [f.result(timeout=30) for f in futures] == [[False]] * 3
        assert client.metrics()["write_errors"] == 6
        assert client.write_queue_tokens == 0
        assert client.read(keys, buffers) == [False, False, False]  # a miss, not an error
        assert client.read_queue_tokens == 0
        client.close()
    finally:
        root.chmod(0o755)


def test_writes_the_fs_store_fails_are_counted_once(tmp_path):
    """fs catches its own write failures (here a file where a directory must go, which fails
    even as root) and counts them; the client's metrics report them with its own."""
    keys = KeySpace("ro", LAYOUT.layout_id, 64).keys(list(range(64 * 2)))
    store = FsStore(tmp_path, LAYOUT)
    blocker = store.path_for(keys[0]).parents[2]  # the model/layout/bs64 directory
    blocker.parent.mkdir(parents=True)
    blocker.write_bytes(b"in the way")
    client = StorageClient(store, 64, StorageConfig(workers=2))
    assert client.write(keys, [bytearray(store.block_bytes) for _ in keys]) == [False, False]
    metrics = client.metrics()
    assert metrics["write_errors"] == 2 and metrics["blocks_written"] == 0
    assert client.write_queue_tokens == 0
    client.close()


def test_reads_are_not_queued_behind_stuck_writes():
    store = FakeStore(slow={0})  # its put_from of block 0 hangs
    client = StorageClient(store, TOKENS, StorageConfig(workers=1, read_deadline_s=None))
    stuck = client.submit_write(_KEYS[:1], _buffers(1))
    assert client.submit_read(_KEYS[1:3], _buffers(2)).result(timeout=5) == [True, True]
    store.release.set()
    assert stuck.result(timeout=5) == [True]
    client.close()


def test_read_deadline_must_be_positive():
    with pytest.raises(ValueError, match="read_deadline_s"):
        StorageConfig(read_deadline_s=0)
    assert StorageConfig(read_deadline_s=None).read_deadline_s is None


def test_close_drains_queued_writes_for_its_bound_then_drops_the_rest(blocks):
    """20 blocks at 1.5 MB/s (about 1 s a block) would take 20 s: close lets the writes whose
    turn comes inside its 1 s drain go on (each stored whole), drops the rest (reported False,
    never stored) and returns as soon as none is left."""
    keys, pool, src, dst = blocks
    store = MemoryStore(LAYOUT.full_block_bytes)
    client = StorageClient(store, 64, StorageConfig(write_cap_mb_s=1.5, workers=4))
    future = client.submit_write(keys[:20], [pool.buffer(s) for s in src[:20]])
    time.sleep(0.5)  # a block or two written before the close
    began = time.monotonic()
    client.close(drain_s=1.0)
    took_s = time.monotonic() - began
    stored = future.result(timeout=0)
    assert took_s < 1.5, took_s  # not the 19 s the queue held
    assert stored[0] and not stored[-1] and stored == sorted(stored, reverse=True)
    num_stored = sum(stored)
    assert num_stored == 2  # the burst's block, and the one whose turn came in the drain
    assert store.exists_prefix(keys[:20]) == num_stored  # a dropped write stored nothing
    reader = StorageClient(store, 64)
    got = reader.read(keys[:num_stored], [pool.buffer(s) for s in dst[:num_stored]])
    assert all(got) and all(bytes(pool.buffer(a)) == bytes(pool.buffer(b))
                            for a, b in zip(src[:num_stored], dst[:num_stored], strict=False))
    reader.close()
