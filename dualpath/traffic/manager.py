"""The traffic manager: every byte an engine moves goes through it, on a QoS lane.

Transfers to and from peer engines are split into chunks (``chunk_bytes`` on the high lane,
``kv_chunk_bytes`` on the KV lanes), host↔device copies into pieces of the same size
(docs/paper.md §4.2). Each direction of the compute NIC has one dispatcher thread
(``nic_queues.NicDirection``) with a queue per lane: the ``LaneArbiter`` picks the next lane
(``qos_lanes=False``: one FIFO), a token bucket paces chunks when the NIC is capped, and up to
``inflight_chunks`` chunks are in flight per direction. ``submit``/``submit_copy`` return a
future at once and may wait for another future (``after``) before their chunks queue. A capped
manager runs a grant server (``nic_address``) and, told a peer's (``set_peer_nic``), asks it for
a grant before each chunk (``nic_grants``, ``nic_grant_client``); uncapped pairs make no RPC.
With its engine's ``keys`` both ends of a grant are CURVE-authenticated: the server admits the
peers ``admit_peers`` names, the client presents the engine's key (``traffic/peer_auth.py``).

``metrics()`` keys: ``cnic_{side}_*`` (bytes, passive, lane, total, queue, utilization, peak),
``lane_bytes_{lane}``, ``h2d_bytes``/``d2h_bytes``, ``copy_bytes_{lane}``, ``cnic_dropped_grants``,
``unpaced_peer_chunks``, ``grant_timeouts``.

The lanes' design and every metric key defined: docs/derivations.md, 'traffic/manager.py'.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

from dualpath.config import TrafficConfig
from dualpath.errors import TransferError
from dualpath.traffic.chunks import coalesce, split_chunks, validated
from dualpath.traffic.copies import (
    CopyIssue,
    PieceCopier,
    copy_pieces,
    group_pieces,
    submission_context,
)
from dualpath.traffic.grant_client import GrantClient, PendingGrant
from dualpath.traffic.grants import GrantServer, log
from dualpath.traffic.lanes import Lane, weights_from_pairs
from dualpath.traffic.queues import NicDirection, direction_metrics
from dualpath.traffic.token_bucket import TokenBucket
from dualpath.traffic.work import CopyWork, LiveSubmissions, MoveWork, Submission, Work
from dualpath.transfer.base import Segment, TransferBackend

if TYPE_CHECKING:
    from dualpath.control_keys import KeyPair

__all__ = ["CopyDirection", "TrafficManager", "TransferKind", "coalesce", "split_chunks"]

TransferKind = Literal["write", "read"]
CopyDirection = Literal["h2d", "d2h"]
_NIC_SIDE: dict[str, str] = {"write": "send", "read": "recv", "d2h": "send", "h2d": "recv"}
_OPPOSITE = {"send": "recv", "recv": "send"}


class TrafficManager:
    """An engine's data movement: lanes, chunking, compute-NIC caps (both ends) and counters.

    ``nic_host`` is the address a capped manager's grant server binds (peers must reach it);
    ``keys``, its engine's CURVE pair, authenticate its grant sockets (without them the server
    binds loopback only). Returned futures complete on a dispatcher thread or a NIC direction's
    poller thread: their callbacks must not wait on this manager (chain with ``after=``
    instead).
    """

    def __init__(self, backend: TransferBackend | None, config: TrafficConfig | None = None,
                 clock: Callable[[], float] = time.monotonic, nic_host: str = "127.0.0.1",
                 keys: KeyPair | None = None) -> None:
        self.config = config or TrafficConfig()
        self.backend = backend
        self._clock = clock
        self._started_s = clock()
        weights = weights_from_pairs(self.config.lane_weights)
        caps = {"send": self.config.compute_send_cap_mb_s,
                "recv": self.config.compute_recv_cap_mb_s}
        self._dirs: dict[str, NicDirection] = {
            side: NicDirection(side, self._bucket(cap), weights,  # type: ignore[arg-type]
                               self.config.qos_lanes, clock, self.config.grant_timeout_s / 8,
                               self.config.inflight_chunks)
            for side, cap in caps.items()}
        self._copiers = {side: PieceCopier() for side in self._dirs}
        self._live = LiveSubmissions(self.config.grant_timeout_s)
        self._lock = threading.Lock()  # peers, counters
        self._peer_nics: dict[str, str] = {}
        self._keys = keys
        self._peer_keys: dict[str, str] = {}  # peer endpoint -> its engine's public key
        self._unpaced_chunks = 0
        self._client: GrantClient | None = None
        self._server: GrantServer | None = None
        if any(cap is not None for cap in caps.values()):
            self._server = GrantServer(nic_host, self.config.grant_timeout_s,
                                       self.config.grant_credit, self._enqueue_passive,
                                       self._stalled, self._wake, clock, keys)

    # --- the API ------------------------------------------------------------------------

    def register(self, address: int, nbytes: int) -> None:
        """Register a host region with the transfer backend (once per region)."""
        self._need_backend().register(address, nbytes)

    def submit(self, kind: TransferKind, peer: str, segments: Sequence[Segment], lane: Lane,
               after: Future[Any] | None = None) -> Future[None]:
        """Queue a transfer on ``lane``; the future completes when its last chunk has moved.

        ``write`` sends local → peer, ``read`` receives peer → local. The chunks queue only
        once ``after`` (if given) has completed; if ``after`` fails, the returned future fails
        with a ``TransferError`` chained from it and nothing moves. A backend error, or a
        peer NIC that grants nothing for ``grant_timeout_s``, fails the future with a
        ``TransferError`` and drops the transfer's remaining chunks. Never blocks.
        """
        if kind not in ("write", "read"):
            raise ValueError(f"kind must be 'write' or 'read', got {kind!r}")
        backend = self._need_backend()
        lane = Lane(lane)
        chunks = split_chunks(coalesce(validated(segments)),
                              self.config.lane_chunk_bytes(lane.value))
        sub = Submission(len(chunks))
        op = backend.start_write if kind == "write" else backend.start_read
        items: list[Work] = [MoveWork(sub, lane, sum(s[2] for s in c), partial(op, peer, c))
                             for c in chunks]
        start = partial(self._start_transfer, _NIC_SIDE[kind], peer, sub, items)
        self._live.accept(sub, after, start)
        return sub.future

    def submit_copy(self, dst: Any, src: Any, lane: Lane, direction: CopyDirection | None = None,
                    after: Future[Any] | None = None) -> Future[None]:
        """Copy ``src`` into ``dst`` asynchronously (tensors, or buffers of equal size).

        The copy queues in pieces on the NIC side it loads (``h2d``: receive, ``d2h``: send),
        arbitrated with that side's transfers and paced by its cap; the dispatcher thread
        copies (on CUDA: on a copy stream, after the work already queued on the submitter's
        stream). ``direction`` is what the copy stands for (on a CPU engine both sides are host
        memory); by default KV saves are device → host and everything else host → device.
        ``after`` as for ``submit``. Raises ``ValueError`` at once for mismatched sizes.
        """
        return self.submit_copies([(dst, src)], lane, direction, after)

    def submit_copies(self, pairs: Sequence[tuple[Any, Any]], lane: Lane,
                      direction: CopyDirection | None = None,
                      after: Future[Any] | None = None,
                      issue: CopyIssue | None = None) -> Future[None]:
        """``submit_copy`` of several ``(dst, src)`` pairs as one submission: one future.

        Small pieces of consecutive pairs share a NIC work item of at most the lane's chunk
        (e.g. the blocks of one layer), so a layer of many blocks costs a few queue turns, not
        one per block. The pairs are all tensors (CUDA ones on one device) or all buffers:
        ``ValueError`` otherwise. Empty ``pairs`` complete at once. ``issue``, for copies a
        CUDA stream consumes, receives each work item's copy-stream event as soon as it is
        issued (``nic_copy.CopyIssue``); the returned future still means "landed".
        """
        lane = Lane(lane)
        direction = direction or ("d2h" if lane is Lane.KV_SAVE else "h2d")
        if direction not in ("h2d", "d2h"):
            raise ValueError(f"direction must be 'h2d' or 'd2h', got {direction!r}")
        side = _NIC_SIDE[direction]
        chunk_bytes = self.config.lane_chunk_bytes(lane.value)
        pieces = [p for dst, src in pairs for p in copy_pieces(dst, src, chunk_bytes)[0]]
        ctx = submission_context(list(pairs), issue)
        copier = self._copiers[side]
        groups = group_pieces(pieces, chunk_bytes)
        sub = Submission(len(groups))
        if issue is not None:  # host copies: the issue settles when they have landed
            if ctx is not None and ctx.issue is not None:
                issue.expect(len(groups))
            issue.follow(sub.future)
        items: list[Work] = [CopyWork(sub, lane, sum(n for _, _, n in g),
                                      partial(copier.issue, g, ctx)) for g in groups]
        self._live.accept(sub, after, partial(self._dirs[side].put, items))
        return sub.future

    def write(self, peer: str, segments: Sequence[Segment], lane: Lane) -> None:
        """Send local → peer on ``lane`` and wait."""
        self.submit("write", peer, segments, lane).result()

    def read(self, peer: str, segments: Sequence[Segment], lane: Lane) -> None:
        """Receive peer → local on ``lane`` and wait."""
        self.submit("read", peer, segments, lane).result()

    def copy(self, dst: Any, src: Any, lane: Lane, direction: CopyDirection | None = None) -> int:
        """``submit_copy`` and wait; returns the bytes copied."""
        self.submit_copy(dst, src, lane, direction).result()
        return int(dst.nbytes) if hasattr(dst, "nbytes") else memoryview(dst).cast("B").nbytes

    @property
    def nic_address(self) -> str | None:
        """This NIC's grant server (``tcp://host:port``), or None when uncapped."""
        return None if self._server is None else self._server.address

    def set_peer_nic(self, endpoint: str, nic_address: str) -> None:
        """Ask ``nic_address`` for grants before moving chunks to or from peer ``endpoint``.

        ``endpoint`` is the peer's transfer-backend endpoint, as ``submit`` names it. With
        keys, a peer whose public key ``admit_peers`` did not give is not asked (its chunks go
        paced by this NIC only, as for a peer whose NIC is unknown).
        """
        if nic_address == self.nic_address:
            return  # ourselves
        with self._lock:
            public_key = self._peer_keys.get(endpoint, "")
            if self._keys is not None and not public_key:
                log.warning("no key for peer %s: its NIC %s is not asked for grants", endpoint,
                            nic_address)
                return
            if self._client is None:
                self._client = GrantClient(self.config.grant_timeout_s, self._clock, self._keys)
            self._peer_nics[endpoint] = nic_address
            self._client.set_peer(endpoint, nic_address, public_key)

    def admit_peers(self, public_keys: Mapping[str, str]) -> None:
        """The cluster's other engines, their public keys by transfer endpoint: the grant
        server admits exactly these from now on, and ``set_peer_nic`` reaches them with
        them."""
        with self._lock:
            self._peer_keys = dict(public_keys)
        if self._server is not None:
            self._server.admit(sorted(set(public_keys.values())))

    def forget_peer(self, endpoint: str) -> None:
        """Stop asking peer ``endpoint`` for grants; transfers waiting on its grants fail."""
        with self._lock:
            if self._peer_nics.pop(endpoint, None) is not None and self._client is not None:
                self._client.forget_peer(endpoint)

    def metrics(self) -> dict[str, float | int | None]:
        """Byte counters per NIC side, lane and kind, queues, utilization and peak rates.

        The keys are listed in this module's docstring.
        """
        elapsed = max(1e-9, self._clock() - self._started_s)
        out: dict[str, float | int | None] = {}
        lane_bytes = dict.fromkeys(Lane, 0)
        copy_lane = dict.fromkeys(Lane, 0)
        dropped = 0
        for d in self._dirs.values():
            out.update(direction_metrics(d, elapsed))
            with d.cond:
                for lane in Lane:
                    lane_bytes[lane] += d.bytes["active"][lane]
                    copy_lane[lane] += d.bytes["copy"][lane]
                dropped += d.dropped["passive"]
        out["h2d_bytes"] = self._dirs["recv"].total_bytes("copy")
        out["d2h_bytes"] = self._dirs["send"].total_bytes("copy")
        out.update({f"copy_bytes_{lane.value}": n for lane, n in copy_lane.items()})
        out.update({f"lane_bytes_{lane.value}": n for lane, n in lane_bytes.items()})
        out["cnic_dropped_grants"] = dropped
        out["unpaced_peer_chunks"] = self._unpaced_chunks
        out["grant_timeouts"] = 0 if self._client is None else self._client.timeouts
        return out

    def close(self) -> None:
        """Move what is queued, then stop the dispatchers and grant sockets (not the backend).

        Peers' requests still queued here are refused. Submissions still waiting for an
        ``after`` that nothing else here will complete fail with a ``TransferError`` after
        ``grant_timeout_s``.
        """
        self._live.close()
        if self._server is not None:
            self._server.refuse_all()
        self._live.wait_settled()
        for d in self._dirs.values():
            d.close()
        for loop in (self._client, self._server):
            if loop is not None:
                loop.close()

    def __enter__(self) -> TrafficManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals ----------------------------------------------------------------------

    def _bucket(self, cap_mb_s: float | None) -> TokenBucket | None:
        """The cap as a token bucket (burst: ``burst_chunks`` chunks); None when uncapped."""
        if cap_mb_s is None:
            return None
        return TokenBucket(cap_mb_s * 1e6, self.config.burst_chunks * self.config.chunk_bytes)

    def _need_backend(self) -> TransferBackend:
        if self.backend is None:
            raise TransferError("this traffic manager has no transfer backend")
        return self.backend

    def _start_transfer(self, side: str, peer: str, sub: Submission, items: list[Work]) -> None:
        """Queue the chunks now (peer NIC unknown), or each once the peer NIC grants it."""
        d = self._dirs[side]
        with self._lock:
            known = peer in self._peer_nics
            client = self._client
            if not known and (client is not None or self._server is not None):
                self._unpaced_chunks += len(items)
        if not known or client is None:
            d.put(items)
            return
        grants = []
        for item in items:
            grant = PendingGrant(_OPPOSITE[side], item.lane, item.nbytes, lambda: None, sub)
            grant.on_grant = partial(self._granted, d, item, partial(client.done, peer, grant.rid))
            grants.append(grant)
        sub.on_fail = partial(client.cancel, peer, grants)
        client.request(peer, grants)

    @staticmethod
    def _granted(d: NicDirection, item: Work, release: Callable[[], None]) -> None:
        """A peer granted ``item``: queue it; ``release`` once it moved or was dropped."""
        assert isinstance(item, MoveWork)
        item.release = release
        try:
            d.put([item])
        except TransferError as exc:
            item.sub.fail(exc)
            item.on_drop()

    def _enqueue_passive(self, side: str, items: Sequence[Work]) -> None:
        self._dirs[side].put(items)

    def _wake(self) -> None:
        for d in self._dirs.values():
            d.wake()

    def _stalled(self, now: float) -> bool:
        return any(d.stalled(now, self.config.grant_timeout_s) for d in self._dirs.values())
