"""The active side of grants: ask peer NICs before moving chunks, time out dead or hung peers.

One ``GrantClient`` per traffic manager (started when it first learns a peer's grant server)
owns a DEALER socket per peer NIC. A submission's chunks are all requested in one message; each
"go" hands its chunk to the local NIC direction. See ``nic_grants`` for the protocol and the
liveness rules; this side pings a peer it waits on every ``timeout / 4`` of its own silence and
fails every transfer waiting on a peer that has said nothing useful for ``timeout``.

With its engine's ``keys`` every socket is a CURVE client that presents them and expects the
peer's public key (``set_peer``): the peer's grant server admits it, and it talks to no other.
A peer that has not yet heard from the router that we are in refuses the handshake, and
ZeroMQ does not retry a refused one (the socket then takes no message): a socket monitor sees
the refusal, or a request finds no connection to queue on, and the socket is made anew after a
backoff (``RETRY_MIN_S`` doubling to ``timeout / 4``), its unanswered requests sent again (none
got through a refused handshake). The liveness rule still fails them after ``timeout``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

from dualpath.control_keys import KeyPair
from dualpath.errors import TransferError
from dualpath.traffic.grants import IoLoop, log
from dualpath.traffic.lanes import Lane
from dualpath.traffic.peer_auth import Z85_KEY_CHARS, curve_client
from dualpath.traffic.work import Submission

_rids = itertools.count(1)
RETRY_MIN_S = 0.05  # first wait before a socket whose handshake was refused is made anew
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


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
    public_key: str  # its grant server's CURVE key ("": none, an unkeyed server)
    sock: zmq.Socket
    monitor: zmq.Socket  # the socket's handshake failures
    last_heard: float
    last_sent: float
    busy_since: float = 0.0
    outstanding: dict[int, PendingGrant] = field(default_factory=dict)
    retry_at: float | None = None  # when to make the socket anew (its handshake was refused)
    retry_s: float = RETRY_MIN_S


class GrantClient(IoLoop):
    """Asks peer NICs for grants; every public method is thread-safe and returns at once.
    ``keys``: its engine's pair, presented to every peer (then each peer needs its key)."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic,
                 keys: KeyPair | None = None) -> None:
        super().__init__("traffic-grant-client", timeout_s / 10, clock)
        self.timeout_s = timeout_s
        self.keys = keys
        self.timeouts = 0  # transfers failed because a peer NIC went silent
        self._peers: dict[str, _Peer] = {}
        self._by_sock: dict[Any, _Peer] = {}
        self._thread.start()

    def set_peer(self, endpoint: str, nic: str, public_key: str = "") -> None:
        """Ask ``nic`` (whose CURVE key is ``public_key`` when this client has keys) for
        grants for transfers with ``endpoint``; ``TransferError`` for a keyed client given no
        key."""
        if self.keys is not None and len(public_key) != Z85_KEY_CHARS:
            raise TransferError(f"peer {endpoint}'s NIC {nic}: no CURVE key to reach it with")
        self.post(("peer", endpoint, nic, public_key))

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
                self._connect(cmd[1], cmd[2], cmd[3])
            elif cmd[0] == "forget":
                self._drop_peer(cmd[1], f"peer {cmd[1]} was forgotten")
        for endpoint, rids in done.items():
            if (peer := self._peers.get(endpoint)) is not None:
                self._send(peer, ["done", rids])

    def _connect(self, endpoint: str, nic: str, public_key: str) -> None:
        old = self._peers.get(endpoint)
        if old is not None and (old.nic, old.public_key) == (nic, public_key):
            return
        if old is not None:
            self._drop_peer(endpoint, f"peer {endpoint}'s NIC moved to {nic}")
        now = self._clock()
        sock, monitor = self._open(nic, public_key)
        peer = _Peer(endpoint, nic, public_key, sock, monitor, last_heard=now, last_sent=now)
        self._peers[endpoint] = peer
        self._watch(peer)

    def _open(self, nic: str, public_key: str) -> tuple[zmq.Socket, zmq.Socket]:
        """A DEALER connecting to ``nic`` (a CURVE client with keys) and its monitor."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.keys is not None:
            curve_client(sock, self.keys, public_key)
        monitor = sock.get_monitor_socket(HANDSHAKE_FAILED)
        sock.connect(nic)
        return sock, monitor

    def _watch(self, peer: _Peer) -> None:
        for sock in (peer.sock, peer.monitor):
            self._by_sock[sock] = peer
            self._poller.register(sock, zmq.POLLIN)

    def _close_sockets(self, peer: _Peer) -> None:
        for sock in (peer.sock, peer.monitor):
            self._poller.unregister(sock)
            del self._by_sock[sock]
        peer.sock.disable_monitor()
        peer.monitor.close()
        peer.sock.close()

    def _reopen(self, peer: _Peer) -> None:
        """Make the peer's socket anew after a refused handshake and ask again for what is
        unanswered (nothing got through the refused one)."""
        self._close_sockets(peer)
        peer.sock, peer.monitor = self._open(peer.nic, peer.public_key)
        self._watch(peer)
        peer.retry_at = None
        if peer.outstanding:
            grants = list(peer.outstanding.values())
            self._send(peer, ["req", [[g.rid, g.side, g.lane.value, g.nbytes] for g in grants]])

    def _drop_peer(self, endpoint: str, why: str) -> None:
        peer = self._peers.pop(endpoint, None)
        if peer is None:
            return
        self._expire(peer, why, timed_out=False)
        self._close_sockets(peer)

    def _send_requests(self, endpoint: str, grants: list[PendingGrant]) -> None:
        peer = self._peers.get(endpoint)
        if peer is None:
            _fail(grants, f"no NIC is known for peer {endpoint}")
            return
        if not peer.outstanding:
            peer.busy_since = self._clock()
        peer.outstanding.update((g.rid, g) for g in grants)
        body = [[g.rid, g.side, g.lane.value, g.nbytes] for g in grants]
        if self._send(peer, ["req", body]):
            return
        if self.keys is not None:  # no connection: its handshake was refused (not admitted
            if peer.retry_at is None:  # yet); the requests go again on the new socket
                peer.retry_at = self._clock()
            return
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
        if peer is not None and sock is peer.monitor:
            self._refused(peer)
            return
        while peer is not None:
            try:
                raw = peer.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._hear(peer, *msgpack.unpackb(raw))
            except Exception:  # one bad message never stops the loop
                log.exception("bad grant message from %s", peer.nic)

    def _refused(self, peer: _Peer) -> None:
        """Read the monitor's events: a failed handshake makes the socket anew later."""
        failed = False
        while True:
            try:
                event = recv_monitor_message(peer.monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            failed |= bool(event["event"] & HANDSHAKE_FAILED)
        if failed and peer.retry_at is None:
            peer.retry_at = self._clock() + peer.retry_s
            peer.retry_s = min(2 * peer.retry_s, self.timeout_s / 4)

    def _hear(self, peer: _Peer, kind: str, body: Any) -> None:
        peer.retry_s = RETRY_MIN_S  # the handshake went through
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
            if peer.retry_at is not None and now >= peer.retry_at:
                self._reopen(peer)
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
