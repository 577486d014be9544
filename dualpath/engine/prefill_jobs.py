"""The prefill engine's bookkeeping: a request's job (its read, its sequence, its timings) and
the contiguous runs of PE cache blocks a job's sequence takes (``prefill.py``'s worker)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from dualpath.protocol import Prefill
from dualpath.request import Sequence
from dualpath.storage.client import ReadFuture


@dataclass
class PrefillJob:
    msg: Prefill
    slots: list[int] = field(default_factory=list)  # PE host slots of the hit blocks
    read: ReadFuture | None = None
    num_hit_blocks: int = 0
    num_pe_read_blocks: int = 0  # leading hit blocks this PE reads (PE path, split read)
    read_reported: bool = False
    seq: Sequence | None = None  # set when first scheduled; KV in PE cache blocks
    loaded: bool = False  # its hit KV is in the PE cache (first chunk done)
    num_computed_tokens: int = 0  # prompt tokens its forwards computed
    waiting_slots: bool = False  # its read waits for host-pool room
    # monotonic seconds: accepted; its read submitted and verified; its first forward's start
    # and its last forward's end (reported in Prefilled as where the PE's time went)
    accepted_s: float = field(default_factory=time.monotonic)
    read_submitted_s: float | None = None
    read_done_s: float | None = None
    first_forward_s: float | None = None
    last_forward_end_s: float | None = None

    def timings(self) -> dict[str, float]:
        """``wait_s``, ``read_s`` and ``forward_s`` as :class:`Prefilled` carries them."""
        start = self.first_forward_s or self.accepted_s
        end = self.last_forward_end_s or start
        read = 0.0
        if self.read_submitted_s is not None and self.read_done_s is not None:
            read = max(0.0, self.read_done_s - self.read_submitted_s)
        return {"wait_s": max(0.0, start - self.accepted_s - read), "read_s": read,
                "forward_s": max(0.0, end - start)}

    @property
    def ready(self) -> bool:
        return not self.waiting_slots and (self.read is None or self.read.io_done.done())


class BlockRuns:
    """Contiguous runs of PE cache blocks: a request's layer stays one region on the wire."""

    def __init__(self, num_blocks: int) -> None:
        self.free = [True] * num_blocks

    def take(self, count: int) -> list[int] | None:
        run = 0
        for i, free in enumerate(self.free):
            run = run + 1 if free else 0
            if run == count:
                blocks = list(range(i - count + 1, i + 1))
                for b in blocks:
                    self.free[b] = False
                return blocks
        return None

    def give_back(self, blocks: list[int]) -> None:
        for b in blocks:
            self.free[b] = True

    @property
    def num_free(self) -> int:
        return sum(self.free)
