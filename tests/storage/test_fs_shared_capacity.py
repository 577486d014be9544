"""The fs store's capacity when many processes write one root: the cap, prefix closure, LRU."""

import errno
import fcntl
import multiprocessing
import os
import threading
from pathlib import Path

import pytest

from dualpath.kv.hashing import KeySpace
from dualpath.kv.layout import KVLayout
from dualpath.storage import fs_capacity, lock_file
from dualpath.storage.block_file import HEADER_BYTES, unpack_header
from dualpath.storage.fs import FsStore

SMALL = KVLayout(4, 2, 8, "float16", 16)  # 4096-byte full blocks
FILE_BYTES = HEADER_BYTES + SMALL.full_block_bytes
CAP_BLOCKS = 6
WRITERS = 2
ROUNDS = 4


def _keys(count: int, salt: int):
    tokens = [salt * 7919 + i for i in range(SMALL.block_size * count)]
    return KeySpace("m", SMALL.layout_id, SMALL.block_size).keys(tokens)


def _payloads(count: int) -> list[bytearray]:
    return [bytearray(os.urandom(SMALL.full_block_bytes)) for _ in range(count)]


def _empty(count: int) -> list[bytearray]:
    return [bytearray(SMALL.full_block_bytes) for _ in range(count)]


def _blocks(root: Path) -> dict[bytes, bytes | None]:
    """Every block file under ``root``: its hash and the parent hash in its header."""
    found = {}
    for path in root.rglob("*.kvb"):
        if path.name.startswith("."):
            continue
        with path.open("rb") as f:
            found[bytes.fromhex(path.stem)] = unpack_header(f.read(HEADER_BYTES)).parent
    return found


def _orphans(root: Path) -> list[bytes]:
    """Blocks kept while their parent is gone."""
    blocks = _blocks(root)
    return [h for h, parent in blocks.items() if parent is not None and parent not in blocks]


def _stored(store: FsStore, keys) -> list[bool]:
    """Which blocks have a file (without touching them, unlike ``exists_prefix``)."""
    return [store.path_for(k).is_file() for k in keys]


def _chain(writer: int, round_: int):
    """The 2-block chain of ``writer`` in ``round_``: its first block is written by ``writer``,
    the second (the child) by the other writer process."""
    return _keys(2, salt=100 + 10 * round_ + writer)


def _write_rounds(root: str, writer: int, lock: str, barrier, evicted) -> None:
    """One writer process: each round, the first block of its chain, then the child of the
    other writer's, one block per put like ``StorageClient``; ``evicted[writer]`` gets the
    blocks its own eviction passes removed."""
    with FsStore(root, SMALL, workers=1, capacity_bytes=CAP_BLOCKS * FILE_BYTES,
                 lock=lock) as store:
        for round_ in range(ROUNDS):
            barrier.wait(timeout=60)  # the round starts
            if store.put_from(_chain(writer, round_)[:1], _payloads(1)) != [True]:
                raise SystemExit(3)
            barrier.wait(timeout=60)  # every first block is down
            if store.put_from(_chain(1 - writer, round_)[1:], _payloads(1)) != [True]:
                raise SystemExit(4)
            barrier.wait(timeout=60)  # quiet: the main process checks and reads
        evicted[writer] = store.stats["blocks_evicted"]


