"""Simulated engine state: a prefill engine's queue, a decode engine's batch and KV reservations.

The counters are what the engine reports to the scheduler (``seq``, ``tok``, free KV); the
scheduler itself lives in :mod:`dualpath.scheduler` and is not re-implemented here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dualpath.sim.events import EventLoop
from dualpath.sim.links import Link, RateGroup


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
        self.busy = False

    def assign(self, prompt: int) -> None:
        """A request was placed here."""
        self.seq += 1
        self.tok += prompt

    def finish(self, prompt: int) -> None:
        """Its prefill finished."""
        self.seq -= 1
        self.tok -= prompt


class DecodeEngine:
    """One DE: reserved KV tokens and a :class:`RateGroup` of running requests."""

    def __init__(self, name: str, node: int, group: str, kv_capacity: int, cnic: Link,
                 loop: EventLoop, step_s: Callable[[int], float]) -> None:
        self.name, self.node, self.group = name, node, group
        self.capacity = kv_capacity
        self.cnic = cnic
        self.seq = 0
        self.tok = 0
        self.reserved = 0
        self.running = RateGroup(loop, step_s, name)

    @property
    def free_kv(self) -> int:
        """KV tokens free for new requests."""
        return max(0, self.capacity - self.reserved)

    def reserve(self, prompt: int, gen: int) -> None:
        """A request was placed here: hold its prompt and generated tokens."""
        self.seq += 1
        self.tok += prompt
        self.reserved += prompt + gen

    def decode(self, gen: int, on_done: Callable[[], None]) -> None:
        """Generate ``gen`` tokens with the running batch."""
        self.running.start(gen, on_done)

    def release(self, prompt: int, gen: int) -> None:
        """The request finished decoding."""
        self.seq -= 1
        self.tok -= prompt
        self.reserved -= prompt + gen
