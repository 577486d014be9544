"""The mooncake_store backend beyond the contract: damage is a miss, a lost master or segment
holder gives misses in bounded time, the processes that hold the bytes, and the key scheme."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

from dualpath.config import StorageConfig
from dualpath.errors import InvalidKeyError, StorageError
from dualpath.kv.hashing import KeySpace
from dualpath.kv.layout import KVLayout
from dualpath.storage import open_store
from dualpath.storage.block_file import HEADER_BYTES

SMALL = KVLayout(4, 2, 8, "float16", 16)  # 4096-byte full blocks
OBJECT_BYTES = HEADER_BYTES + SMALL.full_block_bytes


def _keys(count: int, salt: int = 0, model: str = "m"):
    tokens = [salt * 7919 + i for i in range(SMALL.block_size * count)]
    return KeySpace(model, SMALL.layout_id, SMALL.block_size).keys(tokens)


def _payloads(count: int) -> list[bytearray]:
    return [bytearray(os.urandom(SMALL.full_block_bytes)) for _ in range(count)]


def _empty(count: int) -> list[bytearray]:
    return [bytearray(SMALL.full_block_bytes) for _ in range(count)]


def _open(master: str, prefix: str | None = None, **kwargs):
    from dualpath.storage.mooncake_store import MooncakeStore

    return MooncakeStore(SMALL, master=master, key_prefix=prefix or f"t{uuid.uuid4().hex}",
                         **kwargs)


@pytest.fixture
def store(mooncake_store_master):
    with _open(mooncake_store_master) as opened:
        yield opened


@pytest.fixture(scope="module")
def raw(mooncake_store_master):
    """A bare Mooncake client of the same master: reads and plants objects byte for byte."""
    from dualpath.storage.mooncake_store import connect

    client = connect(mooncake_store_master, local_buffer_mb=16)  # get/put copy through it
    yield client
    client.close()


# -- configuration and imports --------------------------------------------------------------------


def test_open_store_builds_a_mooncake_store(mooncake_store_master):
    from dualpath.storage.mooncake_store import MooncakeStore

    config = StorageConfig(backend="mooncake_store", mooncake_master=mooncake_store_master,
                           mooncake_key_prefix=f"t{uuid.uuid4().hex}")
    with open_store(config, SMALL) as store:
        assert isinstance(store, MooncakeStore)
        assert store.block_bytes == SMALL.full_block_bytes
        keys = _keys(1)
        assert store.put_from(keys, _payloads(1)) == [True]
        assert store.exists_prefix(keys) == 1


def test_mooncake_store_refuses_capacity_gb():
    config = StorageConfig(backend="mooncake_store", capacity_gb=1.0)
    with pytest.raises(ValueError, match="capacity_gb does not apply to mooncake_store"):
        open_store(config, SMALL)


def test_mooncake_store_module_imports_without_mooncake():
    code = ("import sys, dualpath.storage, dualpath.storage.mooncake_store, "
            "dualpath.storage.mooncake_service; "
            "assert not [m for m in sys.modules if m.startswith('mooncake')], sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_mooncake_store_refuses_a_bad_key_prefix(mooncake_store_master):
    with pytest.raises(InvalidKeyError, match="key prefix"):
        _open(mooncake_store_master, prefix="../escape")


# -- where the bytes live -------------------------------------------------------------------------


def test_mooncake_store_objects_are_named_like_fs_files(store, raw):
    key = _keys(1)[0]
    assert store.object_key(key) == f"{store.key_prefix}/m/{SMALL.layout_id}/bs16/{key.hex}"
    store.put_from([key], _payloads(1))
    assert raw.get_size(store.object_key(key)) == OBJECT_BYTES  # header + payload, like a file


def test_mooncake_store_blocks_outlive_the_client_that_wrote_them(mooncake_store_master):
    prefix = f"t{uuid.uuid4().hex}"
    keys, data = _keys(3), _payloads(3)
    with _open(mooncake_store_master, prefix) as writer:
        assert writer.put_from(keys, data) == [True] * 3
    with _open(mooncake_store_master, prefix) as reader:  # the segment holder kept them
        out = _empty(3)
        assert reader.get_into(keys, out) == [True] * 3
        assert out == data


def test_mooncake_store_prefixes_are_separate_namespaces(mooncake_store_master):
    keys = _keys(2)
    with _open(mooncake_store_master) as first, _open(mooncake_store_master) as second:
        first.put_from(keys, _payloads(2))
        assert second.exists_prefix(keys) == 0


def test_mooncake_store_scatter_lists_round_trip(store):
    """A block given as its layers (a layer-major host buffer) is one object, read back in place."""
    keys, data = _keys(2), _payloads(2)
    layer = SMALL.layer_block_bytes
    sources = [[memoryview(d)[i * layer:(i + 1) * layer] for i in range(SMALL.num_layers)]
               for d in data]
    assert store.put_from(keys, sources) == [True, True]
    targets = [[bytearray(layer) for _ in range(SMALL.num_layers)] for _ in keys]
    assert store.get_into(keys, targets) == [True, True]
    assert [b"".join(t) for t in targets] == data
    out = _empty(2)
    assert store.get_into(keys, out) == [True, True]  # the same object as one whole buffer
    assert out == data


def test_mooncake_store_registered_buffers_round_trip(mooncake_store_master):
    """The registration path RDMA needs, exercised over TCP."""
    keys, data = _keys(3), _payloads(3)
    with _open(mooncake_store_master, register_buffers=True) as store:
        assert store.put_from(keys, data) == [True] * 3
        out = _empty(3)
        assert store.get_into(keys, out) == [True] * 3
        assert out == data


# -- damage is a miss -----------------------------------------------------------------------------


def _flip_payload(good: bytes, other: bytes) -> bytes:
    return good[:HEADER_BYTES + 100] + bytes([good[HEADER_BYTES + 100] ^ 1]) + good[
        HEADER_BYTES + 101:]


DAMAGE = {
    "payload_bit_flipped": _flip_payload,
    "bad_magic": lambda good, other: b"XXXX" + good[4:],
    "truncated": lambda good, other: good[:-1],
    "one_byte_longer": lambda good, other: good + b"\0",
    "header_only": lambda good, other: good[:HEADER_BYTES],
    "another_keys_block": lambda good, other: other,  # a whole, valid block of another key
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_mooncake_store_damaged_object_is_a_miss(store, raw, damage):
    keys, data = _keys(3), _payloads(3)
    assert store.put_from(keys, data) == [True] * 3
    name = store.object_key(keys[1])
    bad = DAMAGE[damage](raw.get(name), raw.get(store.object_key(keys[2])))
    assert raw.remove(name, True) == 0
    assert raw.put(name, bad) == 0
    out = _empty(3)
    assert store.get_into(keys, out) == [True, False, True]  # the rest of the batch still reads
    assert (out[0], out[2]) == (data[0], data[2])
    stats = store.stats.snapshot()
    assert (stats["hits"], stats["misses"], stats["corrupt"]) == (2, 1, 1)
    assert raw.is_exist(name) == 0  # removed, so the next save rewrites it
    assert store.exists_prefix(keys) == 1
    assert store.put_from(keys[1:2], data[1:2]) == [True]
    assert store.get_into(keys[1:2], out[1:2]) == [True]
    assert out[1] == data[1]


def test_mooncake_store_absent_block_is_a_miss_not_damage(store):
    assert store.get_into(_keys(1), _empty(1)) == [False]
    assert (store.stats["misses"], store.stats["corrupt"], store.stats["read_errors"]) == (1, 0, 0)


class _FailingGets:
    """A Mooncake client whose reads fail with a transfer error (the objects are intact)."""

    TRANSFER_FAIL = -800

    def __init__(self, client) -> None:
        self.client = client

    def batch_get_into_multi_buffers(self, names, *args):
        return [self.TRANSFER_FAIL] * len(names)

    def __getattr__(self, name: str):
        return getattr(self.client, name)


def test_mooncake_store_failed_transfer_is_a_miss_that_keeps_the_object(store, raw):
    keys, data = _keys(2), _payloads(2)
    assert store.put_from(keys, data) == [True, True]
    client, store._client = store._client, _FailingGets(store._client)
    assert store.get_into(keys, _empty(2)) == [False, False]
    store._client = client
    assert all(raw.is_exist(store.object_key(k)) == 1 for k in keys)  # not taken for damage
    out = _empty(2)
    assert store.get_into(keys, out) == [True, True] and out == data
    stats = store.stats.snapshot()
    assert (stats["misses"], stats["read_errors"], stats["corrupt"]) == (2, 2, 0)


def test_mooncake_store_keeps_token_ids_for_audits(store):
    keys, data = _keys(2), _payloads(2)
    assert store.put_from(keys, data) == [True, True]
    out = _empty(1)
    found = store.read_block(keys[1], out[0])
    assert found == keys[1] and out[0] == data[1]
    assert (found.parent, found.token_ids) == (keys[0].block_hash, keys[1].token_ids)
    assert store.read_block(_keys(1, salt=5)[0]) is None
    with pytest.raises(StorageError, match="cannot list"):
        list(store.stored_keys())


# -- lost processes: misses in bounded time -------------------------------------------------------


def test_mooncake_store_unreachable_master_is_a_clear_error():
    from dualpath.storage.mooncake_service import free_port

    start = time.monotonic()
    master = f"127.0.0.1:{free_port()}"
    with pytest.raises(StorageError, match=re.escape(f"Mooncake master {master} is unreachable")):
        open_store(StorageConfig(backend="mooncake_store", mooncake_master=master), SMALL)
    assert time.monotonic() - start < 5


def _timed(call):
    start = time.monotonic()
    result = call()
    return result, time.monotonic() - start


@pytest.fixture
def private_service(tmp_path):
    """A master and a segment holder of this test's own, to kill; always stopped afterwards."""
    from dualpath.storage.mooncake_service import (
        free_port,
        start_master,
        start_segment_holder,
        stop,
    )

    port = free_port()
    master = start_master(port, log_path=tmp_path / "master.log")
    holder = None
    try:
        holder = start_segment_holder(f"127.0.0.1:{port}", 32, log_path=tmp_path / "holder.log")
        yield f"127.0.0.1:{port}", master, holder
    finally:
        for proc in (holder, master):
            if proc is not None:
                stop(proc)


