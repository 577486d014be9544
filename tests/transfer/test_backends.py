"""Transfer backends: batched write/read round trips and typed errors, in and across processes.

A Mooncake engine takes about a second to destroy (holding the GIL), so one pair per backend
kind serves the whole module.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import multiprocessing as mp
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from dualpath.errors import TransferError
from dualpath.transfer.base import RegionSet, Segment, TransferBackend
from dualpath.transfer.local import LocalBackend

SIZE = 1 << 20


def _address(buf: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


@dataclass
class Side:
    backend: TransferBackend
    buf: mmap.mmap
    addr: int


def _side(backend: TransferBackend) -> Side:
    buf = mmap.mmap(-1, SIZE)
    side = Side(backend, buf, _address(buf))
    backend.register(side.addr, SIZE)
    return side


def _mooncake():
    from dualpath.transfer.mooncake import MooncakeBackend

    try:
        return MooncakeBackend()
    except TransferError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module", params=["local", "mooncake"])
def pair(request) -> Iterator[tuple[Side, Side]]:
    make = LocalBackend if request.param == "local" else _mooncake
    a, b = _side(make()), _side(make())
    yield a, b
    a.backend.close()
    b.backend.close()


def _scattered(a: Side, b: Side, count: int, seed: int) -> list[Segment]:
    """``count`` segments of varying size at shuffled, non-overlapping offsets on both sides."""
    rng = random.Random(seed)
    size = SIZE // count
    local = list(range(count))
    remote = list(range(count))
    rng.shuffle(local)
    rng.shuffle(remote)
    return [(a.addr + i * size, b.addr + j * size, rng.randint(1, size))
            for i, j in zip(local, remote, strict=True)]


def _fill(side: Side, seed: int) -> None:
    side.buf[:] = random.Random(seed).randbytes(SIZE)


def _expect(src: Side, dst: Side, segments: list[Segment], write: bool) -> None:
    for local, remote, n in segments:
        s, d = (local - src.addr, remote - dst.addr) if write else (remote - src.addr,
                                                                      local - dst.addr)
        assert dst.buf[d:d + n] == src.buf[s:s + n]


def test_write_many_segments(pair):
    a, b = pair
    _fill(a, 1)
    segments = _scattered(a, b, 256, seed=2)
    a.backend.write(b.backend.endpoint, segments)
    _expect(a, b, segments, write=True)


def test_read_many_segments(pair):
    a, b = pair
    _fill(b, 3)
    segments = _scattered(a, b, 300, seed=4)
    a.backend.read(b.backend.endpoint, segments)
    _expect(b, a, segments, write=False)


def test_started_transfers_land_together_once_polled(pair):
    a, b = pair
    _fill(a, 11)
    _fill(b, 12)
    writes = [(a.addr + i * 8192, b.addr + (31 - i) * 8192, 4000 + i) for i in range(32)]
    reads = [(a.addr + SIZE // 2 + i * 4096, b.addr + SIZE // 2 + i * 4096, 4096)
             for i in range(32)]
    pending = [a.backend.start_write(b.backend.endpoint, writes[i: i + 8]) for i in range(0, 32, 8)]
    pending += [a.backend.start_read(b.backend.endpoint, reads[i: i + 8]) for i in range(0, 32, 8)]
    deadline = time.monotonic() + 10
    while not all([p.poll() for p in pending]):  # every one polled each round
        assert time.monotonic() < deadline
        time.sleep(0.001)
    _expect(a, b, writes, write=True)
    _expect(b, a, reads, write=False)


def test_a_started_transfer_to_a_bad_address_fails(pair):
    a, b = pair
    bad = [(a.addr, b.addr + SIZE + 4096, 64)]
    with pytest.raises(TransferError):  # at the start, or when polled
        pending = a.backend.start_write(b.backend.endpoint, bad)
        deadline = time.monotonic() + 10
        while not pending.poll():
            assert time.monotonic() < deadline
            time.sleep(0.001)


class FakeEngine:
    """Mooncake's ``transfer_check_status`` from a script: batch → statuses, one per check."""

    def __init__(self, statuses: dict[int, list[int]]) -> None:
        self.statuses = statuses

    def transfer_check_status(self, batch: int) -> int:
        return self.statuses[batch].pop(0)


def test_mooncake_transfer_raises_only_once_every_batch_has_settled():
    from dualpath.transfer.mooncake import MooncakeTransfer

    landed = MooncakeTransfer(FakeEngine({1: [0, 1], 2: [0, 0, 1]}), [1, 2], "write")
    assert [landed.poll(), landed.poll(), landed.poll()] == [False, False, True]
    failed = MooncakeTransfer(FakeEngine({1: [-1], 2: [0, 0, 1]}), [1, 2], "write of 2")
    assert [failed.poll(), failed.poll()] == [False, False]  # batch 2 may still move bytes
    with pytest.raises(TransferError, match="write of 2: 1 failed"):
        failed.poll()


