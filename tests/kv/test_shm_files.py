"""The shared-memory sweep with real processes: a file a live process maps or holds is never
removed; a killed process group's ``psm_`` segment and a killed engine's pool file are, once no
live process maps them; other users' files, symlinks and other names are never touched."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dualpath.kv.host_pool import HostPool
from dualpath.kv.shm_files import (
    ShmFileError,
    dead_files,
    map_readonly,
    pool_file_pid,
    remove_if_dead,
    scan_holders,
    sweep_dead,
    sweepable_name,
)

# serial: a killed group's segment must outlive the kill until this test sweeps it, and other
# workers' engines sweep every dead group's files as they start
pytestmark = pytest.mark.serial

# A segment as vLLM makes them (multiprocessing.shared_memory, with its resource tracker).
SEGMENT = """
import sys, time
from multiprocessing import shared_memory
segment = shared_memory.SharedMemory(create=True, size=1 << 20)
print(segment.name, flush=True)
time.sleep(600)
"""
# A decode engine's pool, named as vllm_instance.shm_path_for names it.
POOL = """
import os, sys, time
from dualpath.kv.host_pool import HostPool
path = os.path.join(sys.argv[1], f"dualpath-de1-{os.getpid()}")
pool = HostPool(4096, 4, pin=False, shm_path=path)
print(pool.shm_path, flush=True)
time.sleep(600)
"""
# A vLLM decode instance's connector: maps an engine's pool file read-only.
READER = """
import sys, time
from dualpath.kv.shm_files import map_readonly
mapped = map_readonly(sys.argv[1])
print(len(mapped), flush=True)
time.sleep(600)
"""
# Maps a file and closes its descriptor, as C code does (glibc's sem_open, say); Python's own
# mmap keeps a duplicate descriptor, which the fd scan would see anyway.
C_MAPPER = """
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long]
fd = os.open(sys.argv[1], os.O_RDONLY)
address = libc.mmap(None, 4096, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
os.close(fd)
print(address, flush=True)
time.sleep(600)
"""
# Holds a file open without mapping it.
HOLDER = """
import os, sys, time

fd = os.open(sys.argv[1], os.O_RDONLY)
print(fd, flush=True)
time.sleep(600)
"""


class Child:
    """A python child in a process group of its own that prints one line once ready."""

    def __init__(self, code: str, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", code, *args], text=True,
                                     stdout=subprocess.PIPE, start_new_session=True)
        self.line = self.proc.stdout.readline().strip()
        assert self.line, "the child printed nothing"

    def kill_group(self) -> None:
        """SIGKILL the whole group (a resource tracker too), as a hard stop of vLLM does."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        deadline = time.monotonic() + 10
        while _group_alive(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill_group()
        self.proc.stdout.close()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def children():
    made: list[Child] = []

    def start(code: str, *args: str) -> Child:
        made.append(Child(code, *args))
        return made[-1]

    yield start
    for child in made:
        child.close()


def test_a_live_processs_segment_is_kept_and_a_killed_groups_is_swept(children):
    child = children(SEGMENT)
    path = Path("/dev/shm") / child.line
    assert path.exists() and sweepable_name(path.name)
    assert sweep_dead(names={path.name}) == []  # mapped by a live process
    assert path.exists()
    child.kill_group()
    assert path.exists(), "the killed group left its segment (what the sweep is for)"
    sweep_dead(names={path.name})  # another sweep may have been first
    assert not path.exists()


def test_a_killed_engines_pool_is_kept_while_its_reader_lives_then_swept(children, tmp_path):
    engine = children(POOL, str(tmp_path))
    pool = Path(engine.line)
    assert pool_file_pid(pool.name) == engine.proc.pid
    assert oct(pool.stat().st_mode & 0o777) == "0o600"
    reader = children(READER, str(pool))
    assert int(reader.line) == 4 * 4096
    engine.kill_group()
    assert dead_files(tmp_path) == []  # the reader still maps it
    reader.kill_group()
    assert sweep_dead(tmp_path) == [pool]
    assert not pool.exists()


def test_a_mapping_without_an_open_descriptor_is_kept(children, tmp_path):
    path = tmp_path / f"dualpath-de6-{_dead_pid()}"
    path.write_bytes(b"z" * 4096)
    mapper = children(C_MAPPER, str(path))
    assert int(mapper.line) > 0
    assert dead_files(tmp_path) == []
    mapper.kill_group()
    assert dead_files(tmp_path) == [path]


def test_a_file_held_open_without_a_mapping_is_kept(children, tmp_path):
    path = tmp_path / f"dualpath-de2-{_dead_pid()}"
    path.write_bytes(b"x")
    holder = children(HOLDER, str(path))
    assert dead_files(tmp_path) == []
    holder.kill_group()
    assert dead_files(tmp_path) == [path]


def test_a_pool_named_for_a_live_process_is_kept_even_unmapped(children, tmp_path):
    live = children("print(1, flush=True); import time; time.sleep(600)")
    path = tmp_path / f"dualpath-de3-{live.proc.pid}"
    path.write_bytes(b"x")
    assert dead_files(tmp_path) == []
    live.kill_group()
    assert dead_files(tmp_path) == [path]


def test_other_users_files_symlinks_and_other_names_are_never_swept(tmp_path):
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    (tmp_path / "psm_aaaaaaaa").symlink_to(target)
    for name in ("dualpath-nic-c1-node0-read", "dualpath-nic-c1-node0-read.99999999.0123abcd.pid",
                 "dualpath-de1-99999999.vllm.log", "psm_short", "notes.txt"):
        (tmp_path / name).write_bytes(b"keep")
    if os.geteuid() == 0:
        theirs = tmp_path / f"dualpath-de4-{_dead_pid()}"
        theirs.write_bytes(b"keep")
        os.chown(theirs, 65534, 65534)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert sweep_dead(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert target.read_bytes() == b"keep"


def test_names_the_sweep_knows():
    assert pool_file_pid("dualpath-de1-1234") == 1234
    assert pool_file_pid("dualpath-pd-test-77") == 77
    assert pool_file_pid("dualpath-nic-run1-node3-write") is None
    assert pool_file_pid("dualpath-de1-1234.vllm.log") is None
    assert sweepable_name("psm_0123abcd") and sweepable_name("sem.mp-a1b2_c3d")
    assert not sweepable_name("psm_0123abcd.txt") and not sweepable_name("sem.other")


def test_a_scan_sees_this_processs_own_mapping(tmp_path):
    pool = HostPool(4096, 2, pin=False, shm_path=str(tmp_path / f"dualpath-de5-{os.getpid()}"))
    info = os.stat(pool.shm_path)
    assert (info.st_dev, info.st_ino) in scan_holders(tmp_path).held
    assert not remove_if_dead(Path(pool.shm_path))  # this process maps it
    pool.close()


def test_map_readonly_refuses_what_is_not_our_private_file(tmp_path):
    good = tmp_path / "good"
    good.write_bytes(b"abc")
    good.chmod(0o600)
    assert map_readonly(good)[:3] == b"abc"
    link = tmp_path / "link"
    link.symlink_to(good)
    with pytest.raises(ShmFileError, match="cannot open"):
        map_readonly(link)
    good.chmod(0o644)
    with pytest.raises(ShmFileError, match="open to others"):
        map_readonly(good)
    with pytest.raises(ShmFileError, match="not a regular file"):
        map_readonly(tmp_path)
    if os.geteuid() == 0:
        good.chmod(0o600)
        os.chown(good, 65534, 65534)
        with pytest.raises(ShmFileError, match="belongs to uid 65534"):
            map_readonly(good)


def _dead_pid() -> int:
    """The pid of a process that has exited."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid
