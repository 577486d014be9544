"""The fs store: verified reads where any damage is a miss, safe paths, atomic writes."""

import errno
import mmap
import multiprocessing
import os
import random
import shutil
import stat
import threading
from pathlib import Path

import pytest

from dualpath.config import StorageConfig
from dualpath.errors import InvalidKeyError
from dualpath.kv.hashing import BlockKey, KeySpace
from dualpath.kv.layout import KVLayout
from dualpath.storage import open_store
from dualpath.storage.block_file import HEADER_BYTES
from dualpath.storage.fs import FsStore

SMALL = KVLayout(4, 2, 8, "float16", 16)  # 4096-byte full blocks
FILE_BYTES = HEADER_BYTES + SMALL.full_block_bytes


def _keys(count: int, layout: KVLayout = SMALL, salt: int = 0, model: str = "m"):
    tokens = [salt * 7919 + i for i in range(layout.block_size * count)]
    return KeySpace(model, layout.layout_id, layout.block_size).keys(tokens)


def _payloads(count: int, nbytes: int = SMALL.full_block_bytes) -> list[bytearray]:
    return [bytearray(os.urandom(nbytes)) for _ in range(count)]


def _empty(count: int) -> list[bytearray]:
    return [bytearray(SMALL.full_block_bytes) for _ in range(count)]


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def _block_files(root: Path) -> list[Path]:
    """Block files only: a capped store also keeps its ledger and lock files in the root."""
    return [p for p in _files(root) if p.suffix == ".kvb" and not p.name.startswith(".")]


def _payload_for(seed: int, round_: int) -> bytes:
    return random.Random(seed * 1000 + round_).randbytes(SMALL.full_block_bytes)


@pytest.fixture
def root(tmp_path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def store(root):
    with FsStore(root, SMALL) as opened:
        yield opened


def test_open_store_builds_an_fs_store(root):
    config = StorageConfig(backend="fs", root=str(root), fsync=True, workers=2)
    with open_store(config, SMALL) as store:
        assert isinstance(store, FsStore)
        assert store.root == root.absolute()
        assert store.fsync is True
        assert store.block_bytes == SMALL.full_block_bytes
    assert root.is_dir()


# -- paths ---------------------------------------------------------------------------------------


def test_files_are_sharded_by_hash(store, root):
    key = _keys(1)[0]
    path = store.path_for(key)
    h = key.hex
    assert path == root / "m" / SMALL.layout_id / "bs16" / h[:2] / h[2:4] / f"{h}.kvb"
    store.put_from([key], _payloads(1))
    assert _files(root) == [path]
    assert path.stat().st_size == FILE_BYTES


def test_files_spread_over_shards(store, root):
    keys = _keys(40)
    store.put_from(keys, _payloads(40))
    shards = {p.parent.parent.name for p in _files(root)}
    assert len(shards) > 10
    for path in _files(root):
        assert path.parent.parent.name == path.stem[:2]
        assert path.parent.name == path.stem[2:4]


HOSTILE = [("model_id", "../../etc"), ("model_id", ".."), ("model_id", "/etc"),
           ("layout_id", "../../.."), ("layout_id", "/tmp"), ("model_id", "."),
           ("layout_id", "../x"), ("layout_id", "a/../../.."), ("block_size", -1),
           ("block_hash", b"\x00"), ("block_hash", b"")]


@pytest.mark.parametrize(("field", "value"), HOSTILE)
def test_a_hostile_key_never_leaves_the_root(store, root, field, value):
    key = _keys(1)[0]
    object.__setattr__(key, field, value)
    try:
        path = store.path_for(key)
    except InvalidKeyError:
        return
    resolved = os.path.normpath(path)
    assert os.path.commonpath([str(root.absolute()), resolved]) == str(root.absolute())


def test_a_key_with_a_string_block_size_is_an_invalid_key(store):
    key = _keys(1)[0]
    object.__setattr__(key, "block_size", "../../../..")
    with pytest.raises(InvalidKeyError):
        store.path_for(key)


def test_an_escaping_key_is_refused_by_every_operation(store, tmp_path):
    key = _keys(1)[0]
    object.__setattr__(key, "model_id", "../../etc")
    with pytest.raises(InvalidKeyError):
        store.path_for(key)
    with pytest.raises(InvalidKeyError):
        store.put_from([key], _payloads(1))
    with pytest.raises(InvalidKeyError):
        store.get_into([key], _empty(1))
    with pytest.raises(InvalidKeyError):
        store.exists_prefix([key])
    with pytest.raises(InvalidKeyError):
        store.delete([key])
    assert not (tmp_path.parent / "etc").exists()
    assert not (tmp_path / "etc").exists()


def test_path_for_refuses_a_non_key(store):
    with pytest.raises(InvalidKeyError):
        store.path_for("m/l/bs16/00")


# -- damaged files -------------------------------------------------------------------------------


def _flip_payload_byte(path: Path) -> None:
    with path.open("r+b") as f:
        f.seek(HEADER_BYTES + 100)
        byte = f.read(1)[0]
        f.seek(HEADER_BYTES + 100)
        f.write(bytes([byte ^ 0xFF]))


def _flip_header_checksum(path: Path) -> None:
    with path.open("r+b") as f:
        f.seek(4 + 2 + 2 + 4 + 4 + 4 + 16 + 8)  # the checksum field
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x01]))


