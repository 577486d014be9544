"""Host firewall fences (nftables) for listeners that cannot be bound to one address.

What the installed Mooncake Transfer Engine (0.3.13) allows, read in its sources and measured
with ``ss -ltnp``: nothing binds its listeners to an address. With the P2P handshake (what
``MooncakeBackend`` uses) the RPC/handshake port is bound to ``INADDR_ANY`` (``IN6ADDR_ANY``
with ``MC_USE_IPV6``) by ``findAvailableTcpPort``, and the TCP transport's data port to an IPv6
dual-stack wildcard (``TcpContext``); ``MC_TCP_BIND_ADDRESS`` only changes the address a
non-P2P engine *advertises* and ``MC_RDMA_BIND_ADDRESS`` the RDMA path's; ``MC_MIN_RPC_PORT``/
``MC_MAX_RPC_PORT`` only pick the range the ports are drawn from. So whoever reaches the
machine reaches every registered region, and the ports are fenced instead.

A ``PortFence`` is one nftables table of the ``inet`` family, named after its process
(``dualpath_<pid>_<start time>_<n>``), whose input hook admits TCP packets for its ports only
from loopback and from its allowed hosts and answers every other with a TCP reset. Tables of
processes that are gone (killed before they could remove theirs) are swept whenever a fence is
made. Fencing needs root and the ``nft`` tool (Debian's ``nftables``); ``fence_unavailable``
says why it cannot be used. RDMA traffic bypasses the host's firewall: a fence covers the TCP
ports only (the handshake, and the data port of the ``tcp`` protocol).
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import socket
import subprocess
import weakref
from collections.abc import Iterable
from pathlib import Path

from dualpath.errors import TransferError

log = logging.getLogger("dualpath.transfer")

NFT = "nft"
TABLE_PREFIX = "dualpath_"
NFT_TIMEOUT_S = 10.0
_fence_ids = itertools.count(1)


class FirewallError(TransferError):
    """An nftables command failed (its error is included)."""


def fence_unavailable() -> str | None:
    """Why this process cannot install fences (not root, no ``nft``, nftables refused), else
    None."""
    if os.geteuid() != 0:
        return "installing firewall rules needs root"
    if shutil.which(NFT) is None:
        return "`nft` (Debian's nftables) is not installed"
    try:
        _nft(["list", "tables"])
    except FirewallError as exc:
        return str(exc)
    return None


def resolve_hosts(hosts: Iterable[str]) -> tuple[set[str], set[str]]:
    """The IPv4 and IPv6 addresses of ``hosts`` (names or addresses); a name that does not
    resolve is logged and left out."""
    v4: set[str] = set()
    v6: set[str] = set()
    for host in hosts:
        name = host.strip("[]")
        try:
            infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
        except OSError as exc:
            log.warning("firewall: cannot resolve %r (%s): left out", host, exc)
            continue
        for family, _, _, _, address in infos:
            ip = str(address[0]).split("%")[0]  # an IPv6 scope id is no set element
            (v4 if family == socket.AF_INET else v6).add(ip)
    return v4, v6


class PortFence:
    """An nftables table that admits TCP packets for ``ports`` only from loopback and the
    allowed hosts (every other gets a reset); ``close`` removes it."""

    def __init__(self, ports: Iterable[int], hosts: Iterable[str] = ()) -> None:
        """Install the table now (``FirewallError`` when nftables refuses it); sweep the tables
        of processes that are gone first."""
        self.ports = tuple(sorted(set(ports)))
        if not self.ports or not all(0 < p < 65536 for p in self.ports):
            raise ValueError(f"a fence needs TCP ports in 1..65535, got {self.ports}")
        sweep_stale_fences()
        self.table = f"{TABLE_PREFIX}{os.getpid()}_{_start_time(os.getpid())}_{next(_fence_ids)}"
        self.hosts: frozenset[str] = frozenset()
        _nft_script(self._create_script())
        # removed when this object goes, or at the latest when the interpreter exits
        self._remove = weakref.finalize(self, _delete_table, self.table)
        try:
            self.allow(hosts)
        except BaseException:
            self.close()
            raise

    def allow(self, hosts: Iterable[str]) -> None:
        """Admit ``hosts`` (names or addresses) besides loopback, instead of the previous set,
        in one nftables transaction."""
        hosts = frozenset(hosts)
        v4, v6 = resolve_hosts(hosts)
        t = f"inet {self.table}"
        lines = [f"flush set {t} hosts4", f"flush set {t} hosts6"]
        if v4:
            lines.append(f"add element {t} hosts4 {{ {', '.join(sorted(v4))} }}")
        if v6:
            lines.append(f"add element {t} hosts6 {{ {', '.join(sorted(v6))} }}")
        _nft_script(lines)
        self.hosts = hosts

    def close(self) -> None:
        """Remove the table (idempotent; a table already gone is fine)."""
        self._remove()

    def _create_script(self) -> list[str]:
        t = f"inet {self.table}"
        return [f"add table {t}",
                f"add set {t} hosts4 {{ type ipv4_addr; }}",
                f"add set {t} hosts6 {{ type ipv6_addr; }}",
                f"add set {t} ports {{ type inet_service; }}",
                f"add element {t} ports {{ {', '.join(map(str, self.ports))} }}",
                f"add chain {t} fence",
                f'add rule {t} fence iif "lo" accept',
                f"add rule {t} fence ip saddr @hosts4 accept",
                f"add rule {t} fence ip6 saddr @hosts6 accept",
                f"add rule {t} fence counter reject with tcp reset",
                f"add chain {t} input {{ type filter hook input priority -5; policy accept; }}",
                f"add rule {t} input tcp dport @ports jump fence"]


def fenced_ports() -> dict[str, tuple[int, ...]]:
    """The ports of every dualpath fence installed now, by table ({} when nftables cannot be
    read)."""
    try:
        names = _table_names()
    except FirewallError:
        return {}
    fences = {}
    for name in names:
        try:
            text = _nft(["list", "set", "inet", name, "ports"])
        except FirewallError:
            continue  # removed meanwhile
        elements = text.split("elements = {", 1)[1].split("}", 1)[0] if "elements" in text else ""
        fences[name] = tuple(sorted(int(p) for p in elements.replace(",", " ").split()))
    return fences


def sweep_stale_fences() -> list[str]:
    """Remove the fences of processes that are gone (by pid and start time); their names."""
    try:
        names = _table_names()
    except FirewallError:
        return []
    swept = []
    for name in names:
        parts = name[len(TABLE_PREFIX):].split("_")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            continue
        pid, started = int(parts[0]), int(parts[1])
        if _start_time(pid) == started:
            continue  # its process runs
        try:
            _nft(["delete", "table", "inet", name])
            swept.append(name)
        except FirewallError:
            pass  # another process swept it first
    if swept:
        log.info("firewall: removed %d fences of processes that are gone", len(swept))
    return swept


def _delete_table(table: str) -> None:
    try:
        _nft(["delete", "table", "inet", table])
    except FirewallError as exc:
        log.warning("firewall: could not remove %s: %s", table, exc)


def _table_names() -> list[str]:
    text = _nft(["list", "tables", "inet"])
    return [line.split()[-1] for line in text.splitlines()
            if line.startswith("table inet ") and line.split()[-1].startswith(TABLE_PREFIX)]


def _start_time(pid: int) -> int:
    """A process's start time (clock ticks since boot), -1 when it is gone: with the pid it
    names the process even once the pid is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    return int(stat.rsplit(")", 1)[1].split()[19])


def _nft(argv: list[str], stdin: str | None = None) -> str:
    try:
        done = subprocess.run([NFT, *argv], input=stdin, capture_output=True, text=True,
                              timeout=NFT_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise FirewallError(f"`nft {' '.join(argv)}` failed: {exc}") from exc
    if done.returncode != 0:
        raise FirewallError(f"`nft {' '.join(argv)}` failed: {done.stderr.strip()}")
    return done.stdout


def _nft_script(lines: list[str]) -> None:
    """Run ``lines`` as one nftables transaction (all or nothing)."""
    _nft(["-f", "-"], stdin="\n".join(lines) + "\n")
