"""The traffic manager's asynchronous API: ``after`` ordering, ``submit_copy`` through the NIC's
lanes (asynchronous, counted, paced, arbitrated with the high lane), and the FIFO ablation."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future

import pytest
import torch

from dualpath.config import TrafficConfig
from dualpath.errors import TransferError
from dualpath.traffic.copies import copy_pieces, group_pieces
from dualpath.traffic.lanes import Lane
from dualpath.traffic.manager import TrafficManager
from dualpath.traffic.queues import NicDirection
from dualpath.transfer.base import Segment, TransferBackend

KB = 1 << 10
MB = 1 << 20


class Log(TransferBackend):
    """A fake backend that logs each call's first local address; it can hold calls at a gate."""

    endpoint = "log"

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.calls: list[tuple[str, int]] = []
        self.gate = gate

    def register(self, address: int, nbytes: int) -> None:
        """Nothing to register."""

    def write(self, peer: str, segments: Sequence[Segment]) -> None:
        """Log the call once the gate (if any) opens."""
        if self.gate is not None:
            self.gate.wait(5)
        self.calls.append(("write", segments[0][0]))

    def read(self, peer: str, segments: Sequence[Segment]) -> None:
        """Log the call."""
        self.calls.append(("read", segments[0][0]))

    def close(self) -> None:
        """Nothing to close."""


# --- after= -----------------------------------------------------------------------------------


def test_after_orders_a_transfer_behind_another_future():
    backend = Log()
    with TrafficManager(backend, TrafficConfig(chunk_bytes=100)) as tm:
        gate: Future[None] = Future()
        second = tm.submit("write", "peer", [(2000, 0, 300)], Lane.HIGH, after=gate)
        first = tm.submit("write", "peer", [(1000, 0, 100)], Lane.KV_SAVE)
        first.result(5)
        time.sleep(0.05)
        assert not second.done() and [a for _, a in backend.calls] == [1000]
        gate.set_result(None)
        second.result(5)
        chained = tm.submit("read", "peer", [(3000, 0, 100)], Lane.KV_LOAD, after=second)
        chained.result(5)
    assert [a for _, a in backend.calls] == [1000, 2000, 2100, 2200, 3000]


def test_failed_after_fails_the_dependent_and_moves_nothing():
    backend = Log()
    with TrafficManager(backend, TrafficConfig(chunk_bytes=100)) as tm:
        gate: Future[None] = Future()
        moved = tm.submit("write", "peer", [(1, 0, 500)], Lane.KV_FORWARD, after=gate)
        dst = bytearray(10)
        copied = tm.submit_copy(dst, b"x" * 10, Lane.KV_LOAD, after=moved)
        gate.set_exception(RuntimeError("the layer's compute failed"))
        with pytest.raises(TransferError) as info:
            moved.result(5)
        assert isinstance(info.value.__cause__, RuntimeError)
        with pytest.raises(TransferError):
            copied.result(5)
    assert backend.calls == [] and dst == bytearray(10)
    assert tm.metrics()["h2d_bytes"] == 0


def test_close_fails_a_submission_whose_after_never_completes():
    tm = TrafficManager(None, TrafficConfig(grant_timeout_s=0.2))
    orphan = tm.submit_copy(bytearray(4), b"abcd", Lane.HIGH, after=Future())
    start = time.monotonic()
    tm.close()
    assert time.monotonic() - start < 2
    with pytest.raises(TransferError, match="closed"):
        orphan.result(0)


# --- submit_copy ------------------------------------------------------------------------------


def test_submit_copy_is_asynchronous_when_the_direction_is_busy():
    config = TrafficConfig(compute_recv_cap_mb_s=20, chunk_bytes=64 * KB, burst_chunks=1)
    with TrafficManager(None, config) as tm:
        busy = tm.submit_copy(bytearray(2 * MB), bytes(2 * MB), Lane.KV_LOAD)  # ~100 ms paced
        dst = bytearray(4 * KB)
        start = time.monotonic()
        future = tm.submit_copy(dst, b"y" * (4 * KB), Lane.KV_LOAD)
        assert time.monotonic() - start < 0.02 and not future.done()
        future.result(5)
        assert busy.done() and dst == b"y" * (4 * KB)  # same lane: behind the backlog