@pytest.mark.parametrize("lock", ["flock", "excl"])
def test_two_writer_processes_keep_the_cap_prefix_closure_and_the_used_chain(tmp_path, lock):
    root = tmp_path / "store"
    hot, old = _keys(2, salt=1), _keys(2, salt=2)
    store = FsStore(root, SMALL, capacity_bytes=CAP_BLOCKS * FILE_BYTES, lock=lock)
    store.put_from(hot, _payloads(2))
    store.put_from(old, _payloads(2))  # newer than hot ...
    assert store.get_into(hot, _empty(2)) == [True, True]  # ... until hot is read
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(WRITERS + 1)
    evicted = ctx.Array("i", WRITERS)
    procs = [ctx.Process(target=_write_rounds, args=(str(root), w, lock, barrier, evicted))
             for w in range(WRITERS)]
    for proc in procs:
        proc.start()
    try:
        for round_ in range(ROUNDS):
            barrier.wait(timeout=60)  # start
            barrier.wait(timeout=60)  # first blocks down
            barrier.wait(timeout=60)  # children down; every writer's pass is over
            blocks = _blocks(root)
            assert len(blocks) <= CAP_BLOCKS, f"round {round_}: {len(blocks)} blocks"
            assert _orphans(root) == [], f"round {round_}"
            assert _stored(store, hot) == [True, True], f"round {round_}: the read chain went"
            assert _stored(store, old) == [False, False], f"round {round_}: the old chain stayed"
            for writer in range(WRITERS):  # this round's chains are whole: newest of all
                assert _stored(store, _chain(writer, round_)) == [True, True]
            assert store.get_into(hot, _empty(2)) == [True, True]  # a use, from this process
    except BaseException:
        barrier.abort()  # the writers stop waiting for this process
        raise
    finally:
        for proc in procs:
            proc.join(timeout=60)
        store.close()
    assert [proc.exitcode for proc in procs] == [0] * WRITERS
    # the writers' passes removed all that is not left: which writer ran a pass is the race of
    # the store-wide lock (one writer's passes did all of it in one run), not the rule
    written = 4 + WRITERS * ROUNDS * 2
    assert sum(evicted) == written - len(_blocks(root)), list(evicted)
    assert len(_blocks(root)) <= CAP_BLOCKS + WRITERS
    assert _orphans(root) == []
    assert store.exists_prefix(hot) == 2
    for writer in range(WRITERS):  # round 0's chains are older than the last read of hot
        assert _stored(store, _chain(writer, 0)) == [False, False]
    assert not list(root.rglob(".*.tmp")) and not list(root.rglob("*.held"))


def _extend(root: str, prefix_salt: int, ready, go) -> None:
    """A second process, open before the first writes: extends the first's chain by 3."""
    with FsStore(root, SMALL, workers=1, capacity_bytes=CAP_BLOCKS * FILE_BYTES) as store:
        ready.set()
        go.wait(timeout=60)
        for key in _keys(5, salt=prefix_salt):  # 2 blocks the first process wrote, then 3
            if store.put_from([key], _payloads(1)) != [True]:
                raise SystemExit(3)


def test_a_chain_continued_by_another_process_is_not_evicted_as_orphans(tmp_path):
    """The reported bug: each process knew only its own blocks, so a chain continued by another
    process looked orphaned there, and usage reached the cap of every process together."""
    root = tmp_path / "store"
    ctx = multiprocessing.get_context("spawn")
    ready, go = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_extend, args=(str(root), 3, ready, go))
    proc.start()
    with FsStore(root, SMALL, capacity_bytes=CAP_BLOCKS * FILE_BYTES) as store:
        assert ready.wait(timeout=60)
        shared, old = _keys(5, salt=3), _keys(2, salt=4)
        store.put_from(old, _payloads(2))
        store.put_from(shared[:2], _payloads(2))
        go.set()
        proc.join(timeout=60)
        assert proc.exitcode == 0
        assert len(_blocks(root)) == CAP_BLOCKS  # 7 written, the cap is 6
        assert _stored(store, shared) == [True] * 5  # the newest chain, whole
        assert _stored(store, old) == [True, False]  # the oldest leaf went
        assert _orphans(root) == []


# -- one process -----------------------------------------------------------------------------


