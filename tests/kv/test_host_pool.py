"""HostPool: one aligned slab cut into 4 KiB-aligned slots, handed out all-or-none."""

import numpy as np
import pytest
import torch

from dualpath.errors import HostPoolExhaustedError
from dualpath.kv.host_pool import ALIGN_BYTES, HostPool, round_up


def test_round_up():
    assert [round_up(v, 4096) for v in (1, 4095, 4096, 4097, 8192)] == [4096] * 3 + [8192] * 2


@pytest.mark.parametrize(("payload", "slot"), [(1, 4096), (4096, 4096), (5000, 8192),
                                               (1_474_560, 1_474_560), (1_474_561, 1_478_656)])
def test_slot_bytes_rounded_up_to_4k(payload, slot):
    pool = HostPool(payload, 2, pin=False)
    assert pool.payload_bytes == payload
    assert pool.slot_bytes == slot
    assert pool.nbytes == 2 * slot


def test_slots_are_4k_aligned():
    pool = HostPool(5000, 5, pin=False)
    assert ALIGN_BYTES == 4096
    assert pool.base_address % 4096 == 0
    for slot in range(5):
        assert pool.address(slot) % 4096 == 0
        assert pool.tensor(slot).data_ptr() == pool.address(slot)
        assert np.asarray(pool.buffer(slot)).ctypes.data == pool.address(slot)


def test_slots_do_not_overlap_and_cover_the_slab():
    pool = HostPool(5000, 4, pin=False)
    starts = [pool.address(s) for s in range(4)]
    assert starts == [pool.base_address + s * pool.slot_bytes for s in range(4)]
    end = pool.address(3) + pool.payload_bytes
    assert pool.base_address <= starts[0] and end <= pool.base_address + pool.nbytes
    assert pool.slab.data_ptr() == pool.base_address
    assert pool.slab.is_contiguous()


def test_views_have_payload_size():
    pool = HostPool(5000, 2, pin=False)
    assert pool.tensor(1).numel() == 5000
    assert pool.tensor(1).dtype == torch.uint8
    assert pool.buffer(1).nbytes == 5000
    assert not pool.buffer(1).readonly


def test_alloc_and_free():
    pool = HostPool(4096, 4, pin=False)
    assert pool.num_free == 4
    first = pool.alloc(3)
    assert len(set(first)) == 3 and set(first) <= set(range(4))
    assert pool.num_free == 1
    pool.free(first[:2])
    assert pool.num_free == 3
    again = pool.alloc(3)
    assert len(set(again)) == 3
    assert first[2] not in again
    assert pool.num_free == 0


def test_alloc_is_all_or_none():
    pool = HostPool(4096, 4, pin=False)
    held = pool.alloc(2)
    with pytest.raises(HostPoolExhaustedError):
        pool.alloc(3)
    assert pool.num_free == 2
    rest = pool.alloc(2)
    assert set(held).isdisjoint(rest)


def test_exhausted_message_names_need_and_free_count():
    pool = HostPool(4096, 4, pin=False)
    pool.alloc(3)
    with pytest.raises(HostPoolExhaustedError, match=r"need 5 slots.*\b1 of 4 free"):
        pool.alloc(5)


def test_free_of_a_slot_not_allocated():
    pool = HostPool(4096, 4, pin=False)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([0])
    slots = pool.alloc(1)
    pool.free(slots)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(slots)  # a double free
    assert pool.num_free == 4


def test_buffer_and_tensor_share_memory():
    pool = HostPool(5000, 3, pin=False)
    pool.tensor(1).fill_(0)
    pool.buffer(1)[:4] = b"\x01\x02\x03\x04"
    assert pool.tensor(1)[:4].tolist() == [1, 2, 3, 4]
    pool.tensor(1)[-1] = 9
    assert pool.buffer(1)[-1] == 9


def test_slots_are_independent():
    pool = HostPool(5000, 3, pin=False)
    for slot in range(3):
        pool.tensor(slot).fill_(slot + 1)
    for slot in range(3):
        assert bytes(pool.buffer(slot)) == bytes([slot + 1]) * 5000
    slab = pool.slab.numpy()
    assert (slab[pool.slot_bytes : pool.slot_bytes + 5000] == 2).all()


def test_unpinned_pool_on_cpu():
    pool = HostPool(4096, 2, pin=False)
    assert pool.pinned is False
    assert pool.slab.device.type == "cpu"
    assert not pool.slab.is_pinned()


def test_default_does_not_pin_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("pins when CUDA is present")
    pool = HostPool(4096, 1)
    assert not pool.pinned


@pytest.mark.parametrize(("payload", "slots"), [(0, 1), (4096, 0), (-1, 1), (4096, -2)])
def test_rejects_non_positive_sizes(payload, slots):
    with pytest.raises(ValueError):
        HostPool(payload, slots, pin=False)


def test_a_touched_pool_holds_its_memory_from_the_start():
    """Resident memory of the process grows by about the slab when the pool is touched, and
    by almost nothing when it is not (an anonymous mapping is committed page by page)."""
    import psutil

    def grown_mb(touch: bool) -> float:
        before = psutil.Process().memory_info().rss
        pool = HostPool(1 << 20, 64, pin=False, touch=touch)  # 64 MiB
        grown = (psutil.Process().memory_info().rss - before) / 2**20
        del pool
        return grown

    assert grown_mb(False) < 16
    assert grown_mb(True) > 56


def test_close_unpins_once(monkeypatch):
    import dualpath.kv.host_pool as host_pool

    calls = []
    monkeypatch.setattr(host_pool, "_pin", lambda t: calls.append(("pin", t.data_ptr())) or True)
    monkeypatch.setattr(host_pool, "_unpin",
                        lambda t: calls.append(("unpin", t.data_ptr())) or True)
    pool = HostPool(4096, 2, pin=True)
    assert pool.pinned
    pool.close()
    pool.close()
    assert calls == [("pin", pool.base_address), ("unpin", pool.base_address)]
    assert not pool.pinned
    pool.tensor(0).fill_(1)  # still usable memory, only pageable again


@pytest.mark.gpu
def test_a_cuda_pinned_pool_unpins():
    pool = HostPool(1 << 20, 2, pin=True)
    assert pool.pinned and pool.slab.is_pinned()
    pool.close()
    assert not pool.slab.is_pinned()


def test_columns_view_one_byte_range_of_consecutive_slots():
    pool = HostPool(5000, 4, pin=False)
    for slot in range(4):
        pool.tensor(slot).copy_(torch.arange(5000, dtype=torch.int64).add(slot * 7) % 251)
    cols = pool.columns(1, 2, 100, 30)
    assert cols.shape == (2, 30)
    for row, slot in enumerate((1, 2)):
        assert torch.equal(cols[row], pool.tensor(slot)[100:130])
    cols.fill_(0)  # a view: writes land in the slots
    assert int(pool.tensor(2)[100:130].sum()) == 0 and int(pool.tensor(3)[100:130].sum()) > 0
    with pytest.raises(IndexError, match="slots"):
        pool.columns(3, 2, 0, 10)
    with pytest.raises(IndexError, match="payload"):
        pool.columns(0, 1, 4990, 20)  # past the payload, inside the slot's padding


def test_alloc_hands_out_ascending_slots():
    pool = HostPool(64, 8, pin=False)
    assert pool.alloc(3) == [5, 6, 7]  # from the top, in order: a run maps onto a run