def test_copies_are_counted_per_lane_and_direction_on_their_nic_side():
    tm = TrafficManager(None, TrafficConfig(chunk_bytes=256))
    d_src = torch.arange(64 * 8, dtype=torch.float32).view(64, 8)
    d_dst = torch.zeros(8, 64).t()  # not contiguous: copied in row slices
    assert tm.copy(d_dst, d_src, Lane.KV_SAVE) == 2048
    assert torch.equal(d_dst, d_src)
    cache = torch.zeros(3, 4, 40)  # [layers, blocks, bytes]: cache[:, b] is strided
    tm.copy(cache[:, 2], torch.ones(3, 40), Lane.KV_LOAD)
    assert cache[:, 2].eq(1).all() and cache.sum() == 120
    m = tm.metrics()
    assert (m["d2h_bytes"], m["h2d_bytes"]) == (2048, 480)
    assert m["cnic_send_lane_bytes_kv_save"] == 2048 and m["cnic_recv_lane_bytes_kv_load"] == 480
    assert m["copy_bytes_kv_save"] == 2048 and m["cnic_send_bytes"] == 0
    assert m["cnic_send_peak_mb_s_100ms"] > 0
    tm.close()


@pytest.mark.parametrize("shape,index", [((6, 4, 100), None), ((6, 4, 100), 1),
                                         ((2, 3, 1000), 2), ((5, 8), None)])
def test_copy_pieces_are_at_most_a_chunk_and_cover_the_copy(shape, index):
    cache = torch.zeros(*shape, dtype=torch.float16)
    dst = cache if index is None else cache[:, index]  # [:, block] of a paged cache: strided
    src = torch.arange(dst.numel(), dtype=torch.float16).view(dst.shape)
    pieces, nbytes = copy_pieces(dst, src, 256)
    assert nbytes == dst.nbytes == sum(n for _, _, n in pieces)
    assert all(n <= 256 and d.nbytes == n for d, _, n in pieces)
    for d, s, _ in pieces:
        d.copy_(s)
    assert torch.equal(dst, src)


def test_group_pieces_fills_work_items_up_to_a_chunk_in_order():
    pieces = [(i, i, n) for i, n in enumerate([100, 100, 60, 300, 40, 256, 1])]
    groups = group_pieces(pieces, 256)  # type: ignore[arg-type]
    assert [[p[0] for p in g] for g in groups] == [[0, 1], [2], [3], [4], [5], [6]]
    assert all(sum(n for *_, n in g) <= 256 or len(g) == 1 for g in groups)
    assert group_pieces([], 256) == []


def test_submit_copies_moves_many_blocks_in_few_work_items(monkeypatch):
    queued: list[int] = []
    put = NicDirection.put

    def counting_put(self: NicDirection, items: Sequence) -> None:
        queued.extend(item.nbytes for item in items)
        put(self, items)

    monkeypatch.setattr(NicDirection, "put", counting_put)
    cache = torch.zeros(3, 20, 25)  # [layers, blocks, floats]: a layer block is 100 bytes
    host = torch.arange(20 * 3 * 25, dtype=torch.float32).view(20, 75)  # slots [layers × 25]
    slots = list(range(19, -1, -1))  # descending, as a host pool hands them out
    pairs = [(cache[1, b], host[slot, 25:50]) for b, slot in enumerate(slots)]
    with TrafficManager(None, TrafficConfig(chunk_bytes=1000)) as tm:
        tm.submit_copies(pairs, Lane.KV_LOAD, "h2d").result(5)
        assert tm.metrics()["h2d_bytes"] == 2000
        assert tm.submit_copies([], Lane.KV_LOAD).done()
    for b, slot in enumerate(slots):
        assert torch.equal(cache[1, b], host[slot, 25:50])
    assert cache[0].eq(0).all() and cache[2].eq(0).all()
    assert queued == [1000, 1000]  # 20 blocks of 100 bytes: two chunk-sized work items


def test_submit_copies_of_a_bad_pair_fails_at_once_and_moves_nothing():
    dst = [bytearray(10), bytearray(10)]
    with TrafficManager(None, TrafficConfig()) as tm:
        with pytest.raises(ValueError):
            tm.submit_copies([(dst[0], b"x" * 10), (dst[1], b"x" * 11)], Lane.KV_LOAD)
        with pytest.raises(ValueError, match="mix"):
            tm.submit_copies([(dst[0], b"x" * 10), (torch.zeros(4), torch.ones(4))],
                             Lane.KV_LOAD)
        assert tm.metrics()["h2d_bytes"] == 0
    assert dst == [bytearray(10), bytearray(10)]


