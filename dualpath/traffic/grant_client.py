"""The active side of grants: ask peer NICs before moving chunks, time out dead or hung peers.

One ``GrantClient`` per traffic manager (started when it first learns a peer's grant server)
owns a DEALER socket per peer NIC. A submission's chunks are all requested in one message; each
"go" hands its chunk to the local NIC direction. See ``nic_grants`` for the protocol and the
liveness rules; this side pings a peer it waits on every ``timeout / 4`` of its own silence and
fails every transfer waiting on a peer that has said nothing useful for ``timeout``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from dualpath.errors import TransferError
from dualpath.traffic.grants import IoLoop, log
from dualpath.traffic.lanes import Lane
from dualpath.traffic.work import Submission

_rids = itertools.count(1)


@dataclass(eq=False)
class PendingGrant:
    """A chunk of ours that waits for a peer's grant."""

    side: str  # the peer NIC's side that is asked: "send" or "recv"
    lane: Lane
    nbytes: int
    on_grant: Callable[[], None]  # queues the chunk locally (runs on the I/O thread)
    sub: Submission
    rid: int = field(default_factory=lambda: next(_rids))


@dataclass(eq=False)
class _Peer:
    """A peer NIC we ask for grants (I/O thread only)."""

    endpoint: str
    nic: str
    sock: zmq.Socket
    last_heard: float
    last_sent: float
    busy_since: float = 0.0
    outstanding: dict[int, PendingGrant] = field(default_factory=dict)


