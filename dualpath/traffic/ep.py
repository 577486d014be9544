"""Expert-parallel (EP) traffic generator: MoE all-to-all bytes on the high lane of a dense model.

The paper's latency-critical traffic is MoE dispatch/combine (docs/paper.md §4.1); the testbed
model is dense, so without this nothing would ever send on ``Lane.HIGH`` and the QoS lanes would
never face contention. With ``traffic.ep_bytes_per_token`` > 0 every prefill forward and every
decode step calls :meth:`EpTraffic.exchange` with its token count: the engine writes
``num_tokens × ep_bytes_per_token`` bytes, split evenly over the other engines of its group
(PEs with PEs, DEs with DEs; the router's ``Peers`` names them), into each peer's receive buffer
over the compute NIC on the high lane, and the step waits for all of it, as a MoE layer waits
for its all-to-all. The bytes are scratch: what lands is never read.

One exchange per step, carrying both directions of the all-to-all. In a real MoE each token is
dispatched to its experts' nodes (FP8) and its result combined back (BF16), per MoE layer;
``ModelProfile.a2a_bytes_per_token`` already sums both into the bytes one token puts on its
NIC *each way*, and balanced routing makes what a NIC receives equal what it sends. So one
write of that figure per token, to every peer its share, gives each NIC the real bytes in both
directions (the peers' writes are what it receives). The testbed's step is not split into MoE
layers (the hook runs once per forward or decode step), and splitting the bytes into a dispatch
and a combine write would double the per-submission cost without changing the bytes. The cost
of that choice: a real step makes ``2 × moe_layers`` synchronised exchanges, each of which can
queue behind KV traffic on a FIFO link, where this makes one; so the inflation it measures
under a FIFO link is a lower bound of the real one (the lanes' point stands a fortiori).

Only this engine's sends are waited for (one-sided writes); what peers write here is charged
to this engine's receive side by the traffic manager, not awaited.

A peer that fails, or does not finish within ``timeout_s``, never fails the step or hangs the
engine: the step goes on without it, ``ep_failed_exchanges`` counts it, and the peer is left
out of exchanges for ``retry_s`` (or until the router's next ``Peers`` names it afresh).

Buffer: one host region per engine, registered with the traffic manager, both the source of
this engine's writes and the target of its peers' (scratch both ways). It is sized for the
largest step, ``max_step_tokens × ep_bytes_per_token``, rounded up to 4 KiB and bounded by
``EP_BUFFER_MAX_BYTES`` (64 MiB); a share larger than the sender's or the receiver's buffer is
written as several segments onto the same region.

## Deriving ``ep_bytes_per_token``

For a real MoE model, the bytes one token puts on its GPU's compute NIC each way
(``sim/profiles.py``, ``ModelProfile.a2a_bytes_per_token``): per MoE layer and remote node
reached, one FP8 dispatch (``hidden`` bytes + a 4-byte scale per 128 values) plus one BF16
combine (``2 × hidden``); a token's ``k`` of ``E`` experts reach
``N × (1 − C(E − E/N, k) / C(E, k))`` of the ``N`` nodes of the EP group on average (at most
``node_limit``), ``(N − 1)/N`` of them remote::

    ep_bytes_per_token = moe_layers × (3·hidden + hidden/128·4) × nodes_reached × (N − 1)/N

DeepSeek-V3.2 (58 MoE layers, hidden 7,168, 8 of 256 experts, at most 4 nodes per token):
1,255,826 B/token over a 2-node EP group, 3,416,040 B over 4 nodes (the paper's 2P4D: the PEs'
and the DEs' groups).

The real bytes would swamp the testbed: its decode moves ~130–290 tokens/s through a
compute NIC capped at a few hundred MB/s (a Hopper GPU: ~750 through 50 GB/s), and 131
tokens/s × 3.4 MB is 450 MB/s, more than the whole capped NIC. Keep instead the *fraction of
the compute NIC that EP takes*, ``u = tokens/s × bytes/token / NIC bandwidth`` — the share of
each step the NIC spends on the all-to-all:

* real: the simulator's DS-V3.2 2P4D on Hopper (``SimConfig`` defaults, 50 GB/s NICs, 32K
  context) decodes 64 requests per GPU in 85.8 ms, 746 tokens/s × 3.42 MB = 2.55 GB/s,
  **u ≈ 5.1%** (2.1% at batch 16, 8.0% at 256); a prefill GPU computes ≈ 1,678 tokens/s ×
  1.26 MB = 2.1 GB/s, u ≈ 4.2%;
* testbed: ``ep_bytes_per_token = u × cap / (tokens/s)``. SmolLM2-135M on one core decodes
  ≈ 131 tokens/s at batch 8 (61 ms steps) and ≈ 289 at batch 32 (docs/results.md, ``dualpath bench
  engine``; ``dualpath profile`` gives a machine's ``decode_step_ms = (base, per_seq)``, and
  tokens/s at batch b = 1000·b / (base + per_seq·b)). With a 200 MB/s compute-NIC cap and
  u = 5%: 0.05 × 200e6 / 131 = 76 KB and 0.05 × 200e6 / 289 = 35 KB.

**Proposed testbed value: 49,152 B (48 KiB) with 200 MB/s compute-NIC caps** — about 250 B per
MB/s of cap (32 KiB at the demo's 128 MB/s). Then u = 131 × 49,152 / 200e6 = 3.2% at batch 8
and 7.1% at batch 32, bracketing the real 5.1% as the real 2–8% spans its batches; a batch-8
step writes 393 KB, 2.0 ms of its 61 ms at the cap. A PE group (two or more PEs) would see
536 tokens/s × 48 KiB ≈ 26 MB/s, 13% (above the real 4.2%: the CPU prefills relatively faster
than it decodes); with one PE it has no peers and sends nothing.
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
