"""A host pool over a shared file: another process maps the same bytes; close removes the file;
the file is created new (0600, O_EXCL, no symlink), an existing one only replaced when a dead
process left it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dualpath.kv.host_pool import ALIGN_BYTES, HostPool
from dualpath.kv.shm_files import ShmFileError

# Run by a second process: map the file read-only and print the bytes at an offset.
READER = """
import mmap, sys
path, offset, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with open(path, "rb") as f:
    m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    sys.stdout.write(m[offset:offset + count].hex())
"""
# Run by a second process: map a file and wait.
MAPPER = """
import mmap, sys, time
with open(sys.argv[1], "rb") as f:
    m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
print("mapped", flush=True)
time.sleep(600)
"""


def test_shared_pool_bytes_are_seen_by_another_process(tmp_path):
    path = tmp_path / "dualpath-de0-1.shm"
    pool = HostPool(100, 4, pin=False, shm_path=str(path))
    assert path.stat().st_size == pool.nbytes == 4 * ALIGN_BYTES
    pool.tensor(2)[:5] = 7  # through the pool's own view
    pool.buffer(3)[:3] = b"abc"
    offset = pool.address(2) - pool.base_address
    seen = subprocess.run([sys.executable, "-c", READER, str(path), str(offset), "5"],
                          capture_output=True, text=True, timeout=60, check=True).stdout
    assert bytes.fromhex(seen) == bytes([7] * 5)
    offset = pool.address(3) - pool.base_address
    seen = subprocess.run([sys.executable, "-c", READER, str(path), str(offset), "3"],
                          capture_output=True, text=True, timeout=60, check=True).stdout
    assert bytes.fromhex(seen) == b"abc"
    pool.close()
    assert not path.exists()
    pool.close()  # idempotent


def test_shared_pool_keeps_slots_aligned_in_a_new_private_file(tmp_path):
    path = tmp_path / "pool.shm"
    pool = HostPool(5000, 3, pin=False, shm_path=str(path))
    assert pool.slot_bytes == 2 * ALIGN_BYTES
    assert path.stat().st_size == pool.nbytes == 3 * pool.slot_bytes
    assert path.stat().st_mode & 0o777 == 0o600
    assert pool.base_address % ALIGN_BYTES == 0
    assert pool.alloc_run(2) == [0, 1]
    pool.close()
    assert not path.exists()


def test_shared_pool_refuses_an_existing_file_and_leaves_it_alone(tmp_path):
    path = tmp_path / "pool.shm"
    path.write_bytes(b"x" * 100_000)
    with pytest.raises(ShmFileError, match="already exists"):
        HostPool(5000, 3, pin=False, shm_path=str(path))
    assert path.read_bytes() == b"x" * 100_000


def test_shared_pool_never_follows_a_symlink(tmp_path):
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    link = tmp_path / f"dualpath-de0-{os.getpid()}"
    link.symlink_to(target)
    with pytest.raises(ShmFileError):
        HostPool(100, 2, pin=False, shm_path=str(link))
    assert link.is_symlink() and target.read_bytes() == b"keep"


def test_shared_pool_replaces_a_file_a_dead_process_with_its_name_left(tmp_path):
    """A pool named with this process's pid that nothing maps: a dead process that had the
    same pid left it; the new pool takes the name afresh (zeroed, 0600)."""
    path = tmp_path / f"dualpath-de0-{os.getpid()}"
    path.write_bytes(b"x" * 3 * ALIGN_BYTES)
    path.chmod(0o644)
    pool = HostPool(100, 3, pin=False, shm_path=str(path))
    assert bytes(pool.region(0, 3).numpy()) == bytes(pool.nbytes)  # not the old bytes
    assert path.stat().st_mode & 0o777 == 0o600
    pool.close()
    assert not path.exists()


def test_shared_pool_refuses_a_stale_name_a_live_process_still_maps(tmp_path):
    path = tmp_path / f"dualpath-de0-{os.getpid()}"
    path.write_bytes(b"y" * ALIGN_BYTES)
    path.chmod(0o600)
    mapper = subprocess.Popen([sys.executable, "-c", MAPPER, str(path)], text=True,
                              stdout=subprocess.PIPE)
    try:
        assert mapper.stdout.readline().strip() == "mapped"
        with pytest.raises(ShmFileError, match="already exists"):
            HostPool(100, 1, pin=False, shm_path=str(path))
        assert path.read_bytes() == b"y" * ALIGN_BYTES
    finally:
        mapper.kill()
        mapper.wait()
        mapper.stdout.close()


def test_close_removes_only_the_file_the_pool_created(tmp_path):
    path = tmp_path / "pool.shm"
    pool = HostPool(100, 1, pin=False, shm_path=str(path))
    path.unlink()
    path.write_bytes(b"someone else's")  # a new file under the same name
    pool.close()
    assert path.read_bytes() == b"someone else's"


def test_anonymous_pool_has_no_file():
    pool = HostPool(100, 2, pin=False)
    assert pool.shm_path is None
    pool.close()
