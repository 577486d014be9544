"""Expert-parallel (EP) traffic generator: MoE all-to-all bytes on the high lane of a dense model.

The paper's latency-critical traffic is MoE dispatch/combine (docs/paper.md §4.1). With
``traffic.ep_bytes_per_token`` > 0 every prefill forward and every decode step calls
:meth:`EpTraffic.exchange` with its token count: the engine writes ``num_tokens ×
ep_bytes_per_token`` scratch bytes, split evenly over the other engines of its group (PEs with
PEs, DEs with DEs; the router's ``Peers`` names them), into each peer's receive buffer over the
compute NIC on the high lane — one exchange per step, carrying both directions — and the step
waits for its own (one-sided) sends; what peers write here is charged by the traffic manager,
not awaited. A peer that fails or exceeds ``timeout_s`` never fails the step: it is counted in
``ep_failed_exchanges`` and left out for ``retry_s`` (or until the next ``Peers`` names it).
Buffer: one registered host region per engine, source and target alike, of ``max_step_tokens ×
ep_bytes_per_token`` rounded up to 4 KiB, at most ``EP_BUFFER_MAX_BYTES`` (64 MiB); a larger
share is written as several segments.

Derivation (one exchange per step; the value of ``ep_bytes_per_token``): docs/derivations.md,
'traffic/ep.py'.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, wait
from dataclasses import dataclass

from dualpath.traffic.lanes import Lane
from dualpath.traffic.manager import TrafficManager
from dualpath.transfer.base import Segment

log = logging.getLogger("dualpath.ep")
EP_BUFFER_MAX_BYTES = 64 << 20  # a step's share beyond this wraps around the region
EP_BUFFER_ALIGN = 4096


@dataclass(frozen=True)
class EpPeer:
    """Another engine of this engine's EP group: where to write its share."""

    name: str
    endpoint: str  # transfer-backend address
    buffer_addr: int  # its registered EP receive buffer
    buffer_bytes: int


