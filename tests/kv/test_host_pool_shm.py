"""A host pool over a shared file: another process maps the same bytes; close removes the file."""

from __future__ import annotations

import subprocess
import sys

from dualpath.kv.host_pool import ALIGN_BYTES, HostPool

# Run by a second process: map the file read-only and print the bytes at an offset.
READER = """
import mmap, sys
path, offset, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with open(path, "rb") as f:
    m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    sys.stdout.write(m[offset:offset + count].hex())
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


def test_shared_pool_truncates_an_old_file_and_keeps_slots_aligned(tmp_path):
    path = tmp_path / "pool.shm"
    path.write_bytes(b"x" * 100_000)
    pool = HostPool(5000, 3, pin=False, shm_path=str(path))
    assert pool.slot_bytes == 2 * ALIGN_BYTES
    assert path.stat().st_size == pool.nbytes == 3 * pool.slot_bytes
    assert bytes(pool.region(0, 3).numpy()) == bytes(pool.nbytes)  # zeroed, not the old bytes
    assert pool.base_address % ALIGN_BYTES == 0
    assert pool.alloc_run(2) == [0, 1]
    pool.close()
    assert not path.exists()


def test_anonymous_pool_has_no_file():
    pool = HostPool(100, 2, pin=False)
    assert pool.shm_path is None
    pool.close()
