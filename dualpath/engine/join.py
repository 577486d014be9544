"""How an engine on any host joins a router: ask for the cluster's config, say where to reach it.

``dualpath engine --router tcp://HOST:PORT --role R --node-id N`` needs nothing else: the
engine sends ``Join`` and the router answers with the cluster configuration, its model id (an
engine whose checkpoint differs refuses to start: its KV keys would not match) and the id of
this router's run (engines of one node share a storage-NIC account under it). Host-local
settings (a store mounted elsewhere, a profile at another path) are overrides the engine
applies on top, ``--set storage.root=/mnt/kv``.

Other engines reach this one at its advertised host: by default the local address of the route
towards the router (so an engine in a network namespace advertises its own link's address, not
loopback), on the transfer protocol the cluster names (``tcp``, or ``rdma`` over the devices
the engine lists).
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

import zmq

from dualpath.config import ClusterConfig, cluster_config_from_json
from dualpath.control_keys import EngineKey
from dualpath.control_socket import curve_client
from dualpath.errors import DualPathError
from dualpath.protocol import JOIN_SUFFIX, Join, JoinConfig, ProtocolError, decode, encode

JOIN_RETRY_S = 1.0  # resend Join this often while the router is not (yet) answering
LOOPBACK = "127.0.0.1"


class EngineJoinError(DualPathError):
    """An engine could not join its router: no answer, a refusal, or another model."""


@dataclass(frozen=True)
class Advertised:
    """Where other engines reach this one: its transfer backend's host and protocol."""

    host: str  # the address peers connect to (this host's address on the compute network)
    protocol: str = "tcp"  # Mooncake protocol: tcp | rdma
    rdma_devices: str = ""  # comma-separated RDMA device names (rdma only), e.g. mlx5_0,mlx5_1


@dataclass(frozen=True)
class Joined:
    """What the router told a joining engine."""

    config: ClusterConfig
    model_id: str
    cluster_id: str


def router_host(router_address: str) -> str:
    """The host of ``tcp://HOST:PORT``; a ``DualPathError`` naming a malformed address."""
    parts = urlsplit(router_address)
    if parts.scheme != "tcp" or not parts.hostname or parts.port is None:
        raise EngineJoinError(f"--router must look like tcp://HOST:PORT, got {router_address!r}")
    return parts.hostname


def local_address_towards(host: str) -> str:
    """This host's address on the route to ``host`` (no packet is sent)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((host, 9))
        return probe.getsockname()[0]
    except OSError as exc:
        raise EngineJoinError(f"no route to the router's host {host}: {exc}") from exc
    finally:
        probe.close()


def join_router(router_address: str, name: str, role: str, node_id: int,
                timeout_s: float, key: EngineKey) -> Joined:
    """Ask the router for the cluster config; resend every ``JOIN_RETRY_S`` (a router that
    starts later is waited for) and raise ``EngineJoinError`` after ``timeout_s`` of silence
    or when the router refuses."""
    router_host(router_address)
    try:
        join = Join(name, role, node_id)
    except ValueError as exc:
        raise EngineJoinError(f"{name!r} cannot join: {exc}") from exc
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, (name + JOIN_SUFFIX).encode())
    sock.setsockopt(zmq.LINGER, 0)
    curve_client(sock, key)
    sock.connect(router_address)
    try:
        answer = _ask(sock, join, timeout_s)
    finally:
        sock.close(0)
    if answer is None:
        raise EngineJoinError(f"no answer from the router at {router_address} within "
                              f"{timeout_s:g} s (is it up, reachable from this host, and is "
                              f"{name}'s key one this router knows?)")
    if answer.error:
        raise EngineJoinError(f"the router at {router_address} refused {name}: {answer.error}")
    return Joined(cluster_config_from_json(answer.config_json), answer.model_id,
                  answer.cluster_id)


def _ask(sock: zmq.Socket, join: Join, timeout_s: float) -> JoinConfig | None:
    deadline = time.monotonic() + timeout_s
    while (left_s := deadline - time.monotonic()) > 0:
        sock.send(encode(join))
        if sock.poll(int(1000 * min(left_s, JOIN_RETRY_S))):
            try:
                answer = decode(sock.recv())
            except ProtocolError:
                continue
            if isinstance(answer, JoinConfig):
                return answer
    return None


def localized(config: ClusterConfig, advertised: Advertised) -> ClusterConfig:
    """``config`` as this host runs it: a Mooncake Store client registers with the engine's
    advertised address unless the config (or an override) names another."""
    storage = config.storage
    if storage.backend != "mooncake_store" or storage.mooncake_local_host != LOOPBACK:
        return config
    return replace(config, storage=replace(storage, mooncake_local_host=advertised.host))


def check_model(joined: Joined, local_model_id: str, model_dir: str) -> None:
    """Refuse to serve another checkpoint than the router's (KV keys name the model)."""
    if joined.model_id != local_model_id:
        raise EngineJoinError(f"the router serves model {joined.model_id}, but {model_dir} is "
                              f"{local_model_id}: give --model the same checkpoint (same folder "
                              "name, config and weights)")
