"""The grant sockets under the cluster's keys (issue 42): a capped traffic manager's grant server
admits only the engines the router names, by their CURVE public keys.

Real ZeroMQ sockets and real traffic managers (over in-process backends: the point is the grant
protocol). A stranger with no key, or with a key no engine holds, gets no answer and leaves no
state on the server; an admitted peer gets its grants, and once the router no longer names it,
its frames are dropped unread. A server without keys binds loopback only.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import time
from collections.abc import Iterator

import msgpack
import pytest
import zmq

from dualpath.config import TrafficConfig
from dualpath.control_keys import KeyPair
from dualpath.errors import TransferError
from dualpath.protocol import PeerInfo
from dualpath.traffic.engine_plane import admit_peers
from dualpath.traffic.lanes import Lane
from dualpath.traffic.manager import TrafficManager
from dualpath.transfer.local import LocalBackend

SIZE = 1 << 16
CAPPED = TrafficConfig(compute_send_cap_mb_s=100.0, compute_recv_cap_mb_s=100.0,
                       grant_timeout_s=1.0)
REQUEST = msgpack.packb(["req", [[1, "recv", Lane.KV_LOAD.value, 4096]]])
PING = msgpack.packb(["ping", 0])


class Engine:
    """A keyed, capped traffic manager with a registered buffer over a local backend."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.keys = KeyPair.new()
        self.backend = LocalBackend()
        self.tm = TrafficManager(self.backend, CAPPED, keys=self.keys)
        self.buf = mmap.mmap(-1, SIZE)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.buf))
        self.tm.register(self.addr, SIZE)

    @property
    def info(self) -> PeerInfo:
        """This engine as the router's ``Peers`` lists it."""
        assert self.tm.nic_address is not None
        return PeerInfo(self.name, "decode", 1, self.backend.endpoint, self.tm.nic_address, 0, 0,
                        self.keys.public)

    def server(self):
        assert self.tm._server is not None
        return self.tm._server

    def close(self) -> None:
        self.tm.close()
        self.backend.close()


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made = [Engine("pe0"), Engine("de1")]
    yield made
    for engine in made:
        engine.close()


def stranger(address: str, keys: KeyPair | None = None, server_public: str = "") -> zmq.Socket:
    """A DEALER on the grant port: with no key, or CURVE with ``keys``."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        sock.curve_secretkey = keys.secret.encode()
        sock.curve_publickey = keys.public.encode()
        sock.curve_serverkey = server_public.encode()
    sock.connect(address)
    return sock


def answered(sock: zmq.Socket, wait_s: float = 1.5) -> bool:
    """Whether ``sock`` hears anything after asking for a grant and pinging (a message that
    cannot even be queued, no connection being up, is no answer either)."""
    for message in (REQUEST, PING):
        with contextlib.suppress(zmq.Again):
            sock.send(message, zmq.NOBLOCK)
    return bool(sock.poll(int(wait_s * 1000)))


def pull(me: Engine, peer: Engine) -> None:
    """Read 4 KiB of ``peer``'s buffer into ``me``'s through the traffic managers."""
    me.tm.submit("read", peer.backend.endpoint, [(me.addr, peer.addr, 4096)],
                 Lane.KV_LOAD).result(timeout=10)


def test_a_stranger_without_a_key_is_refused(engines):
    pe, de = engines
    admit_peers(de.backend, de.tm, [pe.info])
    sock = stranger(de.tm.nic_address)
    try:
        assert not answered(sock)
        assert de.server()._requesters == {}  # no state for it
    finally:
        sock.close()


def test_a_stranger_with_an_unknown_key_is_refused(engines):
    pe, de = engines
    admit_peers(de.backend, de.tm, [pe.info])
    sock = stranger(de.tm.nic_address, KeyPair.new(), de.keys.public)
    try:
        assert not answered(sock)
        assert de.server().refused >= 1
        assert de.server()._requesters == {}
    finally:
        sock.close()


def test_an_admitted_peer_gets_grants_until_the_router_drops_it(engines):
    pe, de = engines
    admit_peers(de.backend, de.tm, [pe.info])
    admit_peers(pe.backend, pe.tm, [de.info])
    de.buf[:4096] = b"k" * 4096
    pe.tm.set_peer_nic(de.backend.endpoint, de.tm.nic_address)
    pull(pe, de)  # granted by de's NIC, over an authenticated socket
    assert pe.buf[:4096] == b"k" * 4096
    assert de.tm.metrics()["cnic_send_passive_bytes"] >= 4096

    admit_peers(de.backend, de.tm, [])  # de1 no longer hears pe0
    time.sleep(0.2)
    with pytest.raises(TransferError):
        pull(pe, de)
    assert de.server().dropped_frames >= 1


def test_a_peer_asking_before_it_is_named_is_heard_once_named(engines):
    """pe0 asks de1 for grants before de1 has heard from the router that pe0 is in (de1 was
    busy): the handshake is refused, pe0's client makes its socket anew, and once de1 admits
    pe0 the transfer completes, within the grant timeout."""
    pe, de = engines
    admit_peers(pe.backend, pe.tm, [de.info])
    de.buf[:4096] = b"n" * 4096
    pe.tm.set_peer_nic(de.backend.endpoint, de.tm.nic_address)
    pending = pe.tm.submit("read", de.backend.endpoint, [(pe.addr, de.addr, 4096)],
                           Lane.KV_LOAD)
    time.sleep(0.3)
    assert not pending.done() and de.server().refused >= 1
    # asked while refused (its socket has no connection to queue on): waits, does not fail
    later = pe.tm.submit("read", de.backend.endpoint, [(pe.addr + 4096, de.addr, 4096)],
                         Lane.KV_LOAD)
    time.sleep(0.1)
    assert not later.done()
    admit_peers(de.backend, de.tm, [pe.info])
    pending.result(timeout=10)
    later.result(timeout=10)
    assert pe.buf[:8192] == b"n" * 8192


def test_a_grant_server_without_keys_binds_loopback_only():
    with pytest.raises(TransferError, match="needs its engine's keys"):
        TrafficManager(None, CAPPED, nic_host="10.254.0.1")
    with TrafficManager(None, CAPPED) as tm:
        assert tm.nic_address is not None and tm.nic_address.startswith("tcp://127.0.0.1:")
