"""The engine's host DRAM buffer: one preallocated slab cut into fixed-size slots.

Slots are 4 KiB aligned (O_DIRECT reads land in them directly) and the slab is pinned when
CUDA is present. The slab is one contiguous region, so a transfer engine registers it once
(``base_address`` and ``nbytes``).
"""

from __future__ import annotations

import mmap
from collections import deque

import torch

from dualpath.errors import HostPoolExhaustedError

ALIGN_BYTES = 4096


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``value``."""
    return -(-value // multiple) * multiple


def _pin(tensor: torch.Tensor) -> bool:
    """Page-lock ``tensor``'s memory for fast, async device copies (CUDA only)."""
    result = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel(), 0)
    return int(result) == 0


class HostPool:
    """``num_slots`` slots of ``payload_bytes`` each (slots padded to 4 KiB)."""

    def __init__(self, payload_bytes: int, num_slots: int, pin: bool | None = None) -> None:
        if payload_bytes <= 0 or num_slots <= 0:
            raise ValueError("payload_bytes and num_slots must be positive")
        self.payload_bytes = payload_bytes
        self.slot_bytes = round_up(payload_bytes, ALIGN_BYTES)
        self.num_slots = num_slots
        pin = torch.cuda.is_available() if pin is None else pin
        # An anonymous mapping: page aligned, and measurably faster as an O_DIRECT target
        # than torch's own allocation (2.4 vs 1.7 GB/s here).
        self._map = mmap.mmap(-1, self.slot_bytes * num_slots)
        self.slab = torch.frombuffer(self._map, dtype=torch.uint8)
        self.pinned = pin and _pin(self.slab)
        self._free: deque[int] = deque(range(num_slots))
        self._in_use: set[int] = set()

    @property
    def base_address(self) -> int:
        """Address of the slab (what a transfer engine registers)."""
        return self.slab.data_ptr()

    @property
    def nbytes(self) -> int:
        """Size of the slab."""
        return self.slab.numel()

    @property
    def num_free(self) -> int:
        """Slots not handed out."""
        return len(self._free)

    def alloc(self, count: int) -> list[int]:
        """Take ``count`` slots, all or none."""
        if count > len(self._free):
            raise HostPoolExhaustedError(
                f"host buffer exhausted: need {count} slots of {self.payload_bytes} bytes, "
                f"{len(self._free)} of {self.num_slots} free "
                f"({self.nbytes / 2**20:.0f} MiB slab); enlarge the host pool or wait"
            )
        slots = [self._free.popleft() for _ in range(count)]
        self._in_use.update(slots)
        return slots

    def free(self, slots: list[int]) -> None:
        """Return slots to the pool."""
        for slot in slots:
            if slot not in self._in_use:
                raise ValueError(f"slot {slot} is not allocated")
            self._in_use.remove(slot)
            self._free.append(slot)

    def tensor(self, slot: int) -> torch.Tensor:
        """The slot's payload as a uint8 tensor view (no copy)."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")
        start = slot * self.slot_bytes
        return self.slab[start : start + self.payload_bytes]

    def buffer(self, slot: int) -> memoryview:
        """The slot's payload as a writable memoryview (no copy)."""
        return memoryview(self.tensor(slot).numpy())

    def address(self, slot: int) -> int:
        """Address of the slot's first byte."""
        return self.base_address + slot * self.slot_bytes
