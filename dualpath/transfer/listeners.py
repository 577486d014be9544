"""Which TCP ports a process listens on, and on which address: what ``ss -ltnp`` shows, read
from ``/proc`` (the process's socket descriptors matched against its network namespace's
``net/tcp`` and ``net/tcp6`` tables).

Mooncake Transfer Engine offers no bind address (``transfer/firewall.py`` says what it does
offer): ``MooncakeBackend`` compares this process's listeners before and after it starts an
engine to learn the ports that engine opened, and the tests compare a whole process tree's
listeners with the fences that cover them.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

TCP_LISTEN = "0A"  # the LISTEN state in /proc/net/tcp
WILDCARDS = frozenset({"0.0.0.0", "::"})
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


@dataclass(frozen=True, order=True)
class Listener:
    """One listening TCP socket: its bound address (``0.0.0.0``/``::`` for every interface),
    its port and the process holding it."""

    address: str
    port: int
    pid: int

    @property
    def wildcard(self) -> bool:
        """True when it listens on every interface."""
        return self.address in WILDCARDS


def listeners(pids: Iterable[int] | None = None) -> list[Listener]:
    """The listening TCP sockets of ``pids`` (default: this process), sorted; a process that
    is gone or unreadable has none."""
    found: set[Listener] = set()
    for pid in [os.getpid()] if pids is None else pids:
        inodes = _socket_inodes(pid)
        if not inodes:
            continue
        for table in ("tcp", "tcp6"):
            for inode, address, port in _listening(Path(f"/proc/{pid}/net/{table}")):
                if inode in inodes:
                    found.add(Listener(address, port, pid))
    return sorted(found)


def process_tree(root: int) -> list[int]:
    """``root`` and every process descended from it (children of children too)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            parent = _parent(int(entry.name))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
    return tree


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) means this machine's loopback only."""
    if host.strip("[]") in LOOPBACK_NAMES:
        return True
    try:
        return _ip(host.strip("[]")).startswith(("127.", "::1"))
    except ValueError:
        return False


def _ip(text: str) -> str:
    """``text`` as a canonical IP address (``ValueError`` when it is none)."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            return socket.inet_ntop(family, socket.inet_pton(family, text))
        except OSError:
            continue
    raise ValueError(f"{text!r} is not an IP address")


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:["):-1]))
    return inodes


def _listening(table: Path) -> list[tuple[int, str, int]]:
    """(inode, address, port) of each LISTEN row of a ``/proc/PID/net/tcp{,6}`` table."""
    try:
        lines = table.read_text().splitlines()[1:]
    except OSError:
        return []
    rows = []
    for line in lines:
        fields = line.split()
        if len(fields) < 10 or fields[3] != TCP_LISTEN:
            continue
        hex_address, hex_port = fields[1].split(":")
        rows.append((int(fields[9]), _address(hex_address), int(hex_port, 16)))
    return rows


def _address(hex_address: str) -> str:
    """An address as ``/proc/net/tcp{,6}`` writes it (32-bit words in host order)."""
    raw = bytes.fromhex(hex_address)
    if sys.byteorder == "little":
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, raw)


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])