class GrantClient(IoLoop):
    """Asks peer NICs for grants; every public method is thread-safe and returns at once."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__("traffic-grant-client", timeout_s / 10, clock)
        self.timeout_s = timeout_s
        self.timeouts = 0  # transfers failed because a peer NIC went silent
        self._peers: dict[str, _Peer] = {}
        self._by_sock: dict[Any, _Peer] = {}
        self._thread.start()

    def set_peer(self, endpoint: str, nic: str) -> None:
        """Ask ``nic`` for grants for transfers with ``endpoint``."""
        self.post(("peer", endpoint, nic))

    def forget_peer(self, endpoint: str) -> None:
        """Stop asking; transfers still waiting on that peer's grants fail."""
        self.post(("forget", endpoint))

    def request(self, endpoint: str, grants: list[PendingGrant]) -> None:
        """Ask ``endpoint``'s NIC for all ``grants`` (pipelined: one message)."""
        self.post(("request", endpoint, grants))

    def cancel(self, endpoint: str, grants: list[PendingGrant]) -> None:
        """Withdraw those of ``grants`` not granted yet (their transfer failed)."""
        self.post(("cancel", endpoint, grants))

    def done(self, endpoint: str, rid: int) -> None:
        """A granted chunk moved or was dropped: give the peer its credit back."""
        self.post(("done", endpoint, rid))

    # --- the I/O thread -----------------------------------------------------------------------

    def _commands_batch(self, commands: list[tuple[Any, ...]]) -> None:
        done: dict[str, list[int]] = {}
        for cmd in commands:
            if cmd[0] == "done":
                done.setdefault(cmd[1], []).append(cmd[2])
            elif cmd[0] == "request":
                self._send_requests(cmd[1], cmd[2])
            elif cmd[0] == "cancel":
                self._cancel(cmd[1], cmd[2])
            elif cmd[0] == "peer":
                self._connect(cmd[1], cmd[2])
            elif cmd[0] == "forget":
                self._drop_peer(cmd[1], f"peer {cmd[1]} was forgotten")
        for endpoint, rids in done.items():
            if (peer := self._peers.get(endpoint)) is not None:
                self._send(peer, ["done", rids])

    def _connect(self, endpoint: str, nic: str) -> None:
        old = self._peers.get(endpoint)
        if old is not None and old.nic == nic:
            return
        if old is not None:
            self._drop_peer(endpoint, f"peer {endpoint}'s NIC moved to {nic}")
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(nic)
        now = self._clock()
        peer = _Peer(endpoint, nic, sock, last_heard=now, last_sent=now)
        self._peers[endpoint] = peer
        self._by_sock[sock] = peer
        self._poller.register(sock, zmq.POLLIN)

    def _drop_peer(self, endpoint: str, why: str) -> None:
        peer = self._peers.pop(endpoint, None)
        if peer is None:
            return
        self._expire(peer, why, timed_out=False)
        self._poller.unregister(peer.sock)
        del self._by_sock[peer.sock]
        peer.sock.close()

    def _send_requests(self, endpoint: str, grants: list[PendingGrant]) -> None:
        peer = self._peers.get(endpoint)
        if peer is None:
            _fail(grants, f"no NIC is known for peer {endpoint}")
            return
        if not peer.outstanding:
            peer.busy_since = self._clock()
        peer.outstanding.update((g.rid, g) for g in grants)
        body = [[g.rid, g.side, g.lane.value, g.nbytes] for g in grants]
        if not self._send(peer, ["req", body]):
            for g in grants:
                peer.outstanding.pop(g.rid, None)
            _fail(grants, f"peer {endpoint}'s NIC ({peer.nic}) takes no more requests")

    def _cancel(self, endpoint: str, grants: list[PendingGrant]) -> None:
        peer = self._peers.get(endpoint)
        if peer is None:
            return
        rids = [g.rid for g in grants if peer.outstanding.pop(g.rid, None) is not None]
        if rids:
            self._send(peer, ["cancel", rids])

    def _send(self, peer: _Peer, msg: list[Any]) -> bool:
        try:
            peer.sock.send(msgpack.packb(msg), zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        peer.last_sent = self._clock()
        return True

    def _readable(self, sock: Any) -> None:
        peer = self._by_sock.get(sock)
        while peer is not None:
            try:
                raw = peer.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._hear(peer, *msgpack.unpackb(raw))
            except Exception:  # one bad message never stops the loop
                log.exception("bad grant message from %s", peer.nic)

    def _hear(self, peer: _Peer, kind: str, body: Any) -> None:
        if kind == "go":
            peer.last_heard = self._clock()
            for rid in body:
                if (grant := peer.outstanding.pop(rid, None)) is not None:
                    grant.on_grant()
        elif kind == "pong" and not body:  # a stalled peer's pong does not count
            peer.last_heard = self._clock()
        elif kind == "refused":
            peer.last_heard = self._clock()
            rids, why = body
            refused = [g for rid in rids if (g := peer.outstanding.pop(rid, None)) is not None]
            _fail(refused, f"peer {peer.endpoint}'s NIC refused: {why}")

    def _tick(self, now: float) -> None:
        for peer in list(self._peers.values()):
            if not peer.outstanding:
                continue
            if now - max(peer.last_heard, peer.busy_since) > self.timeout_s:
                self._expire(peer, f"no grant from peer {peer.endpoint}'s NIC ({peer.nic}) in "
                                   f"{self.timeout_s:g} s: peer dead or hung", timed_out=True)
            elif now - peer.last_sent > self.timeout_s / 4:
                self._send(peer, ["ping", 0])

    def _expire(self, peer: _Peer, why: str, timed_out: bool) -> None:
        grants = list(peer.outstanding.values())
        peer.outstanding.clear()
        if not grants:
            return
        self._send(peer, ["cancel", [g.rid for g in grants]])
        if timed_out:
            self.timeouts += len({id(g.sub) for g in grants})
        _fail(grants, why)

    def _shutdown(self) -> None:
        for endpoint in list(self._peers):
            self._drop_peer(endpoint, "the traffic manager closed")


def _fail(grants: list[PendingGrant], why: str) -> None:
    """Fail the submissions of ``grants`` (each once)."""
    for sub in {id(g.sub): g.sub for g in grants}.values():
        sub.fail(TransferError(why))
