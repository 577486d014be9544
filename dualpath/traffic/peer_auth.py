"""Engine-to-engine grant sockets under the cluster's CURVE keys (``control_keys.py``).

Every engine holds its own key pair (``EngineKey.keys``); the router's ``Peers`` carries every
engine's public key (``PeerInfo.public_key``). A capped traffic manager's grant server is a
CURVE server with its engine's pair that admits, during the handshake, only the public keys of
the engines the router last named (``PeerGate``, the ZAP handler of the grant server's own
ZeroMQ context, answered on its I/O thread): a socket with no key or an unknown one is refused
before any of its frames is read, so the server keeps no state for it. A grant client is a
CURVE client with its engine's pair and the peer's public key as the server key, so it also
knows it talks to that engine. A server without keys is loopback-only (``check_unkeyed``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import zmq
from zmq.utils import z85

from dualpath.control_keys import KeyPair
from dualpath.errors import TransferError
from dualpath.transfer.listeners import is_loopback

log = logging.getLogger("dualpath.traffic")
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks a context's ZAP handler
ZAP_DOMAIN = b"dualpath-grants"
Z85_KEY_CHARS = 40


def curve_server(socket: zmq.Socket, keys: KeyPair) -> None:
    """Make ``socket`` a CURVE server with ``keys`` whose peers the context's ZAP handler
    admits (before it binds)."""
    socket.curve_server = True
    socket.curve_secretkey = keys.secret.encode()
    socket.curve_publickey = keys.public.encode()
    socket.zap_domain = ZAP_DOMAIN


def curve_client(socket: zmq.Socket, keys: KeyPair, server_public: str) -> None:
    """Make ``socket`` a CURVE client with ``keys`` of the server whose public key is
    ``server_public`` (before it connects)."""
    socket.curve_secretkey = keys.secret.encode()
    socket.curve_publickey = keys.public.encode()
    socket.curve_serverkey = server_public.encode()


def check_unkeyed(host: str) -> None:
    """``TransferError`` unless a grant server without keys binds loopback only."""
    if not is_loopback(host):
        raise TransferError(f"a grant server on {host} needs its engine's keys: without them "
                            "only a loopback address is allowed")


def raw_keys(public_keys: Iterable[str]) -> frozenset[bytes]:
    """The 32-byte keys of Z85 public keys (malformed and empty ones left out)."""
    raw = set()
    for key in public_keys:
        if isinstance(key, str) and len(key) == Z85_KEY_CHARS:
            try:
                raw.add(z85.decode(key))
            except (ValueError, KeyError):
                continue
    return frozenset(raw)


class PeerGate:
    """The ZAP handler of one ZeroMQ context: admits CURVE peers whose public key is among
    ``admit``'s, stamping their frames' ``User-Id`` with that key (Z85); refuses and counts
    every other. Not thread-safe: its owner's I/O thread polls ``socket`` and calls
    ``answer``."""

    def __init__(self, context: zmq.Context) -> None:
        self.socket = context.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(ZAP_ENDPOINT)
        self.allowed: frozenset[bytes] = frozenset()
        self.refused = 0

    def admit(self, public_keys: Iterable[str]) -> None:
        """Admit exactly these peers (Z85 public keys) from now on; connections already
        admitted stay (the owner drops their frames: ``admitted``)."""
        self.allowed = raw_keys(public_keys)

    def admitted(self, user_id: str) -> bool:
        """Whether a frame stamped ``user_id`` comes from a peer admitted now."""
        return bool(user_id) and raw_keys([user_id]) <= self.allowed

    def verdict(self, frames: list[bytes]) -> tuple[bool, str]:
        """(admitted, the peer's key or why not) for one ZAP request's frames."""
        if len(frames) < 7 or frames[0] != b"1.0" or frames[5] != b"CURVE":
            return False, "not a CURVE handshake"
        if frames[6] not in self.allowed:
            return False, f"an unknown key from {frames[3].decode(errors='replace')}"
        return True, z85.encode(frames[6]).decode()

    def answer(self) -> None:
        """Answer every ZAP request waiting (never blocks)."""
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            admitted, who = self.verdict(frames)
            if not admitted:
                self.refused += 1
                if self.refused <= 10 or self.refused % 1000 == 0:
                    log.warning("grant server: refused %s (an engine the router has not "
                                "named to us yet, or a stranger; %d refused)", who, self.refused)
            request_id = frames[1] if len(frames) > 1 else b""
            self.socket.send_multipart([b"1.0", request_id, b"200" if admitted else b"400",
                                        b"OK" if admitted else b"refused",
                                        who.encode() if admitted else b"", b""])

    def close(self) -> None:
        """Close the socket (on the owner's I/O thread)."""
        self.socket.close(0)