class _Recorder:
    """Passes calls through to a Mooncake client and records their names."""

    def __init__(self, client) -> None:
        self.client, self.calls = client, []

    def __getattr__(self, name: str):
        self.calls.append(name)
        return getattr(self.client, name)


def test_mooncake_store_dead_master_gives_misses_in_bounded_time(private_service):
    address, master, _ = private_service
    keys, data = _keys(2), _payloads(2)
    store, writer = _open(address), _open(address)
    assert store.put_from(keys[:1], data[:1]) == [True]
    master.send_signal(signal.SIGKILL)
    master.wait()
    writer._client = recorder = _Recorder(writer._client)
    assert writer.put_from(keys[1:], data[1:]) == [False]
    assert recorder.calls == ["batch_is_exist"]  # the lookup failed: no write waits as long
    writer.close()
    found, first_s = _timed(lambda: store.get_into(keys[:1], _empty(1)))
    assert found == [False] and first_s < 10  # Mooncake's own RPC gives up after about 4 s
    for call, expected in [(lambda: store.exists_prefix(keys), 0),
                           (lambda: store.get_into(keys[:1], _empty(1)), [False]),
                           (lambda: store.put_from(keys[1:], data[1:]), [False]),
                           (lambda: store.delete(keys), 0)]:
        result, seconds = _timed(call)
        assert result == expected and seconds < 2  # known down: no waiting on Mooncake
    stats = store.stats.snapshot()
    assert stats["misses"] == 2 and stats["write_errors"] == 1 and stats["corrupt"] == 0
    assert stats["read_errors"] == 2  # the master's failure, not the blocks'
    _, close_s = _timed(store.close)
    assert close_s < 30