def ep_buffer_bytes(bytes_per_token: int, max_step_tokens: int) -> int:
    """Size of an EP buffer: the largest step's bytes, 4 KiB aligned, at most 64 MiB."""
    if bytes_per_token <= 0 or max_step_tokens <= 0:
        raise ValueError("bytes_per_token and max_step_tokens must be > 0, got "
                         f"{bytes_per_token} and {max_step_tokens}")
    wanted = -(-bytes_per_token * max_step_tokens // EP_BUFFER_ALIGN) * EP_BUFFER_ALIGN
    return min(EP_BUFFER_MAX_BYTES, wanted)


class EpTraffic:
    """One engine's EP all-to-all: its buffer, its peers, and the exchange each step waits for.

    Not thread-safe: the engine's loop thread makes every call (the step hook, ``Peers``,
    metrics). The buffer lives as long as this object; peers may write into it until they
    learn this engine is gone, so keep the object for the life of the process.
    """

    def __init__(self, traffic: TrafficManager, bytes_per_token: int, max_step_tokens: int,
                 timeout_s: float = 5.0, retry_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if timeout_s <= 0 or retry_s < 0:
            raise ValueError(f"timeout_s must be > 0 and retry_s >= 0, got {timeout_s}, "
                             f"{retry_s}")
        self.traffic = traffic
        self.bytes_per_token = bytes_per_token
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._clock = clock
        nbytes = ep_buffer_bytes(bytes_per_token, max_step_tokens)
        self._map = mmap.mmap(-1, nbytes)  # page aligned; freed with this object
        self._cbuf = (ctypes.c_char * nbytes).from_buffer(self._map)
        self.buffer_addr = ctypes.addressof(self._cbuf)
        self.buffer_bytes = nbytes
        traffic.register(self.buffer_addr, nbytes)
        self._peers: dict[str, EpPeer] = {}
        self._benched: dict[str, float] = {}  # peer name -> when to try it again
        self.bytes_sent = 0
        self.tokens = 0  # tokens of the steps that exchanged with at least one peer
        self.exchanges = 0
        self.failed_exchanges = 0  # peer shares that failed or timed out
        self.wait_s_total = 0.0

    @property
    def peers(self) -> tuple[str, ...]:
        """Names of the peers an exchange would write to now (benched ones left out)."""
        now = self._clock()
        return tuple(n for n in self._peers if self._benched.get(n, 0.0) <= now)

    def view(self) -> memoryview:
        """The buffer's bytes (scratch; for tests and debugging)."""
        return memoryview(self._map)

    def set_peers(self, peers: Iterable[EpPeer]) -> None:
        """The engines of this engine's group (itself excluded); replaces the previous list.

        A peer that is new, or whose entry changed (it rejoined), is tried at once even if it
        was benched; peers without a buffer (EP traffic off there) are left out.
        """
        fresh = {p.name: p for p in peers if p.buffer_addr > 0 and p.buffer_bytes > 0}
        for name, peer in fresh.items():
            if self._peers.get(name) != peer:
                self._benched.pop(name, None)
        self._benched = {n: t for n, t in self._benched.items() if n in fresh}
        self._peers = fresh

    def exchange(self, num_tokens: int) -> int:
        """Write ``num_tokens × bytes_per_token`` bytes, split evenly over the peers, on the
        high lane, and wait for every share (at most ``timeout_s``). Returns the bytes that
        arrived; never raises: a peer that fails is counted and benched."""
        peers = [self._peers[n] for n in self.peers]
        total = num_tokens * self.bytes_per_token
        if not peers or total <= 0:
            return 0
        started = self._clock()
        pending: dict[Future[None], tuple[EpPeer, int]] = {}
        base, extra = divmod(total, len(peers))
        for i, peer in enumerate(peers):
            share = base + (1 if i < extra else 0)
            if share == 0:
                continue
            try:
                future = self.traffic.submit("write", peer.endpoint, self._segments(peer, share),
                                             Lane.HIGH)
            except Exception as exc:  # a closed traffic manager, a bad address: skip the peer
                self._bench(peer, exc)
                continue
            pending[future] = (peer, share)
        done, late = wait(pending, timeout=self.timeout_s)
        sent = 0
        for future in done:
            peer, share = pending[future]
            exc = future.exception()
            if exc is None:
                sent += share
            else:
                self._bench(peer, exc)
        for future in late:
            self._bench(pending[future][0], TimeoutError(f"not done in {self.timeout_s:g} s"))
        if sent:
            self.exchanges += 1
            self.tokens += num_tokens
            self.bytes_sent += sent
        self.wait_s_total += self._clock() - started
        return sent

    def metrics(self) -> dict[str, float | int]:
        """``ep_*`` counters: bytes sent, exchanges, tokens, failed peer shares, wait, peers."""
        return {"ep_bytes_sent": self.bytes_sent, "ep_exchanges": self.exchanges,
                "ep_tokens": self.tokens, "ep_failed_exchanges": self.failed_exchanges,
                "ep_wait_s_total": self.wait_s_total, "ep_peers": len(self.peers)}

    def _segments(self, peer: EpPeer, share: int) -> list[Segment]:
        """``share`` bytes from the start of this buffer onto the start of the peer's, in
        pieces no larger than either buffer."""
        piece = min(self.buffer_bytes, peer.buffer_bytes)
        return [(self.buffer_addr, peer.buffer_addr, min(piece, share - offset))
                for offset in range(0, share, piece)]

    def _bench(self, peer: EpPeer, exc: BaseException) -> None:
        self.failed_exchanges += 1
        self._benched[peer.name] = self._clock() + self.retry_s
        log.warning("EP exchange with %s (%s) failed: %s; leaving it out for %g s", peer.name,
                    peer.endpoint, exc, self.retry_s)


def ep_metrics_off() -> dict[str, float | int]:
    """The ``ep_*`` counters of an engine without EP traffic (all zero)."""
    return {"ep_bytes_sent": 0, "ep_exchanges": 0, "ep_tokens": 0, "ep_failed_exchanges": 0,
            "ep_wait_s_total": 0.0, "ep_peers": 0}
