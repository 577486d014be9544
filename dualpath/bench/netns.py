"""Several hosts on one machine: network namespaces joined by veth links on bridges (root only).

Each host is a network namespace with one link per network to that network's bridge in the
root namespace: ``c0`` on the compute network ``10.77.<net>.0/24`` and, when asked for, ``s0``
on the storage network ``10.78.<net>.0/24`` (the root namespace itself is ``.254`` on each, so
a router or a client here reaches every host). A link can be shaped with ``tc tbf`` in both
directions (the namespace's egress is the NIC's send side, the bridge port's egress its
receive side), cut (``ip link set ... down``) and restored. Processes run in a host with
``exec_argv`` (``ip netns exec``); they see the same files (a shared store folder works as
it would on a shared mount) but only their own network.

This is testbed configuration, off unless asked for: the multi-host tests and
``bench cluster --links shaped`` use it; nothing else does.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from dataclasses import dataclass

from dualpath.errors import DualPathError

LATENCY_MS = 200  # how long tbf queues a packet before dropping it (the link's buffer)
MIN_BURST_BYTES = 32 * 1024


class NetnsError(DualPathError):
    """A namespace, link or qdisc could not be set up (the ``ip``/``tc`` error is included)."""


def netns_unavailable() -> str | None:
    """Why namespaces cannot be used here (not root, no ``ip`` or ``tc``), else None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    return None


@dataclass(frozen=True)
class LinkShape:
    """A host link's caps in MB/s (None: unshaped)."""

    send_mb_s: float | None = None
    recv_mb_s: float | None = None


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")


LINK_SUBNETS = {"c0": 77, "s0": 78}  # link name -> second octet of its network


class NetnsHosts:
    """``hosts`` namespaces on one bridge per link; a context manager that always tears down.

    ``tag`` (a few letters) keeps names apart from another set's; ``net`` picks the subnets
    (``10.77.<net>.0/24`` for ``c0``); ``links`` names the networks every host joins. Host
    ``i`` (in the order given) is ``.<i + 1>`` on each.
    """

    def __init__(self, hosts: list[str], tag: str = "dp", net: int = 0,
                 links: tuple[str, ...] = ("c0",)) -> None:
        if not hosts or len(hosts) > 200 or not tag.isalnum() or len(tag) > 4:
            raise ValueError("1..200 hosts and a tag of at most 4 letters or digits")
        unknown = set(links) - LINK_SUBNETS.keys()
        if not links or unknown:
            raise ValueError(f"links must be among {sorted(LINK_SUBNETS)}, got {links}")
        self.hosts = list(hosts)
        self.tag, self.net, self.links = tag, net, tuple(links)

    def __enter__(self) -> NetnsHosts:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def namespace(self, host: str) -> str:
        """The namespace of ``host``."""
        return f"{self.tag}{self.net}-{host}"

    def address(self, host: str, link: str = "c0") -> str:
        """``host``'s address on ``link``'s network."""
        return f"10.{LINK_SUBNETS[link]}.{self.net}.{self.hosts.index(host) + 1}"

    def gateway(self, link: str = "c0") -> str:
        """The root namespace's address on ``link``'s network."""
        return f"10.{LINK_SUBNETS[link]}.{self.net}.254"

    def bridge(self, link: str) -> str:
        """The bridge of ``link``'s network."""
        return f"{self.tag}b{self.net}{link[0]}"

    def port(self, host: str, link: str = "c0") -> str:
        """The bridge-side end of ``host``'s ``link`` (in the root namespace)."""
        return f"{self.tag}{self.net}{link[0]}{self.hosts.index(host)}"

    def exec_argv(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def up(self) -> None:
        """Create the bridges, the namespaces and their links (leftovers of a crashed run with
        the same tag and net are removed first)."""
        reason = netns_unavailable()
        if reason is not None:
            raise NetnsError(reason)
        self.down()
        for link in self.links:
            _run("ip", "link", "add", self.bridge(link), "type", "bridge")
            _run("ip", "addr", "add", f"{self.gateway(link)}/24", "dev", self.bridge(link))
            _run("ip", "link", "set", self.bridge(link), "up")
        for host in self.hosts:
            ns = self.namespace(host)
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            for link in self.links:
                self._add_link(host, link)

    def _add_link(self, host: str, link: str) -> None:
        ns, port = self.namespace(host), self.port(host, link)
        _run("ip", "link", "add", port, "type", "veth", "peer", "name", link, "netns", ns)
        _run("ip", "link", "set", port, "master", self.bridge(link))
        _run("ip", "link", "set", port, "up")
        _run("ip", "-n", ns, "addr", "add", f"{self.address(host, link)}/24", "dev", link)
        _run("ip", "-n", ns, "link", "set", link, "up")

    def shape(self, host: str, shape: LinkShape, link: str = "c0") -> None:
        """Cap ``host``'s ``link``: send (its egress) and receive (the bridge port's egress)."""
        for cap, prefix, dev in ((shape.send_mb_s, ["-n", self.namespace(host)], link),
                                 (shape.recv_mb_s, [], self.port(host, link))):
            if cap is None:
                with contextlib.suppress(NetnsError):
                    _run("tc", *prefix, "qdisc", "del", "dev", dev, "root")
                continue
            rate_bytes_s = cap * 1e6
            burst = max(MIN_BURST_BYTES, int(rate_bytes_s * 0.002))
            _run("tc", *prefix, "qdisc", "replace", "dev", dev, "root", "tbf",
                 "rate", f"{int(rate_bytes_s * 8)}bit", "burst", str(burst),
                 "latency", f"{LATENCY_MS}ms")

    def cut(self, host: str) -> None:
        """Take every link of ``host`` down (a pulled cable: its processes keep running)."""
        for link in self.links:
            _run("ip", "link", "set", self.port(host, link), "down")

    def restore(self, host: str) -> None:
        """Bring every link of ``host`` back up."""
        for link in self.links:
            _run("ip", "link", "set", self.port(host, link), "up")

    def down(self) -> None:
        """Remove every namespace, link and bridge of this set (missing ones are fine)."""
        quiet = {"capture_output": True, "check": False}
        for host in self.hosts:
            subprocess.run(["ip", "netns", "del", self.namespace(host)], **quiet)
            for link in self.links:  # deleting a namespace deletes its veths; in case not:
                subprocess.run(["ip", "link", "del", self.port(host, link)], **quiet)
        for link in self.links:
            subprocess.run(["ip", "link", "del", self.bridge(link)], **quiet)