def _truncate(path: Path) -> None:
    os.truncate(path, FILE_BYTES - 1)


def _truncate_to_header(path: Path) -> None:
    os.truncate(path, HEADER_BYTES)


def _empty_file(path: Path) -> None:
    os.truncate(path, 0)


def _extend(path: Path) -> None:
    with path.open("ab") as f:
        f.write(b"\0")


def _bad_magic(path: Path) -> None:
    with path.open("r+b") as f:
        f.write(b"XXXX")


def _zero_header(path: Path) -> None:
    with path.open("r+b") as f:
        f.write(bytes(HEADER_BYTES))


def _version_1(path: Path) -> None:
    with path.open("r+b") as f:
        f.seek(4)
        f.write(b"\x01\x00")


DAMAGE = {"flipped payload byte": _flip_payload_byte, "flipped checksum": _flip_header_checksum,
          "truncated": _truncate, "header only": _truncate_to_header, "empty": _empty_file,
          "bad magic": _bad_magic, "zeroed header": _zero_header, "version 1": _version_1}


@pytest.mark.parametrize("damage", DAMAGE.values(), ids=DAMAGE.keys())
def test_a_damaged_file_is_a_corrupt_miss(store, damage):
    keys, data = _keys(3), _payloads(3)
    store.put_from(keys, data)
    bad = store.path_for(keys[1])
    damage(bad)
    out = _empty(3)
    assert store.get_into(keys, out) == [True, False, True]
    assert (out[0], out[2]) == (data[0], data[2])
    assert store.stats["misses"] == 1
    assert store.stats["corrupt"] == 1
    assert store.stats["hits"] == 2
    assert not bad.exists()
    assert store.exists_prefix(keys) == 1


def test_a_damaged_file_is_rewritten_by_the_next_put(store):
    keys, data = _keys(2), _payloads(2)
    store.put_from(keys, data)
    _flip_payload_byte(store.path_for(keys[1]))
    assert store.get_into(keys, _empty(2)) == [True, False]
    assert store.put_from(keys, data) == [True, True]
    assert store.stats["blocks_written"] == 3
    out = _empty(2)
    assert store.get_into(keys, out) == [True, True]
    assert out == data


def test_trailing_bytes_never_give_wrong_data(store):
    keys, data = _keys(2), _payloads(2)
    store.put_from(keys, data)
    _extend(store.path_for(keys[1]))
    out = _empty(2)
    found = store.get_into(keys, out)
    assert found[0] and out[0] == data[0]
    assert not found[1] or out[1] == data[1]  # a verified block or a miss, never garbage


def test_a_header_of_another_key_is_a_corrupt_miss(store):
    keys, data = _keys(3), _payloads(3)
    store.put_from(keys, data)
    shutil.copyfile(store.path_for(keys[0]), store.path_for(keys[1]))
    out = _empty(3)
    assert store.get_into(keys, out) == [True, False, True]
    assert (out[0], out[2]) == (data[0], data[2])
    assert (store.stats["misses"], store.stats["corrupt"]) == (1, 1)
    assert not store.path_for(keys[1]).exists()
    assert store.path_for(keys[0]).exists()


def test_a_file_copied_under_a_key_never_written_is_a_corrupt_miss(store):
    keys, data = _keys(2), _payloads(1)
    store.put_from(keys[:1], data)
    target = store.path_for(keys[1])
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(store.path_for(keys[0]), target)
    assert store.exists_prefix(keys) == 2  # exists_prefix only looks for the file ...
    assert store.get_into(keys, _empty(2)) == [True, False]  # ... the read verifies it
    assert store.stats["corrupt"] == 1
    assert store.exists_prefix(keys) == 1


