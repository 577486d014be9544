"""Nothing listens where it should not: Mooncake's listeners, what ``ss -ltnp`` shows of them,
and the nftables fences that keep them to the cluster's hosts (issue 42).

Mooncake binds its handshake port and its TCP data port to every interface whatever address it
is given (measured here, with and without ``MC_TCP_BIND_ADDRESS``), so a backend fences them:
a stranger host (a network namespace) can neither connect nor read registered memory, a host
the engine admits can, and without the fence the same stranger reads the memory. Fences need
root and ``nft``; the tests that need them skip cleanly elsewhere.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dualpath.bench.netns import NetnsHosts, netns_unavailable
from dualpath.errors import TransferError
from dualpath.transfer.firewall import PortFence, fence_unavailable, fenced_ports
from dualpath.transfer.guard import peer_hosts
from dualpath.transfer.listeners import Listener, is_loopback, listeners

ROOT = Path(__file__).resolve().parents[2]
PEER = Path(__file__).with_name("mooncake_peer.py")
NO_FENCE = fence_unavailable()
needs_fence = pytest.mark.skipif(NO_FENCE is not None, reason=NO_FENCE or "")


def mooncake():
    """The backend class, or a skip where Mooncake is not installed."""
    from dualpath.transfer.mooncake import MooncakeBackend, _engine_class

    try:
        _engine_class()
    except TransferError as exc:
        pytest.skip(str(exc))
    return MooncakeBackend


def ss_listeners(pid: int) -> list[Listener]:
    """What ``ss -ltnp`` shows of ``pid``'s listening sockets."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = set()
    for line in out.splitlines():
        if f"pid={pid}," not in line:
            continue
        local = line.split()[3]
        address, port = local.rsplit(":", 1)
        address = address.strip("[]")
        found.add(Listener("::" if address == "*" else address, int(port), pid))
    return sorted(found)


