"""The transfer backend interface: registered memory regions and batched one-sided copies.

A backend moves bytes between memory registered on this side and memory registered on a peer
backend, named by the peer's ``endpoint``. ``write`` copies local → remote, ``read`` copies
remote → local; both take a batch of segments and submit them together, because many small
segments in one submission cost far less than one call per segment.

``start_write``/``start_read`` are the same calls without the wait: they return a
``PendingTransfer`` that the caller polls, so one thread can keep several transfers in flight
(the traffic manager's NIC directions do). A backend without an asynchronous API inherits
versions that move the bytes before they return.
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from collections.abc import Sequence

from dualpath.errors import TransferError

Segment = tuple[int, int, int]
"""One contiguous copy: ``(local_addr, remote_addr, nbytes)``."""


class PendingTransfer(ABC):
    """A transfer that ``start_write``/``start_read`` started: poll it until it has landed."""

    @abstractmethod
    def poll(self) -> bool:
        """Whether every segment has landed, without waiting.

        Raises ``TransferError`` once every segment has settled and any failed (nothing of the
        transfer still moves then). After True or an error, the transfer is over.
        """


class Landed(PendingTransfer):
    """A transfer that had moved all its bytes before it was returned."""

    def poll(self) -> bool:
        """Always True."""
        return True


LANDED = Landed()


class TransferBackend(ABC):
    """One endpoint of the data plane (one per engine process)."""

    endpoint: str
    """The name peers pass to ``write``/``read`` to reach this backend."""

    @abstractmethod
    def register(self, address: int, nbytes: int) -> None:
        """Make ``[address, address + nbytes)`` of this process reachable; call once per region."""

    @abstractmethod
    def write(self, peer: str, segments: Sequence[Segment]) -> None:
        """Copy each segment local → remote in one batched submission; wait for all of it.

        Raises ``TransferError`` if any segment fails (the others may have landed).
        """

    @abstractmethod
    def read(self, peer: str, segments: Sequence[Segment]) -> None:
        """Copy each segment remote → local in one batched submission; wait for all of it.

        Raises ``TransferError`` if any segment fails (the others may have landed).
        """

    def start_write(self, peer: str, segments: Sequence[Segment]) -> PendingTransfer:
        """``write`` without the wait: poll the result until it has landed.

        This default moves the bytes before it returns (a backend with an asynchronous API
        overrides it). Raises ``TransferError`` if the transfer cannot start.
        """
        self.write(peer, segments)
        return LANDED

    def start_read(self, peer: str, segments: Sequence[Segment]) -> PendingTransfer:
        """``read`` without the wait; as ``start_write``."""
        self.read(peer, segments)
        return LANDED

    @abstractmethod
    def close(self) -> None:
        """Release the registered regions and stop serving peers."""

    def __enter__(self) -> TransferBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RegionSet:
    """Non-overlapping registered address ranges, with containment checks."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []

    def add(self, address: int, nbytes: int) -> bool:
        """Add a region; False if exactly this region is already there (a no-op).

        Raises ``TransferError`` for an empty, negative or partly overlapping region.
        """
        if address <= 0 or nbytes <= 0:
            raise TransferError(f"cannot register {nbytes} bytes at {address:#x}")
        i = bisect.bisect_right(self._starts, address)
        if i > 0 and self._starts[i - 1] == address and self._ends[i - 1] == address + nbytes:
            return False
        overlaps_left = i > 0 and self._ends[i - 1] > address
        overlaps_right = i < len(self._starts) and self._starts[i] < address + nbytes
        if overlaps_left or overlaps_right:
            raise TransferError(f"region {address:#x}+{nbytes} overlaps a registered one")
        self._starts.insert(i, address)
        self._ends.insert(i, address + nbytes)
        return True

    def contains(self, address: int, nbytes: int) -> bool:
        """Whether ``[address, address + nbytes)`` lies inside one registered region."""
        i = bisect.bisect_right(self._starts, address) - 1
        return i >= 0 and nbytes >= 0 and address + nbytes <= self._ends[i]

    def check(self, address: int, nbytes: int, side: str) -> None:
        """Raise ``TransferError`` unless the range lies inside one registered region."""
        if not self.contains(address, nbytes):
            raise TransferError(f"{side} range {address:#x}+{nbytes} is not inside a "
                                "registered region")

    def remove(self, address: int) -> None:
        """Forget the region that starts at ``address`` (no-op if there is none)."""
        i = bisect.bisect_left(self._starts, address)
        if i < len(self._starts) and self._starts[i] == address:
            del self._starts[i], self._ends[i]

    def regions(self) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of every region, by address."""
        return [(s, e - s) for s, e in zip(self._starts, self._ends, strict=True)]

    def clear(self) -> None:
        """Forget every region."""
        self._starts.clear()
        self._ends.clear()
