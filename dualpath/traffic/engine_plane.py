"""An engine's data plane toward its cluster, kept to the cluster: its Mooncake backend (whose
listeners are fenced to the cluster's hosts, ``transfer/guard.py``) and its traffic manager
(whose grant sockets are CURVE-authenticated with the engine's keys, ``traffic/peer_auth.py``).

``data_plane`` builds both for an engine process (``engine/loop.py``); ``admit_peers`` takes
the router's latest ``Peers``: the others' hosts reach the backend's listeners, their public
keys the grant server, and nobody else either. The EP traffic generator needs nothing more: its
exchanges are Mooncake writes into the peers' registered EP buffers, granted like any chunk.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from dualpath.traffic.manager import TrafficManager
from dualpath.transfer.guard import peer_hosts

if TYPE_CHECKING:
    from dualpath.config import ClusterConfig
    from dualpath.control_keys import EngineKey
    from dualpath.protocol import PeerInfo
    from dualpath.transfer.base import TransferBackend
    from dualpath.transfer.mooncake import MooncakeBackend


class Reachable(Protocol):
    """Where peers reach an engine (``engine.join.Advertised``)."""

    host: str
    protocol: str
    rdma_devices: str


def data_plane(advertised: Reachable, config: ClusterConfig,
               key: EngineKey | None) -> tuple[MooncakeBackend, TrafficManager]:
    """The engine's Mooncake backend at its advertised address and its traffic manager, its
    grant server at the same host under ``key``'s pair (module docstring)."""
    from dualpath.transfer.mooncake import MooncakeBackend

    backend = MooncakeBackend(advertised.host, advertised.protocol, advertised.rdma_devices,
                              open_listeners=config.transfer_open_listeners)
    try:
        traffic = TrafficManager(backend, config.traffic, nic_host=advertised.host,
                                 keys=key.keys if key is not None else None)
    except BaseException:
        backend.close()
        raise
    return backend, traffic


def admit_peers(backend: TransferBackend, traffic: TrafficManager,
                peers: Iterable[PeerInfo]) -> None:
    """Admit exactly ``peers`` (the other engines the router names): their hosts to the
    backend's listeners (besides loopback), their public keys to the grant server."""
    peers = list(peers)
    allow = getattr(backend, "allow_hosts", None)
    if allow is not None:
        allow(peer_hosts(a for p in peers for a in (p.endpoint, p.nic_address)))
    admit = getattr(traffic, "admit_peers", None)
    if admit is not None:
        admit({p.endpoint: p.public_key for p in peers if p.public_key})