def buffer(nbytes: int, fill: bytes) -> tuple[mmap.mmap, int]:
    """A page-aligned buffer of ``nbytes`` filled with ``fill``, and its address."""
    buf = mmap.mmap(-1, nbytes)
    buf[:] = (fill * (nbytes // len(fill) + 1))[:nbytes]
    return buf, ctypes.addressof(ctypes.c_char.from_buffer(buf))


# -- reading listeners ----------------------------------------------------------------------------
def test_listeners_are_what_ss_shows():
    backend = mooncake()(open_listeners=True)
    own = socket.create_server(("127.0.0.1", 0))
    try:
        mine = listeners()
        assert mine == ss_listeners(os.getpid())
        assert Listener("127.0.0.1", own.getsockname()[1], os.getpid()) in mine
        assert {item.port for item in mine if item.wildcard} == set(backend.guard.ports)
    finally:
        own.close()
        backend.close()


def test_mooncake_listens_on_every_interface_whatever_address_it_is_given():
    """What the installed Mooncake allows: no bind address (``MC_TCP_BIND_ADDRESS`` only sets
    what a non-P2P engine advertises): both its ports listen on every interface."""
    mooncake()
    code = ("import json; from dualpath.transfer.mooncake import MooncakeBackend; "
            "from dualpath.transfer.listeners import listeners; "
            "b = MooncakeBackend('127.0.0.1', open_listeners=True); "
            "print(json.dumps([[x.address, x.port] for x in listeners()]))")
    env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=60, check=True)
    opened = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(opened) == 2  # the handshake (RPC) port and the TCP data port
    assert all(address in ("0.0.0.0", "::") for address, _ in opened), opened


def test_peer_hosts_and_loopback():
    assert peer_hosts(["10.0.0.2:16001", "tcp://10.0.0.3:4000", "[fd00::1]:17000", "",
                       "tcp://*:5", "node-a:1"]) == {"10.0.0.2", "10.0.0.3", "fd00::1", "node-a"}
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("10.0.0.1") and not is_loopback("0.0.0.0")


# -- the guard ------------------------------------------------------------------------------------
@needs_fence
def test_ss_shows_no_unfenced_wildcard_listener_unless_opted_out():
    """The acceptance check: every listener ``ss -ltnp`` shows of this process on a wildcard
    address is in a fence of this process, the fence goes when the backend closes; with the
    opt-out the same listeners are left unfenced."""
    backend = mooncake()()
    try:
        wildcard = [item for item in ss_listeners(os.getpid()) if item.wildcard]
        assert wildcard, "Mooncake listens on every interface"
        fences = {t: ports for t, ports in fenced_ports().items()
                  if t.startswith(f"dualpath_{os.getpid()}_")}
        covered = {port for ports in fences.values() for port in ports}
        assert {item.port for item in wildcard} <= covered
        assert backend.guard.fenced
    finally:
        backend.close()
    assert backend.guard.fence is not None
    assert backend.guard.fence.table not in fenced_ports()

    opted_out = mooncake()(open_listeners=True)
    try:
        ports = {item.port for item in ss_listeners(os.getpid()) if item.wildcard}
        covered = {p for fence in fenced_ports().values() for p in fence}
        assert ports and not ports & covered and not opted_out.guard.fenced
    finally:
        opted_out.close()


@needs_fence
def test_a_fence_of_a_dead_process_is_swept():
    killed = subprocess.run(
        [sys.executable, "-c", "import os; from dualpath.transfer.firewall import PortFence; "
         "f = PortFence([1]); print(f.table, flush=True); os._exit(9)"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=60)
    table = killed.stdout.strip()
    assert table in fenced_ports()  # os._exit: nothing removed it
    fence = PortFence([2])  # any new fence sweeps the stale ones
    try:
        assert table not in fenced_ports()
        assert fence.table in fenced_ports()
    finally:
        fence.close()


def test_an_engine_other_hosts_reach_is_refused_when_it_cannot_fence():
    """Run as root without CAP_NET_ADMIN (as in many containers): nft refuses, so a backend
    advertised on a non-loopback address needs the opt-out, which it logs."""
    mooncake()
    if subprocess.run(["which", "setpriv", "nft"], capture_output=True).returncode != 0:
        pytest.skip("needs setpriv and nft")
    code = ("import sys, logging; logging.basicConfig(); "
            "from dualpath.transfer.mooncake import MooncakeBackend; "
            "from dualpath.transfer.guard import ListenerError\n"
            "try:\n    MooncakeBackend(sys.argv[1], open_listeners=sys.argv[2] == '1')\n"
            "except ListenerError as exc:\n    print('REFUSED', exc); sys.exit(7)\n"
            "print('STARTED')")
    drop = ["setpriv", "--bounding-set", "-net_admin", "--inh-caps", "-net_admin"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def start(host: str, opt_out: bool) -> subprocess.CompletedProcess:
        return subprocess.run([*drop, sys.executable, "-c", code, host, "1" if opt_out else "0"],
                              capture_output=True, text=True, env=env, timeout=60)

    refused = start("10.254.0.1", opt_out=False)
    assert refused.returncode == 7, refused.stdout + refused.stderr  # a ListenerError
    assert "set transfer_open_listeners = true" in refused.stdout
    opted = start("10.254.0.1", opt_out=True)
    assert opted.returncode == 0 and "STARTED" in opted.stdout
    assert "transfer_open_listeners = true: Mooncake listens on every interface" in opted.stderr
    local = start("127.0.0.1", opt_out=False)
    assert local.returncode == 0 and "cannot be fenced" in local.stderr


# -- a stranger host ------------------------------------------------------------------------------
@pytest.mark.skipif(NO_FENCE is not None or netns_unavailable() is not None,
                    reason=NO_FENCE or netns_unavailable() or "")
def test_a_stranger_host_cannot_read_registered_memory_an_admitted_one_can():
    backend_class = mooncake()
    with NetnsHosts(["stranger"], tag="fw", net=7) as net:
        here, there = net.gateway(), net.address("stranger")
        data, addr = buffer(1 << 16, b"dualpath")

        def read(endpoint: str) -> dict:
            cmd = net.exec_argv("stranger", [sys.executable, str(PEER), "--host", there,
                                             "--peer", endpoint, "--addr", str(addr),
                                             "--nbytes", "4096", "--timeout", "15"])
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)})
            assert done.stdout.strip(), done.stderr[-2000:]
            return json.loads(done.stdout.strip().splitlines()[-1])

        def connects(port: int) -> bool:
            probe = ("import socket, sys\ntry:\n    socket.create_connection((sys.argv[1], "
                     "int(sys.argv[2])), timeout=3).close(); print('open')\n"
                     "except OSError as exc:\n    print('closed', exc)")
            cmd = net.exec_argv("stranger", [sys.executable, "-c", probe, here, str(port)])
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
            return out.startswith("open")

        unfenced = backend_class(here, open_listeners=True)  # what every engine was before
        try:
            unfenced.register(addr, len(data))
            found = read(unfenced.endpoint)
            assert found["ok"] and bytes.fromhex(found["data"]) == data[:4096]
        finally:
            unfenced.close()

        fenced = backend_class(here)
        try:
            fenced.register(addr, len(data))
            assert fenced.guard.fenced and fenced.guard.ports
            assert not any(connects(port) for port in fenced.guard.ports)
            refused = read(fenced.endpoint)
            assert not refused["ok"], refused
            fenced.allow_hosts(peer_hosts([f"{there}:1"]))  # the router named it a peer
            assert all(connects(port) for port in fenced.guard.ports)
            found = read(fenced.endpoint)
            assert found["ok"] and bytes.fromhex(found["data"]) == data[:4096]
        finally:
            fenced.close()
