"""Each node's storage reads: its storage NIC, the read queue the scheduler sees, the order
reads start in, and the DRAM staging buffer of layerwise reads.

A read of ``tokens`` joins its node's read queue (the ``read_q`` of docs/paper.md §5, reported in
the scheduler's :class:`NodeView`) when its path is chosen and leaves it when its last byte has
arrived. Reads start in FIFO order, ``read_streams`` at a time (``None``: all at once), and
share the storage NIC equally while in flight. A staged read (layerwise modes) also needs
room in the node's DRAM staging buffer, which the simulator gives back with :meth:`unstage`.
Each read lands in the node's DRAM (:meth:`Hops.into_dram`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from dualpath.scheduler import NodeView
from dualpath.sim.events import EventLoop
from dualpath.sim.hops import Hops
from dualpath.sim.links import Link


class StorageReads:
    """The storage reads of ``nodes`` nodes (``snic_bps`` of goodput each)."""

    def __init__(self, loop: EventLoop, hops: Hops, nodes: int, snic_bps: float,
                 read_streams: int | None, buffer_tokens: int | None) -> None:
        self.loop, self.hops, self.kvb = loop, hops, hops.kvb
        self.snic = [Link(loop, snic_bps, f"snic{n}") for n in range(nodes)]
        self.read_streams = read_streams
        self.queued = [0] * nodes  # tokens in each node's read queue
        self.active = [0] * nodes  # reads in flight
        self.buffer_tokens = buffer_tokens  # staging buffer per node (None: unbounded)
        self.buffer_free = None if buffer_tokens is None else [buffer_tokens] * nodes
        self._waiting: list[deque[tuple[int, Callable[[], None], bool]]] = [
            deque() for _ in range(nodes)]  # (tokens, then, staged) in FIFO order
        self._dirty: set[int] = set()  # nodes whose queue changed since the last view
        self._views = [NodeView(n, 0) for n in range(nodes)]

    def queue(self, node: int, tokens: int) -> None:
        """``tokens`` join (or, negative, leave) ``node``'s read queue."""
        self.queued[node] += tokens
        self._dirty.add(node)

    def staged(self, node: int, tokens: int, then: Callable[[], None]) -> None:
        """Queue and read ``tokens`` into ``node``'s staging buffer; ``then`` once read."""
        self.queue(node, tokens)
        self._enqueue(node, tokens, then, staged=True)

    def read(self, node: int, tokens: int, then: Callable[[], None]) -> None:
        """Read ``tokens`` already :meth:`queue`\\ d (Basic: outside the staging buffer)."""
        self._enqueue(node, tokens, then, staged=False)

    def unstage(self, node: int, tokens: int) -> None:
        """Give ``tokens`` of ``node``'s staging buffer back."""
        if self.buffer_free is not None and tokens:
            self.buffer_free[node] += tokens
            self._pump(node)

    def node_views(self) -> tuple[NodeView, ...]:
        """The read queues as the scheduler sees them (rebuilt only where they changed)."""
        views = self._views
        for n in self._dirty:
            if views[n].read_queue_tokens != self.queued[n]:
                views[n] = NodeView(n, self.queued[n])
        self._dirty.clear()
        return tuple(views)

    def _enqueue(self, node: int, tokens: int, then: Callable[[], None], staged: bool) -> None:
        self._waiting[node].append((tokens, then, staged))
        self._pump(node)

    def _pump(self, node: int) -> None:
        """Start queued reads in FIFO order while fewer than ``read_streams`` are in flight
        and, for staged reads, the buffer has room (a read larger than it goes alone)."""
        waiting, limit, free = self._waiting[node], self.read_streams, self.buffer_free
        while waiting and (limit is None or self.active[node] < limit):
            tokens, then, staged = waiting[0]
            if staged and free is not None:
                if tokens > free[node] and free[node] != self.buffer_tokens:
                    return
                free[node] -= tokens
            waiting.popleft()
            self.active[node] += 1
            written = self.hops.into_dram(node, tokens, self.loop.now)
            self.snic[node].transfer(tokens * self.kvb, lambda t=tokens, f=then, w=written:
                                     self._done(node, t, f, w))

    def _done(self, node: int, tokens: int, then: Callable[[], None], written: float) -> None:
        self.queue(node, -tokens)
        self.active[node] -= 1
        self._pump(node)
        self.loop.when(written, then)