def test_copies_are_paced_by_the_cap_of_their_side():
    config = TrafficConfig(compute_send_cap_mb_s=50, chunk_bytes=64 * KB, burst_chunks=1)
    with TrafficManager(None, config) as tm:
        start = time.monotonic()
        tm.copy(bytearray(5 * MB), bytes(5 * MB), Lane.KV_SAVE)  # d2h: the send side
        paced = time.monotonic() - start
        start = time.monotonic()
        tm.copy(bytearray(5 * MB), bytes(5 * MB), Lane.KV_LOAD)  # h2d: the uncapped side
        free = time.monotonic() - start
    assert paced >= (5 * MB - 64 * KB) / 50e6 * 0.95
    assert free < paced / 4


@pytest.mark.parametrize("qos_lanes", [True, False])
def test_copies_are_arbitrated_with_the_high_lane(qos_lanes):
    gate = threading.Event()
    backend = Log(gate)
    config = TrafficConfig(chunk_bytes=100, qos_lanes=qos_lanes)
    with TrafficManager(backend, config) as tm:
        tm.submit("write", "peer", [(1, 0, 100)], Lane.KV_SAVE)  # holds the send dispatcher
        time.sleep(0.05)
        order: list[str] = []
        saves = [tm.submit_copy(bytearray(100), bytes(100), Lane.KV_SAVE, "d2h")
                 for _ in range(3)]
        high = tm.submit("write", "peer", [(7, 0, 100)], Lane.HIGH)
        for name, f in [("save", s) for s in saves] + [("high", high)]:
            f.add_done_callback(lambda _f, name=name: order.append(name))
        gate.set()
        high.result(5)
        for f in saves:
            f.result(5)
    expected = ["high", "save", "save", "save"] if qos_lanes else ["save", "save", "save", "high"]
    assert order == expected


def test_fifo_mode_keeps_arrival_order_across_lanes():
    gate = threading.Event()
    backend = Log(gate)
    with TrafficManager(backend, TrafficConfig(chunk_bytes=100, qos_lanes=False)) as tm:
        first = tm.submit("write", "peer", [(1, 0, 100)], Lane.KV_SAVE)
        time.sleep(0.05)
        lanes = [Lane.KV_SAVE, Lane.HIGH, Lane.KV_LOAD, Lane.HIGH, Lane.KV_FORWARD]
        futures = [tm.submit("write", "peer", [(100 + i, 0, 100)], lane)
                   for i, lane in enumerate(lanes)]
        gate.set()
        for f in [first, *futures]:
            f.result(5)
        m = tm.metrics()
    assert [a for _, a in backend.calls] == [1, 100, 101, 102, 103, 104]
    assert m["lane_bytes_high"] == 200 and m["lane_bytes_kv_save"] == 200


def test_copy_of_mismatched_sizes_fails_at_once():
    with TrafficManager(None, TrafficConfig()) as tm:
        with pytest.raises(ValueError):
            tm.submit_copy(bytearray(10), b"x" * 11, Lane.HIGH)
        with pytest.raises(ValueError):
            tm.submit_copy(torch.zeros(4, 2), torch.zeros(3), Lane.HIGH)
        with pytest.raises(ValueError):
            tm.submit_copy(torch.zeros(8), torch.zeros(4, 2).t(), Lane.HIGH)
        flat = torch.zeros(8)
        tm.copy(flat, torch.ones(4, 2), Lane.HIGH)  # contiguous, equal bytes: a byte copy
        assert flat.eq(1).all()
        with pytest.raises(ValueError):
            tm.submit_copy(bytearray(1), b"x", Lane.HIGH, direction="up")  # type: ignore[arg-type]


@pytest.mark.gpu
def test_cuda_copies_run_on_a_copy_stream_and_complete():
    device = torch.device("cuda")
    config = TrafficConfig(chunk_bytes=256 * KB)
    with TrafficManager(None, config) as tm:
        src = torch.arange(4 * MB // 4, dtype=torch.float32, device=device) * 2  # queued compute
        host = torch.empty(src.shape, dtype=src.dtype).pin_memory()
        done = tm.submit_copy(host, src, Lane.KV_SAVE)  # d2h after the multiply
        back = torch.empty_like(src)
        up = tm.submit_copy(back, host, Lane.KV_LOAD, after=done)  # h2d after the d2h
        up.result(10)
        assert torch.equal(host, src.cpu()) and torch.equal(back, src)
        strided = torch.zeros(3, 8, 64 * KB, device=device)
        tm.copy(strided[:, 5], torch.ones(3, 64 * KB), Lane.KV_LOAD)
        assert strided[:, 5].eq(1).all() and strided.sum().item() == 3 * 64 * KB
        m = tm.metrics()
    assert m["d2h_bytes"] == 4 * MB and m["h2d_bytes"] == 4 * MB + 3 * 256 * KB