def test_a_block_of_another_layout_is_a_corrupt_miss(root):
    other = KVLayout(2, 2, 8, "float32", 16)  # the same block bytes, other layers and dtype
    assert other.full_block_bytes == SMALL.full_block_bytes
    keys, data = _keys(2), _payloads(2)  # keys name SMALL's layout
    with FsStore(root, SMALL) as writer:
        writer.put_from(keys, data)
    with FsStore(root, other) as reader:
        assert reader.get_into(keys, _empty(2)) == [False, False]
        assert (reader.stats["misses"], reader.stats["corrupt"]) == (2, 2)
        assert reader.exists_prefix(keys) == 0
    assert _files(root) == []


def test_a_missing_file_is_a_plain_miss(store):
    keys, data = _keys(3), _payloads(3)
    store.put_from(keys, data)
    store.path_for(keys[2]).unlink()
    out = _empty(3)
    assert store.get_into(keys, out) == [True, True, False]
    assert out[:2] == data[:2]
    assert (store.stats["misses"], store.stats["corrupt"]) == (1, 0)
    assert store.exists_prefix(keys) == 2


def _failing_reads(monkeypatch, call: str, code: int) -> None:
    """Make ``os.open`` of a block file for reading, or every ``os.preadv``, fail with
    ``code``, as a process out of descriptors (EMFILE), memory or a flaky disk (EIO) does."""
    real = getattr(os, call)

    def failing(*args, **kwargs):
        if call == "preadv" or (str(args[0]).endswith(".kvb") and not args[1] & os.O_WRONLY):
            raise OSError(code, os.strerror(code))
        return real(*args, **kwargs)

    monkeypatch.setattr(os, call, failing)


@pytest.mark.parametrize("call", ["open", "preadv"])
@pytest.mark.parametrize("code", [errno.EMFILE, errno.EIO, errno.ENOMEM],
                         ids=errno.errorcode.get)
def test_a_read_error_is_a_miss_that_keeps_the_block(store, monkeypatch, call, code):
    keys, data = _keys(2), _payloads(2)
    store.put_from(keys, data)
    with monkeypatch.context() as patch:
        _failing_reads(patch, call, code)
        assert store.get_into(keys, _empty(2)) == [False, False]
    assert all(store.path_for(k).exists() for k in keys)  # not taken for damage
    out = _empty(2)
    assert store.get_into(keys, out) == [True, True]  # the error has passed: hits
    assert out == data
    assert (store.stats["misses"], store.stats["read_errors"], store.stats["corrupt"]) == (2, 2, 0)


def test_the_client_counts_a_stores_read_errors_apart_from_damage(root, monkeypatch):
    from dualpath.storage.client import StorageClient

    keys, data = _keys(3), _payloads(3)
    with FsStore(root, SMALL) as store:
        store.put_from(keys, data)
        _flip_payload_byte(store.path_for(keys[2]))
        client = StorageClient(store, SMALL.block_size)
        with monkeypatch.context() as patch:
            _failing_reads(patch, "preadv", errno.EIO)
            assert client.read(keys[:2], _empty(2)) == [False, False]
        assert client.read(keys, _empty(3)) == [True, True, False]
        metrics = client.metrics()
        client.close()
    assert (metrics["read_errors"], metrics["corrupt"], metrics["hits"]) == (2, 1, 2)


def _short_reads(monkeypatch, most_bytes: int, stalls: int = 0) -> dict[str, int]:
    """Make every ``os.preadv`` read at most ``most_bytes`` (as FUSE daemons and NFS clients
    may, mid-file), and the first ``stalls`` reads past offset 0 read nothing at all; counts
    the calls."""
    real = os.preadv
    seen = {"calls": 0, "stalled": 0}

    def short(fd, buffers, offset, *args):
        seen["calls"] += 1
        if offset and seen["stalled"] < stalls:
            seen["stalled"] += 1
            return 0
        views, room = [], most_bytes
        for buffer in buffers:
            view = memoryview(buffer).cast("B")[:room]
            room -= view.nbytes
            if view.nbytes:
                views.append(view)
        return real(fd, views, offset, *args)

    monkeypatch.setattr(os, "preadv", short)
    return seen


