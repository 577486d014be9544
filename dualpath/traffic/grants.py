"""Grants: the passive end of a one-sided transfer is charged and paced by its own NIC.

A capped traffic manager runs a grant server (ZeroMQ ROUTER, msgpack). Before a chunk moves to
or from a peer with a known grant server, the active side asks it, up front for a submission's
chunks, for a grant on the opposite direction (our write → its receive side; our read → its
send side); the passive side queues, arbitrates, paces and counts it like local work and answers
"go". A requester reports each granted chunk "done" once moved or dropped and holds at most
``burst_chunks`` (≥ 2) grants not yet done. Liveness: the active side pings every ``timeout /
4`` of silence and fails (``TransferError``) transfers awaiting a peer silent or stalled for
``timeout``; the passive side drops, uncharged, cancelled requests and those of a requester
silent, or idle on full credit, for ``timeout``; a closing server or a full queue refuses.

Trust: a server made with its engine's keys is a CURVE server that admits only the public keys
of the engines the router names (``admit``; ``peer_auth.PeerGate``): a stranger is refused
during the handshake and never creates a requester here, and frames of a peer no longer named
are dropped unread. Without keys a server binds loopback only.

Wire format (one msgpack frame; ROUTER adds the requester's identity frame). To the server:
``["req", [[rid, side, lane, nbytes], ...]]``, ``["cancel", [rid, ...]]``, ``["done", [rid,
...]]`` (granted chunks moved or dropped), ``["ping", 0]``. Back: ``["go", [rid, ...]]``,
``["pong", stalled]``, ``["refused", [[rid, ...], why]]``.

Why, and the credit and liveness rules in full: docs/derivations.md, 'traffic/grants.py'.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from dualpath.control_keys import KeyPair
from dualpath.errors import TransferError
from dualpath.traffic.lanes import Lane
from dualpath.traffic.peer_auth import PeerGate, check_unkeyed, curve_server
from dualpath.traffic.work import Work

log = logging.getLogger(__name__)


class IoLoop(ABC):
    """A thread that owns ZeroMQ sockets; other threads hand it commands (``post``).

    ZeroMQ sockets are not thread-safe, so one thread polls them and a wake pipe; subclasses
    handle readable sockets, commands and a periodic tick (every ``tick_s``).
    """

    def __init__(self, name: str, tick_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._tick_ms = max(1, int(tick_s * 1000))
        self._ctx = zmq.Context()
        self._poller = zmq.Poller()
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._wake_lock = threading.Lock()
        self._closed = False
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, daemon=True, name=name)

    def post(self, command: tuple[Any, ...]) -> None:
        """Hand a command to the I/O thread and wake it (thread-safe, never blocks)."""
        self._commands.put(command)
        with self._wake_lock, contextlib.suppress(BlockingIOError):  # full: already awake
            if not self._closed:
                os.write(self._wake_w, b"\0")

    def close(self) -> None:
        """Stop the thread (``_shutdown`` runs on it), then close the wake pipe."""
        if self._thread.is_alive():
            self.post(("stop",))
            self._thread.join()
        with self._wake_lock:
            if not self._closed:
                self._closed = True
                os.close(self._wake_r)
                os.close(self._wake_w)

    def _loop(self) -> None:
        try:
            while not self._stopped:
                for sock, _ in self._poller.poll(self._tick_ms):
                    if sock == self._wake_r:
                        self._drain_wake()
                    else:
                        self._readable(sock)
                self._run_commands()
                self._tick(self._clock())
        finally:
            self._shutdown()
            self._ctx.term()

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _run_commands(self) -> None:
        commands = []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for cmd in commands:
            if cmd[0] == "stop":
                self._stopped = True
        self._commands_batch(commands)

    @abstractmethod
    def _readable(self, sock: Any) -> None:
        """A polled socket is readable."""

    @abstractmethod
    def _commands_batch(self, commands: list[tuple[Any, ...]]) -> None:
        """Handle the commands posted since the last round."""

    @abstractmethod
    def _tick(self, now: float) -> None:
        """Periodic work (timeouts)."""

    @abstractmethod
    def _shutdown(self) -> None:
        """Close the sockets (on the I/O thread)."""


@dataclass(eq=False)
class _Requester:
    """A peer that asks this NIC for grants, as the ROUTER knows it."""

    identity: bytes
    last_seen: float
    held: int = 0  # grants it holds: granted, not yet reported moved ("done")
    credit_s: float = 0.0  # when it last took a grant while holding none, or returned one
    lock: threading.Lock = field(default_factory=threading.Lock)


class GrantRequest(Work):
    """A peer's request for this NIC's share of one chunk (passive side)."""

    kind = "passive"

    def __init__(self, server: GrantServer, requester: _Requester, rid: int, lane: Lane,
                 nbytes: int) -> None:
        super().__init__(lane, nbytes)
        self.server = server
        self.requester = requester
        self.rid = rid
        self.cancelled = False

    def dropped(self, now_s: float) -> bool:
        r, timeout = self.requester, self.server.timeout_s
        return (self.cancelled or self.server.refusing or now_s - r.last_seen > timeout
                or (r.held >= self.server.credit and now_s - r.credit_s > timeout))

    def ready(self) -> bool:
        return self.requester.held < self.server.credit

    def on_drop(self) -> None:
        cancelled = self.cancelled or self.server.refusing  # else: expired (requester silent)
        self.server.post(("drop" if cancelled else "expire", self.requester.identity, self.rid))

    def run(self) -> bool:
        with self.requester.lock:
            if self.requester.held == 0:
                self.requester.credit_s = self.server._clock()
            self.requester.held += 1
        self.server.post(("go", self.requester.identity, self.rid))
        return True


class GrantServer(IoLoop):
    """This NIC's grant server: peers' requests go into its NIC directions' lanes.

    ``enqueue(side, items)`` queues requests in a NIC direction; ``stalled(now)`` says whether
    this NIC's dispatchers are stuck (then pings are answered as stalled); ``wake()`` makes
    the dispatchers re-check requests that were not ready. A requester holds at most ``credit``
    grants whose chunks it has not reported moved, so a requester that falls behind cannot
    pile up grants and then move them all at once, past this NIC's cap. With ``keys`` (its
    engine's pair) only the peers ``admit`` names get through; without, ``host`` must be
    loopback (``TransferError`` otherwise).
    """

    def __init__(self, host: str, timeout_s: float, credit: int,
                 enqueue: Callable[[str, Sequence[Work]], None], stalled: Callable[[float], bool],
                 wake: Callable[[], None], clock: Callable[[], float] = time.monotonic,
                 keys: KeyPair | None = None) -> None:
        if keys is None:
            check_unkeyed(host)
        super().__init__("traffic-grant-server", timeout_s / 10, clock)
        self.timeout_s = timeout_s
        self.credit = credit
        self.refusing = False
        self.dropped_frames = 0  # frames of peers no longer admitted, dropped unread
        self._enqueue, self._stalled, self._wake = enqueue, stalled, wake
        self._gate: PeerGate | None = None
        if keys is not None:
            self._gate = PeerGate(self._ctx)
            self._poller.register(self._gate.socket, zmq.POLLIN)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.SNDHWM, 0)  # never drop a grant to a live requester
        if keys is not None:
            curve_server(self._router, keys)
        self._router.bind(f"tcp://{host}:0")
        self.address: str = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._poller.register(self._router, zmq.POLLIN)
        self._requesters: dict[bytes, _Requester] = {}
        self._inbound: dict[tuple[bytes, int], GrantRequest] = {}
        self._thread.start()

    @property
    def refused(self) -> int:
        """Peers refused during the handshake (no key, or one not admitted)."""
        return 0 if self._gate is None else self._gate.refused

    def admit(self, public_keys: Sequence[str]) -> None:
        """Admit exactly the peers with these public keys (Z85) from now on (thread-safe)."""
        self.post(("admit", tuple(public_keys)))

    def refuse_all(self) -> None:
        """Closing: refuse outstanding and new requests (their transfers fail at once)."""
        self.refusing = True
        self.post(("refuse",))

    def _commands_batch(self, commands: list[tuple[Any, ...]]) -> None:
        goes: dict[bytes, list[int]] = defaultdict(list)
        expired: dict[bytes, list[int]] = defaultdict(list)
        for cmd in commands:
            if cmd[0] in ("go", "drop", "expire"):
                if self._inbound.pop((cmd[1], cmd[2]), None) is not None and cmd[0] != "drop":
                    (goes if cmd[0] == "go" else expired)[cmd[1]].append(cmd[2])
            elif cmd[0] == "refuse":
                self._refuse_inbound()
            elif cmd[0] == "admit" and self._gate is not None:
                self._gate.admit(cmd[1])
        for identity, rids in goes.items():
            self._reply(identity, ["go", rids])
        for identity, rids in expired.items():  # if the requester is alive after all, it hears
            self._reply(identity, ["refused", [rids, f"expired: the requester was silent for "
                                                     f"{self.timeout_s:g} s"]])

    def _readable(self, sock: Any) -> None:
        if self._gate is not None and sock == self._gate.socket:
            self._gate.answer()
            return
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if self._gate is not None and not self._gate.admitted(frames[-1].get("User-Id")):
                self.dropped_frames += 1  # a peer the router no longer names
                continue
            try:
                identity, raw = (frame.bytes for frame in frames)
                kind, body = msgpack.unpackb(raw)
                self._handle(identity, kind, body)
            except Exception:  # one bad message never stops the loop
                log.exception("bad grant request")

    def _handle(self, identity: bytes, kind: str, body: Any) -> None:
        now = self._clock()
        requester = self._requesters.get(identity)
        if requester is None:
            requester = self._requesters[identity] = _Requester(identity, now)
        requester.last_seen = now
        if kind == "ping":
            self._reply(identity, ["pong", self._stalled(now)])
        elif kind == "cancel":
            for rid in body:
                if (item := self._inbound.pop((identity, rid), None)) is not None:
                    item.cancelled = True
        elif kind == "done":
            with requester.lock:
                requester.held = max(0, requester.held - len(body))
                requester.credit_s = now
            self._wake()
        elif kind == "req":
            self._queue_requests(requester, body)

    def _queue_requests(self, requester: _Requester, body: list[list[Any]]) -> None:
        by_side: dict[str, list[GrantRequest]] = defaultdict(list)
        for rid, side, lane, nbytes in body:
            item = GrantRequest(self, requester, int(rid), Lane(lane), int(nbytes))
            by_side[str(side)].append(item)
        for side, items in by_side.items():
            if self.refusing:
                self._refuse(requester.identity, items, "closed")
                continue
            self._inbound.update(((requester.identity, g.rid), g) for g in items)
            try:
                self._enqueue(side, items)
            except (TransferError, KeyError) as exc:
                for g in items:
                    del self._inbound[(requester.identity, g.rid)]
                self._refuse(requester.identity, items, f"cannot queue on {side!r}: {exc}")

    def _refuse(self, identity: bytes, items: list[GrantRequest], why: str) -> None:
        self._reply(identity, ["refused", [[g.rid for g in items], why]])

    def _refuse_inbound(self) -> None:
        by_requester: dict[bytes, list[GrantRequest]] = defaultdict(list)
        for (identity, _), item in self._inbound.items():
            item.cancelled = True
            by_requester[identity].append(item)
        self._inbound.clear()
        for identity, items in by_requester.items():
            self._refuse(identity, items, "closed")

    def _reply(self, identity: bytes, msg: list[Any]) -> None:
        with contextlib.suppress(zmq.ZMQError):  # a requester that is gone: it times out
            self._router.send_multipart([identity, msgpack.packb(msg)], zmq.NOBLOCK)

    def _tick(self, now: float) -> None:
        if self._requesters and not self._inbound:  # forget long-silent requesters
            for key in [k for k, r in self._requesters.items()
                        if now - r.last_seen > 10 * self.timeout_s]:
                del self._requesters[key]

    def _shutdown(self) -> None:
        self._refuse_inbound()
        self._router.close()
        if self._gate is not None:
            self._gate.close()
