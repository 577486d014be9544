"""Simulated engine state: a prefill engine's queue, a decode engine's batch and KV reservations.

The counters are what the engine reports to the scheduler (``seq``, ``tok``, free KV); the
scheduler itself lives in :mod:`dualpath.scheduler` and is not re-implemented here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dualpath.sim.links import Link, LockstepGroup, RateGroup


class PrefillEngine:
    """One PE: FIFO of requests ``[rid, cached, remaining, de, turn, unread]``, busy flag.

    ``unread`` is the hit KV still to load (Basic loads it in the forward's read phase).
    """

    def __init__(self, name: str, node: int, group: str, kv_capacity: int, cnic: Link) -> None:
        self.name, self.node, self.group = name, node, group
        self.capacity = kv_capacity
        self.cnic = cnic
        self.seq = 0
        self.tok = 0
        self.free_kv = kv_capacity  # reported; the scheduler does not read it for PEs
        self.fifo: list[list[Any]] = []
        self.ep = 0  # index of its EP group (forwards run in lock step within it)
        self.view: Any = None  # the scheduler's last view of this engine (None: changed)

    def assign(self, prompt: int) -> None:
        """A request was placed here."""
        self.seq += 1
        self.tok += prompt
        self.view = None

    def finish(self, prompt: int) -> None:
        """Its prefill finished."""
        self.seq -= 1
        self.tok -= prompt
        self.view = None


class DecodeEngine:
    """One DE: reserved KV tokens; its running requests step in ``stepper`` — its own
    :class:`RateGroup`, or the :class:`LockstepGroup` of its EP group."""

    def __init__(self, name: str, node: int, group: str, kv_capacity: int, cnic: Link,
                 stepper: RateGroup | LockstepGroup) -> None:
        self.name, self.node, self.group = name, node, group
        self.capacity = kv_capacity
        self.cnic = cnic
        self.seq = 0
        self.tok = 0
        self.reserved = 0
        self.stepper = stepper
        self.view: Any = None  # the scheduler's last view of this engine (None: changed)

    @property
    def free_kv(self) -> int:
        """KV tokens free for new requests."""
        return max(0, self.capacity - self.reserved)

    def reserve(self, prompt: int, gen: int) -> None:
        """A request was placed here: hold its prompt and generated tokens."""
        self.seq += 1
        self.tok += prompt
        self.reserved += prompt + gen
        self.view = None

    def decode(self, gen: int, on_done: Callable[[], None]) -> None:
        """Generate ``gen`` tokens with the running batch."""
        if isinstance(self.stepper, LockstepGroup):
            self.stepper.start_for(self.name, gen, on_done)
        else:
            self.stepper.start(gen, on_done)

    def release(self, prompt: int, gen: int) -> None:
        """The request finished decoding."""
        self.seq -= 1
        self.tok -= prompt
        self.reserved -= prompt + gen
        self.view = None