@pytest.mark.parametrize("o_direct", [False, True], ids=["buffered", "o_direct"])
@pytest.mark.parametrize("stalls", [0, 3], ids=["short", "short-and-stalled"])
def test_short_reads_go_on_and_never_count_as_damage(root, monkeypatch, o_direct, stalls):
    keys, data = _keys(3), _payloads(3)
    with FsStore(root, SMALL, o_direct=o_direct) as store:
        store.put_from(keys, data)
        with monkeypatch.context() as patch:
            seen = _short_reads(patch, 4096 if o_direct else 1000, stalls)  # O_DIRECT: aligned
            out = _aligned_buffers(3)
            assert store.get_into(keys, out) == [True] * 3
            assert [bytes(b) for b in out] == data
            found = store.read_block(keys[1])  # the header alone, short too
            assert found.parent == keys[0].block_hash and found.token_ids == keys[1].token_ids
        assert seen["calls"] > 3 * FILE_BYTES // 4096 and seen["stalled"] == stalls
        assert (store.stats["hits"], store.stats["corrupt"], store.stats["read_errors"]) == (
            3, 0, 0)
        assert all(store.path_for(k).exists() for k in keys)


def test_reads_that_stall_for_good_are_a_miss_that_keeps_the_block(store, monkeypatch):
    keys, data = _keys(2), _payloads(2)
    store.put_from(keys, data)
    with monkeypatch.context() as patch:
        _short_reads(patch, 1000, stalls=10**6)  # the file holds the bytes; reads stop
        assert store.get_into(keys, _empty(2)) == [False, False]
    assert (store.stats["misses"], store.stats["read_errors"], store.stats["corrupt"]) == (2, 2, 0)
    assert all(store.path_for(k).exists() for k in keys)
    out = _empty(2)
    assert store.get_into(keys, out) == [True, True] and out == data


def test_a_truncated_file_read_in_short_reads_is_still_damage(store, monkeypatch):
    keys, data = _keys(2), _payloads(2)
    store.put_from(keys, data)
    _truncate(store.path_for(keys[1]))
    with monkeypatch.context() as patch:
        _short_reads(patch, 1000)
        assert store.get_into(keys, _empty(2)) == [True, False]
    assert (store.stats["corrupt"], store.stats["read_errors"]) == (1, 0)
    assert not store.path_for(keys[1]).exists()


def test_an_eviction_scan_reads_parents_through_short_reads(root, monkeypatch):
    from dualpath.storage.fs_capacity import SharedCapacity

    keys = _keys(3)
    with FsStore(root, SMALL) as store:
        store.put_from(keys, _payloads(3))
    with monkeypatch.context() as patch:
        _short_reads(patch, 1000)
        scanned = SharedCapacity(root, 10 * FILE_BYTES).scan()  # reads every header
    assert {h: b.parent for h, b in scanned.items()} == {k.block_hash: k.parent for k in keys}


# -- who may read the files ----------------------------------------------------------------------


def _modes(root: Path) -> tuple[set[int], set[int]]:
    """The permission bits of every file and every folder under ``root`` (itself included)."""
    files = {stat.S_IMODE(p.stat().st_mode) for p in root.rglob("*") if p.is_file()}
    folders = {stat.S_IMODE(p.stat().st_mode) & 0o777
               for p in [root, *root.rglob("*")] if p.is_dir()}
    return files, folders


@pytest.fixture
def umask():
    """Set the process umask for a test (and restore it)."""
    before = os.umask(0o022)
    yield os.umask
    os.umask(before)


def test_a_stores_files_and_folders_are_its_owners_only(root, umask):
    umask(0o002)  # the loosest common umask: it must not loosen the store
    with FsStore(root, SMALL, capacity_bytes=10 * FILE_BYTES) as store:
        store.put_from(_keys(3), _payloads(3))
        assert not store.group_shared
    files, folders = _modes(root)
    assert files == {0o600} and folders == {0o700}
    assert {p.name for p in root.iterdir() if p.is_file()} >= {".usage", ".usage.lock"}


def test_a_group_shared_store_lets_its_group_read_and_no_one_else(root, umask):
    umask(0o077)  # a umask that would keep the group out
    with FsStore(root, SMALL, group_shared=True) as store:
        store.put_from(_keys(2), _payloads(2))
    assert root.stat().st_mode & stat.S_ISGID  # later openers find the store shared
    with FsStore(root, SMALL) as store:
        assert store.group_shared
        store.put_from(_keys(2, salt=1), _payloads(2))
    files, folders = _modes(root)
    assert files == {0o640} and folders == {0o750}
    assert len(_block_files(root)) == 4


