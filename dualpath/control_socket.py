"""ZeroMQ settings of the control plane's sockets (router and engines), kept in one place.

A connection over a cut link must be dropped and re-established within seconds, not after
TCP's retransmission backoff (which grows to minutes): ZeroMQ's own heartbeats drop a silent
connection, engine sockets retry their connection often, and the router lets a reconnecting
engine take over its identity.
"""

from __future__ import annotations

import zmq

ZMQ_HEARTBEAT_MS = 1000  # ZeroMQ pings an idle connection this often ...
ZMQ_HEARTBEAT_TIMEOUT_MS = 3000  # ... and drops it when no traffic came for this long
ZMQ_RECONNECT_MAX_MS = 2000  # a dropped engine socket retries at least this often


def keep_alive(socket: zmq.Socket) -> None:
    """ZeroMQ heartbeats on a control socket."""
    socket.setsockopt(zmq.HEARTBEAT_IVL, ZMQ_HEARTBEAT_MS)
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, ZMQ_HEARTBEAT_TIMEOUT_MS)


def router_socket(host: str, port: int) -> tuple[zmq.Socket, int]:
    """The router's ROUTER socket bound to ``host:port`` (0: any free port), and its port."""
    socket = zmq.Context.instance().socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting engine keeps its identity
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


def engine_socket(identity: str, router_address: str) -> zmq.Socket:
    """An engine's DEALER socket to the router that survives a cut link: once the link is back
    the engine is heard again within about ``ZMQ_RECONNECT_MAX_MS``."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.IDENTITY, identity.encode())
    socket.setsockopt(zmq.LINGER, 0)
    keep_alive(socket)
    socket.setsockopt(zmq.CONNECT_TIMEOUT, ZMQ_RECONNECT_MAX_MS)
    socket.setsockopt(zmq.RECONNECT_IVL, 100)
    socket.setsockopt(zmq.RECONNECT_IVL_MAX, ZMQ_RECONNECT_MAX_MS)
    socket.connect(router_address)
    return socket
