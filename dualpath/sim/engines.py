"""Simulated engine state: a prefill engine's queue, a decode engine's batch and KV reservations.

The counters are what the engine reports to the scheduler (``seq``, ``tok``, free KV); the
scheduler itself lives in :mod:`dualpath.scheduler` and is not re-implemented here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from dualpath.sim.links import DuplexNic, LockstepGroup, RateGroup


class Job:
    """One request on a PE: tokens computed (``cached``) and ``remaining``, its DE and turn,
    KV tokens it holds in PE HBM (Basic), hit tokens the DE already holds (DE read path), hit
    tokens still to read before its forward (Basic with reads in the round), hit tokens in
    the PE node's DRAM staging buffer (PE read path, layerwise modes), and hit tokens still
    to copy into PE HBM from the PE node's DRAM (``h2d_pe``) or the DE node's (``h2d_de``)."""

    __slots__ = ("cached", "de", "de_holds", "h2d_de", "h2d_pe", "hbm", "remaining", "rid",
                 "staged", "turn", "unread")

    def __init__(self, rid: int, turn: Any, de: DecodeEngine, *, de_holds: int = 0,
                 hbm: int = 0, unread: int = 0, staged: int = 0, h2d_pe: int = 0) -> None:
        self.rid, self.turn, self.de = rid, turn, de
        self.cached, self.remaining = turn.hit, turn.miss
        self.de_holds, self.hbm, self.unread = de_holds, hbm, unread
        self.staged = staged  # hit tokens in the PE node's DRAM staging buffer
        self.h2d_pe, self.h2d_de = h2d_pe, de_holds


class _Engine:
    """What every simulated engine reports: ``seq`` and ``tok``, and its cached view."""

    def __init__(self, name: str, node: int, group: str, kv_capacity: int,
                 nic: DuplexNic) -> None:
        self.name, self.node, self.group = name, node, group
        self.capacity = kv_capacity
        self.nic = nic  # this GPU's compute NIC
        self.seq = 0
        self.tok = 0
        self.view: Any = None  # the scheduler's last view of this engine (None: changed)
        self.dirty_set: set[Any] | None = None  # where the simulator collects changed groups
        self.dirty_key: Any = None  # this engine's entry there

    def _count(self, requests: int, tokens: int) -> None:
        self.seq += requests
        self.tok += tokens
        self.view = None
        if self.dirty_set is not None:
            self.dirty_set.add(self.dirty_key)


class PrefillEngine(_Engine):
    """One PE: its FIFO of :class:`Job`, its EP group, and (Basic) its HBM admission queue."""

    def __init__(self, name: str, node: int, group: str, kv_capacity: int,
                 nic: DuplexNic) -> None:
        super().__init__(name, node, group, kv_capacity, nic)
        self.free_kv = kv_capacity  # reported; the scheduler does not read it for PEs
        self.fifo: list[Job] = []
        self.ep = 0  # index of its EP group (forwards run in lock step within it)
        self.admit: deque[Job] = deque()  # Basic: waiting for HBM to read into
        self.hbm_used = 0  # Basic: KV tokens held in HBM (read, prefilled or being sent)

    def assign(self, prompt: int) -> None:
        """A request was placed here."""
        self._count(1, prompt)

    def finish(self, prompt: int) -> None:
        """Its prefill finished."""
        self._count(-1, -prompt)


class DecodeEngine(_Engine):
    """One DE: reserved KV tokens; its running requests step in ``stepper`` — its own
    :class:`RateGroup`, or the :class:`LockstepGroup` of its EP group."""

    def __init__(self, name: str, node: int, group: str, kv_capacity: int, nic: DuplexNic,
                 stepper: RateGroup | LockstepGroup) -> None:
        super().__init__(name, node, group, kv_capacity, nic)
        self.reserved = 0
        self.stepper = stepper

    @property
    def free_kv(self) -> int:
        """KV tokens free for new requests."""
        return max(0, self.capacity - self.reserved)

    def reserve(self, prompt: int, gen: int) -> None:
        """A request was placed here: hold its prompt and generated tokens."""
        self.reserved += prompt + gen
        self._count(1, prompt)

    def decode(self, gen: int, on_done: Callable[[], None], context: int = 0) -> None:
        """Generate ``gen`` tokens with the running batch (``context``: the request's KV
        tokens, which a lock-step group's step time depends on)."""
        if isinstance(self.stepper, LockstepGroup):
            self.stepper.start_for(self.name, gen, on_done, tokens=context)
        else:
            self.stepper.start(gen, on_done)

    def running(self) -> tuple[int, float]:
        """Running requests and the current step time (s) they advance at."""
        if isinstance(self.stepper, LockstepGroup):
            return self.stepper.batch(self.name), self.stepper.step_s()
        batch = len(self.stepper)
        return batch, self.stepper.step_time(max(1, batch))

    def release(self, prompt: int, gen: int) -> None:
        """The request finished decoding."""
        self.reserved -= prompt + gen
        self._count(-1, -prompt)