@pytest.mark.parametrize("use", ["get_into", "exists_prefix", "put_from"])
def test_a_use_makes_a_chain_survive_a_newer_one(tmp_path, use):
    first, second, third = _keys(2, salt=1), _keys(2, salt=2), _keys(2, salt=3)
    with FsStore(tmp_path, SMALL, capacity_bytes=4 * FILE_BYTES) as store:
        store.put_from(first, _payloads(2))
        store.put_from(second, _payloads(2))
        if use == "get_into":
            assert store.get_into(first, _empty(2)) == [True, True]
        elif use == "exists_prefix":
            assert store.exists_prefix(first) == 2
        else:
            assert store.put_from(first, _payloads(2)) == [True, True]  # skipped: stored
            assert store.stats["writes_skipped"] == 2
        store.put_from(third, _payloads(2))
        assert store.stats["blocks_evicted"] == 2
        assert _stored(store, first) == [True, True]
        assert _stored(store, second) == [False, False]
        assert _stored(store, third) == [True, True]


def test_without_a_use_the_oldest_chain_goes(tmp_path):
    first, second, third = _keys(2, salt=1), _keys(2, salt=2), _keys(2, salt=3)
    with FsStore(tmp_path, SMALL, capacity_bytes=4 * FILE_BYTES) as store:
        for chain in (first, second, third):
            store.put_from(chain, _payloads(2))
        assert _stored(store, first) == [False, False]
        assert _stored(store, second) + _stored(store, third) == [True] * 4


def test_a_miss_stops_exists_prefix_at_an_evicted_parent(tmp_path):
    keys = _keys(3, salt=1)
    with FsStore(tmp_path, SMALL) as store:
        store.put_from(keys, _payloads(3))
        store.path_for(keys[1]).unlink()  # as a pass would, had a child landed after its scan
        assert store.exists_prefix(keys) == 1
        assert store.get_into(keys, _empty(3)) == [True, False, True]


def test_the_directory_is_the_truth_not_the_ledger(tmp_path):
    """Blocks written past the ledger (an uncapped writer, a crashed one) are found by the
    pass that a stale ledger triggers: one per half a capacity written."""
    with FsStore(tmp_path, SMALL) as uncapped, \
            FsStore(tmp_path, SMALL, capacity_bytes=10 * FILE_BYTES) as capped:
        uncapped.put_from(_keys(3, salt=1), _payloads(3))
        capped.put_from(_keys(1, salt=2), _payloads(1))  # a new ledger: a pass measures 4
        assert capped.capacity is not None and capped.capacity.passes == 1
        uncapped.put_from(_keys(8, salt=3), _payloads(8))  # 12 blocks; the ledger says 4
        for salt in range(10, 14):
            capped.put_from(_keys(1, salt=salt), _payloads(1))  # the ledger: 5 .. 8 of 10
        assert len(_blocks(tmp_path)) == 16 and capped.capacity.passes == 1
        capped.put_from(_keys(1, salt=20), _payloads(1))  # 5 blocks since the last pass
        assert capped.capacity.passes == 2
        assert len(_blocks(tmp_path)) == 10
        assert capped.capacity.ledger.read().total_bytes == 10 * FILE_BYTES
        assert _orphans(tmp_path) == []


def test_every_writer_counts_the_others_writes(tmp_path):
    """Two writers of one root (two processes, or as here two stores): each one's writes
    count against the cap the other enforces, with no pass per write."""
    cap = 10
    first = FsStore(tmp_path, SMALL, capacity_bytes=cap * FILE_BYTES)
    second = FsStore(tmp_path, SMALL, capacity_bytes=cap * FILE_BYTES)
    with first, second:
        writes = [first] * 1 + [second] * 6 + [first] * 8 + [second] * 3
        for salt, store in enumerate(writes):
            store.put_from(_keys(1, salt=salt), _payloads(1))
            assert len(_blocks(tmp_path)) <= cap, f"after write {salt}"
        assert first.capacity is not None and second.capacity is not None
        assert first.capacity.passes + second.capacity.passes <= 10