def test_an_empty_root_a_launcher_made_gets_the_stores_mode(root):
    root.mkdir()
    os.chmod(root, 0o755)  # mkdir under the usual umask
    with FsStore(root, SMALL):
        pass
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


def test_a_store_root_open_to_others_is_reported_not_changed(root, caplog):
    with FsStore(root, SMALL) as store:
        store.put_from(_keys(1), _payloads(1))
    os.chmod(root, 0o755)  # as older code left it, blocks inside
    with caplog.at_level("WARNING", logger="dualpath.storage"), FsStore(root, SMALL):
        pass
    assert "open to other users (mode 755)" in caplog.text
    assert stat.S_IMODE(root.stat().st_mode) == 0o755
    caplog.clear()
    os.chmod(root, 0o700)
    with caplog.at_level("WARNING", logger="dualpath.storage"), FsStore(root, SMALL):
        pass
    assert "open to other users" not in caplog.text


# -- audits ----------------------------------------------------------------------------------------


def test_stored_keys_lists_every_block_file_and_nothing_else(store, root):
    keys = _keys(3) + _keys(2, salt=1, model="other")
    store.put_from(keys, _payloads(5))
    (root / "m" / "stray.txt").write_text("not a block")
    shard = store.path_for(keys[0]).parent
    (shard / ".half-written.tmp").write_bytes(b"")
    (shard / "not-hex.kvb").write_bytes(b"")
    assert sorted(store.stored_keys(), key=lambda k: k.name) == sorted(keys, key=lambda k: k.name)
    assert all(k.parent is None and k.token_ids is None for k in store.stored_keys())


def test_read_block_gives_parent_and_token_ids_and_leaves_the_block_as_it_was(store):
    keys, data = _keys(2), _payloads(2)
    store.put_from(keys, data)
    path = store.path_for(keys[1])
    os.utime(path, ns=(1, 1))
    out = _empty(1)
    found = store.read_block(keys[1], out[0])
    assert out[0] == data[1]
    assert (found.parent, found.token_ids) == (keys[0].block_hash, keys[1].token_ids)
    assert store.read_block(keys[1]).token_ids == keys[1].token_ids  # the header alone
    assert path.stat().st_mtime_ns == 1  # no use of the block
    _flip_payload_byte(path)
    assert store.read_block(keys[1]) is not None  # the header is fine ...
    assert store.read_block(keys[1], out[0]) is None  # ... the payload is not
    assert path.exists() and store.stats["hits"] == store.stats["corrupt"] == 0


def test_a_block_saved_without_token_ids_reads_like_any_other(store):
    key = _keys(1)[0]
    bare = BlockKey(key.model_id, key.layout_id, key.block_size, key.block_hash)
    data = _payloads(1)
    store.put_from([bare], data)
    out = _empty(1)
    assert store.get_into([key], out) == [True] and out == data
    assert store.read_block(key).token_ids is None


# -- writes --------------------------------------------------------------------------------------


def test_no_temp_files_remain(store, root):
    keys = _keys(8)
    store.put_from(keys, _payloads(8))
    store.put_from(keys[:3], _payloads(3))  # skipped
    files = _files(root)
    assert len(files) == 8
    assert all(p.suffix == ".kvb" and not p.name.startswith(".") for p in files)
    assert all(p.stat().st_size == FILE_BYTES for p in files)


def test_fsync(root):
    keys, data = _keys(3), _payloads(3)
    with FsStore(root, SMALL, fsync=True) as store:
        assert store.put_from(keys, data) == [True] * 3
        out = _empty(3)
        assert store.get_into(keys, out) == [True] * 3
        assert out == data
    assert len(_files(root)) == 3


def test_a_second_store_on_the_same_root_reads_the_blocks(root):
    keys, data = _keys(3), _payloads(3)
    with FsStore(root, SMALL) as writer:
        writer.put_from(keys, data)
    with FsStore(root, SMALL) as reader:
        out = _empty(3)
        assert reader.get_into(keys, out) == [True] * 3
        assert out == data


