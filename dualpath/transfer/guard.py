"""Keeping a transfer engine's listeners to the cluster: bound to the engine's address where the
transfer engine allows it, else fenced to the cluster's hosts, else refused unless opted out.

Mooncake allows no bind address (``transfer/firewall.py``), so a ``MooncakeBackend`` guards the
ports it opened on every interface (``guard_listeners``):

- where this process can install firewall rules (root and ``nft``), a ``PortFence`` admits
  only loopback at first; the engine admits its peers' hosts as the router's ``Peers`` names
  them (``ListenerGuard.allow``; ``peer_hosts`` reads them from their endpoints);
- else, on a loopback engine, a warning says the ports are open to any host that reaches this
  machine;
- else (an engine other hosts reach) the backend is refused (``ListenerError``) unless the
  cluster opts out with ``transfer_open_listeners = true`` (the operator firewalls the ports),
  which is also said at start. The opt-out also means: no fence, even where one could be made.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from urllib.parse import urlsplit

from dualpath.errors import TransferError
from dualpath.transfer.firewall import FirewallError, PortFence, fence_unavailable
from dualpath.transfer.listeners import Listener, is_loopback

log = logging.getLogger("dualpath.transfer")

OPT_OUT = "transfer_open_listeners"  # the ClusterConfig key that leaves the listeners open


class ListenerError(TransferError):
    """A transfer engine listens on every interface, can be neither bound nor fenced, and the
    cluster did not opt out (``transfer_open_listeners``)."""


class ListenerGuard:
    """What keeps one transfer engine's wildcard listeners to the cluster: a fence (or none:
    nothing to fence, or left open as configured or on a loopback engine)."""

    def __init__(self, ports: tuple[int, ...], fence: PortFence | None) -> None:
        self.ports = ports
        self.fence = fence

    @property
    def fenced(self) -> bool:
        """True when a firewall fence covers the ports."""
        return self.fence is not None

    def allow(self, hosts: Iterable[str]) -> None:
        """Admit ``hosts`` (besides loopback) instead of the previous set; no-op unfenced."""
        if self.fence is not None:
            hosts = frozenset(hosts)
            if hosts != self.fence.hosts:
                self.fence.allow(hosts)

    def close(self) -> None:
        """Remove the fence (call once the listeners are closed)."""
        if self.fence is not None:
            self.fence.close()


def guard_listeners(opened: Iterable[Listener], host: str, open_listeners: bool,
                    what: str = "Mooncake") -> ListenerGuard:
    """The guard of the listeners a transfer engine advertised at ``host`` opened:
    ``ListenerError`` when wildcard ones can be neither fenced nor left open (module
    docstring)."""
    ports = tuple(sorted({item.port for item in opened if item.wildcard}))
    if not ports:
        return ListenerGuard((), None)
    listed = ", ".join(map(str, ports))
    if open_listeners:
        log.warning("%s = true: %s listens on every interface (TCP ports %s) unfenced; only a "
                    "firewall of yours keeps hosts outside the cluster from the registered "
                    "memory", OPT_OUT, what, listed)
        return ListenerGuard(ports, None)
    why = fence_unavailable()
    if why is None:
        try:
            return ListenerGuard(ports, PortFence(ports))
        except FirewallError as exc:
            why = str(exc)
    if is_loopback(host):
        log.warning("%s listens on every interface (TCP ports %s) and cannot be fenced (%s): "
                    "any host that reaches this machine can read and write its registered "
                    "memory", what, listed, why)
        return ListenerGuard(ports, None)
    raise ListenerError(f"{what} listens on every interface (TCP ports {listed}) whatever "
                        f"address it is given ({host}), and fencing those ports to the "
                        f"cluster's hosts failed: {why}. Run the engine as root with nftables "
                        f"installed, or firewall the ports yourself and set {OPT_OUT} = true")


def peer_hosts(addresses: Iterable[str]) -> set[str]:
    """The hosts of transfer endpoints (``host:port``, ``[v6]:port``) and socket addresses
    (``tcp://host:port``); empty and malformed ones are left out."""
    hosts = set()
    for address in addresses:
        if not address:
            continue
        text = address if "://" in address else f"tcp://{address}"
        try:
            host = urlsplit(text).hostname
        except ValueError:
            continue
        if host and host != "*":
            hosts.add(host)
    return hosts