def test_mooncake_store_dead_segment_holder_gives_misses(private_service):
    address, _, holder = private_service
    keys, data = _keys(2), _payloads(2)
    with _open(address) as store:
        assert store.put_from(keys, data) == [True, True]
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        found, seconds = _timed(lambda: store.get_into(keys, _empty(2)))
        assert found == [False, False] and seconds < 5
        assert store.stats["hits"] == 0


# -- the processes ------------------------------------------------------------------------------


def test_mooncake_store_segment_holder_stops_cleanly_on_sigterm(private_service):
    _, _, holder = private_service
    assert holder.poll() is None  # up until told otherwise
    holder.send_signal(signal.SIGTERM)
    assert holder.wait(timeout=30) == 0


def test_mooncake_store_segment_holder_fails_without_a_master(tmp_path):
    from dualpath.storage.mooncake_service import free_port, start_segment_holder

    with pytest.raises(StorageError, match=r"segment holder .* did not start.*unreachable"):
        start_segment_holder(f"127.0.0.1:{free_port()}", 16, log_path=tmp_path / "holder.log")


def test_mooncake_store_start_master_needs_the_binary(monkeypatch):
    from dualpath.storage import mooncake_service

    monkeypatch.setattr(mooncake_service.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(mooncake_service.shutil, "which", lambda name: None)
    with pytest.raises(StorageError, match="no mooncake_master executable"):
        mooncake_service.start_master(mooncake_service.free_port())


def test_mooncake_store_start_master_refuses_a_taken_port(mooncake_store_master):
    from dualpath.storage.mooncake_service import start_master

    port = int(mooncake_store_master.rsplit(":", 1)[1])
    with pytest.raises(StorageError, match="already listens"):
        start_master(port)


@pytest.mark.parametrize("close_hangs", [True, False])
def test_a_stopping_segment_holder_exits_without_finalizing(monkeypatch, close_hangs):
    """Unmounting asks the master: a hung close must not keep a stopping holder alive, and a
    finished one exits at once too (finalization can wait on the native threads)."""
    import threading

    from dualpath.storage import mooncake_service

    release = threading.Event()

    class HangingClient:
        def close(self) -> None:
            if close_hangs:
                release.wait(30)

    exits = []
    monkeypatch.setattr(mooncake_service, "connect", lambda *a, **k: HangingClient())
    monkeypatch.setattr(mooncake_service, "CLOSE_TIMEOUT_S", 0.2)
    monkeypatch.setattr(mooncake_service.os, "_exit", lambda code: exits.append(code))
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    timer = threading.Timer(0.2, signal.raise_signal, (signal.SIGTERM,))
    timer.start()
    try:
        assert mooncake_service.serve("127.0.0.1:1", 1) == 0
    finally:
        release.set()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    assert exits == [0]