def test_two_threads_writing_one_key(store, root):
    key = _keys(1)[0]
    barrier = threading.Barrier(2)
    written: set[bytes] = set()
    results: list[bool] = []

    def write(seed: int) -> None:
        for round_ in range(10):
            payload = _payload_for(seed, round_)
            written.add(payload)
            barrier.wait(timeout=30)
            results.append(store.put_from([key], [bytearray(payload)])[0])
            barrier.wait(timeout=30)
            if seed == 0:
                store.delete([key])
            barrier.wait(timeout=30)
        results.append(store.put_from([key], [bytearray(_payload_for(seed, 99))])[0])

    threads = [threading.Thread(target=write, args=(seed,)) for seed in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    written |= {_payload_for(0, 99), _payload_for(1, 99)}
    assert all(results) and len(results) == 22
    assert _files(root) == [store.path_for(key)]
    out = _empty(1)
    assert store.get_into([key], out) == [True]
    assert bytes(out[0]) in written
    assert store.stats["corrupt"] == 0


def _write_many(root: str, key: BlockKey, seed: int, rounds: int, barrier) -> None:
    """One writer process: replace ``key`` ``rounds`` times with its own payloads."""
    with FsStore(root, SMALL, workers=1) as store:
        barrier.wait(timeout=60)
        for round_ in range(rounds):
            store.delete([key])
            if store.put_from([key], [bytearray(_payload_for(seed, round_))]) != [True]:
                raise SystemExit(3)


def test_two_processes_writing_one_key_while_a_thread_reads(root):
    key = _keys(1)[0]
    rounds = 20
    written = {_payload_for(seed, r) for seed in (1, 2) for r in range(rounds)}
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(3)
    reader = FsStore(root, SMALL)
    done = threading.Event()
    seen: list[bytes] = []

    def read() -> None:
        out = bytearray(SMALL.full_block_bytes)
        barrier.wait(timeout=60)
        while True:
            finished = done.is_set()
            if reader.get_into([key], [out]) == [True]:
                seen.append(bytes(out))
            if finished:
                return

    procs = [ctx.Process(target=_write_many, args=(str(root), key, seed, rounds, barrier))
             for seed in (1, 2)]
    for proc in procs:
        proc.start()
    thread = threading.Thread(target=read)
    thread.start()
    for proc in procs:
        proc.join(timeout=60)
    done.set()
    thread.join(timeout=60)
    reader.close()
    assert [proc.exitcode for proc in procs] == [0, 0]
    assert seen, "the final read found no block"
    assert all(payload in written for payload in seen)  # never a mix of two writes
    assert reader.stats["corrupt"] == 0
    assert _files(root) == [reader.path_for(key)]  # one block, no temp file
    with FsStore(root, SMALL) as check:
        out = _empty(1)
        assert check.get_into([key], out) == [True]
        assert bytes(out[0]) in written


# -- O_DIRECT ------------------------------------------------------------------------------------


def _aligned_buffers(count: int) -> list[mmap.mmap]:
    return [mmap.mmap(-1, SMALL.full_block_bytes) for _ in range(count)]  # page aligned


def _spy_open_flags(monkeypatch) -> list[int]:
    """Record the flags of every os.open from now on."""
    flags_seen: list[int] = []
    real_open = os.open

    def spy(path, flags, *args, **kwargs):
        flags_seen.append(flags)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", spy)
    return flags_seen


def test_o_direct_reads(root, monkeypatch):
    keys, data = _keys(4), _payloads(4)
    with FsStore(root, SMALL, o_direct=True) as store:
        assert store.o_direct == bool(getattr(os, "O_DIRECT", 0))
        assert store.put_from(keys, data) == [True] * 4
        flags_seen = _spy_open_flags(monkeypatch)
        out = _aligned_buffers(4)
        assert store.get_into(keys, out) == [True] * 4
        assert [bytes(b) for b in out] == data
        assert store.stats["corrupt"] == 0
        if store.o_direct:
            assert len(flags_seen) == 4
            assert all(f & os.O_DIRECT for f in flags_seen)


def test_o_direct_with_unaligned_buffers(root, monkeypatch):
    keys, data = _keys(2), _payloads(2)
    with FsStore(root, SMALL, o_direct=True) as store:
        store.put_from(keys, data)
        flags_seen = _spy_open_flags(monkeypatch)
        backing = [bytearray(SMALL.full_block_bytes + 1) for _ in range(2)]
        out = [memoryview(b)[1:] for b in backing]  # off by one byte from any alignment
        assert store.get_into(keys, out) == [True, True]
        assert [bytes(v) for v in out] == data
        assert not any(f & getattr(os, "O_DIRECT", 0) for f in flags_seen)  # buffered


def test_without_o_direct_reads_are_buffered(store, monkeypatch):
    keys, data = _keys(2), _payloads(2)
    store.put_from(keys, data)
    flags_seen = _spy_open_flags(monkeypatch)
    out = _aligned_buffers(2)
    assert store.get_into(keys, out) == [True, True]
    assert [bytes(b) for b in out] == data
    assert len(flags_seen) == 2
    assert not any(f & getattr(os, "O_DIRECT", 0) for f in flags_seen)


def test_o_direct_still_verifies(root):
    keys, data = _keys(2), _payloads(2)
    with FsStore(root, SMALL, o_direct=True) as store:
        store.put_from(keys, data)
        _flip_payload_byte(store.path_for(keys[0]))
        assert store.get_into(keys, _aligned_buffers(2)) == [False, True]
        assert store.stats["corrupt"] == 1


def test_o_direct_unsupported_falls_back(root, monkeypatch):
    if not getattr(os, "O_DIRECT", 0):
        pytest.skip("no O_DIRECT on this platform")
    keys, data = _keys(2), _payloads(2)
    real_open = os.open

    def open_without_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args, **kwargs)

    with FsStore(root, SMALL, o_direct=True) as store:
        store.put_from(keys, data)
        monkeypatch.setattr(os, "open", open_without_direct)
        out = _aligned_buffers(2)
        assert store.get_into(keys, out) == [True, True]
        assert [bytes(b) for b in out] == data
        assert all(store.path_for(k).is_file() for k in keys)