def test_passes_are_rare_in_a_large_store(tmp_path):
    cap_blocks = 1000
    chains = [_keys(2, salt=salt) for salt in range(600)]
    with FsStore(tmp_path, SMALL, workers=1, capacity_bytes=cap_blocks * FILE_BYTES) as store:
        for chain in chains:
            for key in chain:  # one block per put, as StorageClient writes
                store.put_from([key], _payloads(1))
        assert store.capacity is not None
        assert store.capacity.passes <= 10, store.capacity.passes  # not one per write
        assert store.capacity.passes >= 4  # the cap was crossed 1,200 - 1,000 = 200 blocks
        blocks = _blocks(tmp_path)
        assert 950 <= len(blocks) <= cap_blocks  # a large store evicts to 95%: passes stay rare
        assert _orphans(tmp_path) == []
        assert all(_stored(store, chain) == [True, True] for chain in chains[-400:])


def test_deletes_and_corrupt_blocks_leave_the_ledger(tmp_path):
    keys = _keys(4, salt=1)
    with FsStore(tmp_path, SMALL, capacity_bytes=10 * FILE_BYTES) as store:
        store.put_from(keys, _payloads(4))
        assert store.capacity is not None
        assert store.capacity.ledger.read().total_bytes == 4 * FILE_BYTES
        store.delete(keys[3:])
        with store.path_for(keys[2]).open("r+b") as f:
            f.write(b"XXXX")  # a bad header: the read removes it
        assert store.get_into(keys[2:3], _empty(1)) == [False]
        assert store.capacity.ledger.read().total_bytes == 2 * FILE_BYTES


# -- the lock --------------------------------------------------------------------------------


def test_a_refused_flock_falls_back_to_lock_files(tmp_path, monkeypatch):
    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    with FsStore(tmp_path, SMALL, capacity_bytes=2 * FILE_BYTES) as store:
        store.put_from(_keys(3, salt=1), _payloads(3))
        assert store.stats["blocks_evicted"] == 1
        assert store.capacity is not None
        assert store.capacity.evict_lock.mode == "excl"
    assert not list(tmp_path.rglob("*.held"))


def test_a_stale_lock_file_is_broken(tmp_path, monkeypatch):
    monkeypatch.setattr(lock_file, "STALE_LOCK_S", 0.05)
    (tmp_path / ".evict.lock.held").write_bytes(b"a writer that died")
    with FsStore(tmp_path, SMALL, capacity_bytes=2 * FILE_BYTES, lock="excl") as store:
        store.put_from(_keys(3, salt=1), _payloads(3))
        assert store.stats["blocks_evicted"] == 1
    assert not list(tmp_path.rglob("*.held")) and not list(tmp_path.rglob("*.stale.*"))


def test_a_writer_over_the_cap_waits_for_another_pass(tmp_path):
    """While another process holds the eviction lock, a writer that went over the cap waits
    for it (then measures again) rather than writing on past the cap."""
    with FsStore(tmp_path, SMALL, capacity_bytes=2 * FILE_BYTES) as store:
        store.put_from(_keys(2, salt=1), _payloads(2))
        other = lock_file.LockFile(tmp_path / fs_capacity.EVICT_LOCK_NAME)
        assert other.acquire(1.0)
        writer = threading.Thread(target=store.put_from, args=(_keys(1, salt=2), _payloads(1)))
        writer.start()
        writer.join(timeout=0.3)
        assert writer.is_alive()  # waiting for the pass of the lock's holder
        other.release()
        writer.join(timeout=30)
        assert not writer.is_alive()
        assert len(_blocks(tmp_path)) == 2


def test_a_held_lock_file_excludes_another_holder(tmp_path):
    first = lock_file.LockFile(tmp_path / ".x.lock", "excl")
    second = lock_file.LockFile(tmp_path / ".x.lock", "excl")
    assert first.acquire(1.0)
    assert not second.acquire(0.05)
    first.release()
    assert second.acquire(1.0)
    second.release()
