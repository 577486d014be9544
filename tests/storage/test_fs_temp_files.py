"""Writers' temp files: named with their writer's host and pid, so that opening a store can
remove those of writers that died mid-write (and never a live writer's)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from dualpath.kv.hashing import KeySpace
from dualpath.kv.layout import KVLayout
from dualpath.storage import fs
from dualpath.storage.fs import FsStore

SMALL = KVLayout(4, 2, 8, "float16", 16)
# the host part of a temp file's name, as the store spells this host
HOST = re.sub(r"[^A-Za-z0-9-]", "_", socket.gethostname())[:64] or "host"


def _key(salt: int = 0):
    tokens = [salt * 7919 + i for i in range(SMALL.block_size)]
    return KeySpace("m", SMALL.layout_id, SMALL.block_size).keys(tokens)[0]


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def live_pid():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def _temp_file(store_root: Path, salt: int, pid: int, host: str | None = HOST) -> Path:
    """A temp file as a writer of ``pid`` on ``host`` leaves it beside its block's path."""
    key = _key(salt)
    h = key.hex  # the block's path, as the store builds it (opening one would sweep)
    path = store_root / key.model_id / key.layout_id / f"bs{key.block_size}" / h[:2] / h[2:4]
    path = path / f"{h}.kvb"
    path.parent.mkdir(parents=True, exist_ok=True)
    middle = f"{host}.{pid}" if host is not None else str(pid)
    tmp = path.with_name(f".{path.name}.{middle}.{uuid.uuid4().hex}.tmp")
    tmp.write_bytes(b"half a block")
    return tmp


def _eventually(check, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return check()


def test_a_writers_temp_file_is_named_with_its_host_and_pid(tmp_path, monkeypatch):
    names = []

    def refuse(src, dst):
        names.append(Path(src).name)
        raise OSError("refused")  # the write fails after its temp file was filled

    with FsStore(tmp_path, SMALL) as store:
        monkeypatch.setattr(fs.os, "replace", refuse)
        assert store.put_from([_key()], [bytearray(SMALL.full_block_bytes)]) == [False]
    assert len(names) == 1
    assert names[0].startswith(f".{_key().hex}.kvb.{HOST}.{os.getpid()}.")
    assert not list(tmp_path.rglob("*.tmp"))  # a failed write removes its own


def test_opening_a_store_removes_a_dead_writers_temp_file_and_keeps_a_live_ones(
        tmp_path, live_pid):
    dead = _temp_file(tmp_path, 0, _dead_pid())
    live = _temp_file(tmp_path, 1, live_pid)
    mine = _temp_file(tmp_path, 2, os.getpid())
    with FsStore(tmp_path, SMALL) as store:
        store.put_from([_key(3)], [bytearray(SMALL.full_block_bytes)])
        assert _eventually(lambda: not dead.exists()), "a dead writer's temp file stayed"
        store.swept.wait(10)
    assert live.exists() and mine.exists()
    assert store.path_for(_key(3)).exists()


def test_another_hosts_temp_file_goes_only_once_stale(tmp_path):
    other = _temp_file(tmp_path, 0, 1, host="elsewhere")  # pid 1 on another host: unknown
    old_style = _temp_file(tmp_path, 1, _dead_pid(), host=None)  # named before hosts were
    stale = _temp_file(tmp_path, 2, 1, host="elsewhere")
    long_ago = time.time() - fs.STALE_TEMP_S - 60
    os.utime(stale, (long_ago, long_ago))
    foreign = tmp_path / "m" / ".notes.tmp"  # not a name a writer makes
    foreign.write_text("x")
    os.utime(foreign, (long_ago, long_ago))
    assert fs.remove_dead_temp_files(tmp_path) == 1
    assert not stale.exists()
    assert other.exists() and old_style.exists() and foreign.exists()
    # an hour on, the others' writers are presumed dead too
    assert fs.remove_dead_temp_files(tmp_path, now_s=time.time() + fs.STALE_TEMP_S + 60) == 2
    assert not other.exists() and not old_style.exists() and foreign.exists()


def test_the_sweep_stops_when_the_store_closes(tmp_path):
    import threading

    _temp_file(tmp_path, 0, _dead_pid())
    stop = threading.Event()
    stop.set()
    assert fs.remove_dead_temp_files(tmp_path, stop) == 0