# -- capacity ------------------------------------------------------------------------------------


def test_capacity_counts_the_header(root):
    keys = _keys(3, salt=1)
    with FsStore(root, SMALL, capacity_bytes=3 * FILE_BYTES - 1) as store:
        store.put_from(keys, _payloads(3))
        assert store.stats["blocks_evicted"] == 1
        assert sum(1 for k in keys if store.exists_prefix([k])) == 2
    assert len(_block_files(root)) == 2


def test_eviction_leaves_no_file_beyond_the_prefix(root):
    chain_a, chain_b = _keys(6, salt=1), _keys(6, salt=2)
    with FsStore(root, SMALL, capacity_bytes=8 * FILE_BYTES) as store:
        store.put_from(chain_a, _payloads(6))
        assert store.get_into(chain_a[:2], _empty(2)) == [True, True]
        store.put_from(chain_b, _payloads(6))
        assert store.stats["blocks_evicted"] == 4
        kept = store.exists_prefix(chain_a)
        assert kept == 2
        assert all(store.path_for(k).is_file() for k in chain_a[:kept])
        assert not any(store.path_for(k).exists() for k in chain_a[kept:])
    assert len(_block_files(root)) == 8


def test_a_reopened_store_rebuilds_its_index_from_disk(root):
    chain_a, chain_b = _keys(6, salt=1), _keys(2, salt=2)
    with FsStore(root, SMALL) as store:
        store.put_from(chain_a, _payloads(6))
    with FsStore(root, SMALL, capacity_bytes=4 * FILE_BYTES) as store:
        assert store.stats["blocks_evicted"] == 0  # opening evicts nothing ...
        assert len(_block_files(root)) == 6
        store.put_from(chain_b[:1], _payloads(1))  # ... the next write does
        assert store.stats["blocks_evicted"] == 3
        assert store.exists_prefix(chain_b) == 1
        kept = store.exists_prefix(chain_a)
        assert kept == 3
        assert not any(store.path_for(k).exists() for k in chain_a[kept:])
    assert len(_block_files(root)) == 4


def test_a_reopened_store_ignores_foreign_files(root):
    keys = _keys(2)
    with FsStore(root, SMALL) as store:
        store.put_from(keys, _payloads(2))
    (root / "junk.kvb").write_bytes(b"not a block")
    (root / "zz" / "notes.txt").parent.mkdir()
    (root / "zz" / "notes.txt").write_text("hello")
    with FsStore(root, SMALL, capacity_bytes=10 * FILE_BYTES) as store:
        assert store.exists_prefix(keys) == 2
        store.put_from(_keys(1, salt=5), _payloads(1))
        assert store.stats["blocks_evicted"] == 0