def test_empty_batch_is_a_no_op(pair):
    a, b = pair
    a.backend.write(b.backend.endpoint, [])
    a.backend.read(b.backend.endpoint, [])


@pytest.mark.parametrize("where", ["remote", "local", "straddles"])
def test_bad_address_is_a_transfer_error(pair, where):
    a, b = pair
    stray = mmap.mmap(-1, 4096)
    bad = {"remote": (a.addr, b.addr + SIZE + 4096, 64),
           "local": (_address(stray), b.addr, 64),
           "straddles": (a.addr, b.addr + SIZE - 32, 64)}[where]
    for op in (a.backend.write, a.backend.read):
        with pytest.raises(TransferError):
            op(b.backend.endpoint, [(a.addr, b.addr, 16), bad])


def test_unknown_peer(pair):
    a, b = pair
    peer = "local-0" if isinstance(a.backend, LocalBackend) else "127.0.0.1:1"
    with pytest.raises(TransferError):
        a.backend.write(peer, [(a.addr, b.addr, 16)])


@pytest.mark.parametrize("kind", ["local", "mooncake"])
def test_closed_backend_refuses_work(kind):
    side = _side(LocalBackend() if kind == "local" else _mooncake())
    peer = LocalBackend()
    side.backend.close()
    side.backend.close()  # closing twice is fine
    with pytest.raises(TransferError):
        side.backend.write(peer.endpoint, [(side.addr, side.addr, 16)])
    peer.close()


def test_register_rejects_overlap_and_ignores_repeats(pair):
    a, _ = pair
    a.backend.register(a.addr, SIZE)  # the same region again: no-op
    with pytest.raises(TransferError):
        a.backend.register(a.addr + 4096, 4096)


def test_region_set():
    regions = RegionSet()
    assert regions.add(1000, 100) and regions.add(2000, 10)
    assert not regions.add(1000, 100)
    assert regions.contains(1000, 100) and regions.contains(2005, 5)
    assert not regions.contains(1050, 100) and not regions.contains(999, 2)
    with pytest.raises(TransferError):
        regions.add(1099, 2)
    with pytest.raises(TransferError):
        regions.add(0, 10)
    regions.remove(1000)
    assert regions.regions() == [(2000, 10)]


# --- Mooncake across two OS processes --------------------------------------------------------


def _peer_main(conn) -> None:
    """Child process: serve one registered buffer until told to stop, then report its bytes."""
    from dualpath.transfer.mooncake import MooncakeBackend

    backend = MooncakeBackend()
    buf = mmap.mmap(-1, SIZE)
    buf[:] = random.Random(7).randbytes(SIZE)
    backend.register(_address(buf), SIZE)
    conn.send_bytes(json.dumps({"endpoint": backend.endpoint, "addr": _address(buf)}).encode())
    conn.recv_bytes()  # the parent is done
    conn.send_bytes(bytes(buf))
    backend.close()


def test_mooncake_across_processes():
    a = _side(_mooncake())
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_peer_main, args=(child,), daemon=True)
    proc.start()
    try:
        _drive_peer(a, parent)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        a.backend.close()
    assert proc.exitcode == 0


def _drive_peer(a: Side, conn) -> None:
    """Read from and write to the child's buffer, then compare its bytes with a local model."""
    assert conn.poll(60), "peer process did not start"
    info = json.loads(conn.recv_bytes())
    b = Side(a.backend, mmap.mmap(-1, SIZE), info["addr"])  # b.buf models the child's buffer
    b.buf[:] = random.Random(7).randbytes(SIZE)
    reads = _scattered(a, b, 128, seed=8)
    a.backend.read(info["endpoint"], reads)
    _expect(b, a, reads, write=False)
    _fill(a, 9)
    writes = _scattered(a, b, 128, seed=10)
    a.backend.write(info["endpoint"], writes)
    for local, remote, n in writes:
        b.buf[remote - b.addr:remote - b.addr + n] = a.buf[local - a.addr:local - a.addr + n]
    conn.send_bytes(b"done")
    assert conn.poll(30)
    assert conn.recv_bytes() == bytes(b.buf)


# --- imports ----------------------------------------------------------------------------------


def test_importing_the_transfer_package_loads_no_mooncake_or_torch():
    code = ("import sys, dualpath.transfer, dualpath.transfer.base, dualpath.traffic.lanes, "
            "dualpath.transfer.local, dualpath.transfer.mooncake; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'mooncake'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_missing_mooncake_is_a_clear_transfer_error(monkeypatch):
    from dualpath.transfer.mooncake import MooncakeBackend

    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # import raises ImportError
    with pytest.raises(TransferError, match="mooncake-transfer-engine"):
        MooncakeBackend()
