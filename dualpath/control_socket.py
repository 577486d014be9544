"""ZeroMQ settings of the control plane's sockets (router and engines), kept in one place.

A connection over a cut link must be dropped and re-established within seconds, not after
TCP's retransmission backoff (which grows to minutes): ZeroMQ's own heartbeats drop a silent
connection and engine sockets retry their connection often.

Trust: every connection is CURVE-authenticated and encrypted (``control_keys.py``). The
router's socket lives in a ZeroMQ context of its own whose ZAP handler (``ZapHandler``, a
thread) admits a peer only if it presents the public key of a known engine, and stamps the
engine's name on every frame the peer sends (its ``User-Id``): no peer gets a frame through
without a key, and the router drops any frame whose socket identity (``NAME``, ``NAME/hb``,
``NAME/join``) is not its key's engine. The router does not let a second connection take over an
identity that is connected (no ``ROUTER_HANDOVER``): a reconnecting engine is heard again once
ZeroMQ's heartbeats have dropped its old connection (``ZMQ_HEARTBEAT_TIMEOUT_MS``). Frames over
``MAX_MESSAGE_BYTES`` are dropped by libzmq.
"""

from __future__ import annotations

import logging
import threading

import zmq

from dualpath.control_keys import ClusterKeys, EngineKey

log = logging.getLogger("dualpath.control")
ZAP_DOMAIN = b"dualpath"
MAX_MESSAGE_BYTES = 64 << 20  # the largest control frame (a prompt of millions of tokens)

ZMQ_HEARTBEAT_MS = 1000  # ZeroMQ pings an idle connection this often ...
ZMQ_HEARTBEAT_TIMEOUT_MS = 3000  # ... and drops it when no traffic came for this long
ZMQ_RECONNECT_MAX_MS = 2000  # a dropped engine socket retries at least this often


def keep_alive(socket: zmq.Socket) -> None:
    """ZeroMQ heartbeats on a control socket."""
    socket.setsockopt(zmq.HEARTBEAT_IVL, ZMQ_HEARTBEAT_MS)
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, ZMQ_HEARTBEAT_TIMEOUT_MS)


class ZapHandler:
    """Answers libzmq's ZAP requests for one context: a CURVE peer with a known engine's key
    is admitted, its frames stamped with the engine's name as their ``User-Id``; every other
    peer is refused and counted in ``refused``."""

    def __init__(self, context: zmq.Context, keys: ClusterKeys) -> None:
        self.allowed = keys.allowed()
        self.refused = 0
        self._socket = context.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind("inproc://zeromq.zap.01")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="zap", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop answering (the context's sockets must be closed first or soon after)."""
        self._stop.set()
        self._thread.join(timeout=5)

    def verdict(self, frames: list[bytes]) -> tuple[bool, str]:
        """(admitted, the engine's name or why not) for one ZAP request's frames."""
        if len(frames) < 7 or frames[0] != b"1.0" or frames[5] != b"CURVE":
            return False, "not a CURVE handshake"
        name = self.allowed.get(frames[6])
        if name is None:
            return False, f"an unknown key from {frames[3].decode(errors='replace')}"
        return True, name

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                if not self._socket.poll(100):
                    continue
                frames = self._socket.recv_multipart()
            except zmq.ZMQError:
                return  # the context is closing
            admitted, who = self.verdict(frames)
            if not admitted:
                self.refused += 1
                if self.refused <= 10 or self.refused % 1000 == 0:
                    log.warning("control plane: refused %s (%d refused)", who, self.refused)
            request_id = frames[1] if len(frames) > 1 else b""
            self._socket.send_multipart([b"1.0", request_id, b"200" if admitted else b"400",
                                         b"OK" if admitted else b"refused",
                                         who.encode() if admitted else b"", b""])
        self._socket.close(0)


def router_socket(host: str, port: int, keys: ClusterKeys,
                  context: zmq.Context) -> tuple[zmq.Socket, int]:
    """The router's ROUTER socket in ``context`` (whose ZAP handler must be running), a CURVE
    server with the router's key pair, bound to ``host:port`` (0: any free port); its port."""
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    socket.curve_server = True
    socket.curve_secretkey = keys.router.secret.encode()
    socket.curve_publickey = keys.router.public.encode()
    socket.zap_domain = ZAP_DOMAIN
    keep_alive(socket)
    try:
        if port:
            socket.bind(f"tcp://{host}:{port}")
        else:
            port = socket.bind_to_random_port(f"tcp://{host}")
    except zmq.ZMQError:
        socket.close(0)
        raise
    return socket, port


def engine_socket(identity: str, router_address: str, key: EngineKey) -> zmq.Socket:
    """An engine's DEALER socket to the router, a CURVE client with the engine's key, that
    survives a cut link: once the link is back the engine is heard again within about
    ``ZMQ_RECONNECT_MAX_MS``."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.IDENTITY, identity.encode())
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    curve_client(socket, key)
    keep_alive(socket)
    socket.setsockopt(zmq.CONNECT_TIMEOUT, ZMQ_RECONNECT_MAX_MS)
    socket.setsockopt(zmq.RECONNECT_IVL, 100)
    socket.setsockopt(zmq.RECONNECT_IVL_MAX, ZMQ_RECONNECT_MAX_MS)
    socket.connect(router_address)
    return socket


def curve_client(socket: zmq.Socket, key: EngineKey) -> None:
    """Make ``socket`` a CURVE client of the router with ``key`` (before it connects)."""
    socket.curve_secretkey = key.keys.secret.encode()
    socket.curve_publickey = key.keys.public.encode()
    socket.curve_serverkey = key.router_public.encode()
