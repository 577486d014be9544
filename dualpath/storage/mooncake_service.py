"""The processes behind the ``mooncake_store`` backend: its master and segment holders.

A *segment holder* is a Mooncake Store client that only contributes memory: the blocks live
there, apart from the engines, which come and go. Run one per host that lends memory::

    python -m dualpath.storage.mooncake_store master --port 50051
    python -m dualpath.storage.mooncake_store serve --master HOST:50051 --segment-mb 4096 --host H

Tests and benchmarks start both with ``local_mooncake`` (a free port, stopped afterwards).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dualpath.errors import StorageError

if TYPE_CHECKING:
    from argparse import ArgumentParser
from dualpath.storage.mooncake_store import INSTALL_HINT, connect, master_reachable

READY_LINE = "mooncake-segment-ready"  # a holder prints it once its segment is mounted
CLOSE_TIMEOUT_S = 10.0  # a stopping holder waits this long for its segment to unmount

def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def master_binary() -> Path:
    """The ``mooncake_master`` executable of the installed wheel (``StorageError`` if none)."""
    spec = importlib.util.find_spec("mooncake")  # finds the package without importing it
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        candidate = Path(folder) / "mooncake_master"
        if os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("mooncake_master")
    if found is None:
        raise StorageError(f"no mooncake_master executable (searched {folders} and PATH); "
                           f"{INSTALL_HINT}")
    return Path(found)


def start_master(port: int, *, host: str = "127.0.0.1", log_path: str | Path | None = None,
                 ready_timeout_s: float = 15.0, extra_args: Sequence[str] = (),
                 wrap: Sequence[str] = ()) -> subprocess.Popen[bytes]:
    """Start ``mooncake_master`` on ``host:port``; returns once the port accepts connections.

    Its glog output goes to ``log_path`` (discarded when None). ``wrap`` prefixes the command
    (e.g. ``ip netns exec NS`` to run it on another emulated host). ``StorageError`` if the
    binary is missing, something already listens there, or the master exits or does not
    listen within ``ready_timeout_s``.
    """
    if master_reachable(f"{host}:{port}", 0.2):
        raise StorageError(f"cannot start mooncake_master: something already listens on "
                           f"{host}:{port}")
    metrics_port = free_port("127.0.0.1" if wrap else host)  # a guess elsewhere: likely free
    args = [*wrap, str(master_binary()), f"--rpc_port={port}", f"--rpc_address={host}",
            f"--metrics_port={metrics_port}", f"--metrics_host={host}",
            "--enable_metric_reporting=false", *extra_args]
    with _log_file(log_path) as log_file:
        proc = subprocess.Popen(args, stdout=log_file, stderr=log_file, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + ready_timeout_s
    while not master_reachable(f"{host}:{port}", 0.2):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise StorageError(f"mooncake_master on {host}:{port} did not start (exit "
                               f"{proc.returncode}){_tail(log_path)}")
        time.sleep(0.05)
    return proc


def start_segment_holder(master: str, segment_mb: int, *, host: str = "127.0.0.1",
                         log_path: str | Path | None = None, ready_timeout_s: float = 30.0,
                         wrap: Sequence[str] = ()) -> subprocess.Popen[bytes]:
    """Start a process that contributes ``segment_mb`` of memory to the store (``serve``);
    returns once its segment is mounted (``StorageError`` if it fails or times out).
    ``wrap`` prefixes the command, as for ``start_master``."""
    args = [*wrap, sys.executable, "-m", "dualpath.storage.mooncake_store", "serve",
            "--master", master, "--segment-mb", str(segment_mb), "--host", host]
    with _log_file(log_path) as log_file:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log_file,
                                stdin=subprocess.DEVNULL)
    if not _await_line(proc, READY_LINE, ready_timeout_s):
        stop(proc)
        raise StorageError(f"Mooncake segment holder ({segment_mb} MB, master {master}) did "
                           f"not start (exit {proc.returncode}){_tail(log_path)}")
    return proc


@contextlib.contextmanager
def local_mooncake(segment_mb: int, *, host: str = "127.0.0.1",
                   log_dir: str | Path | None = None) -> Iterator[str]:
    """A master on a free port and one segment holder of ``segment_mb``; yields the master's
    ``host:port`` and stops both afterwards, whatever happens."""
    logs = Path(log_dir) if log_dir is not None else None
    if logs is not None:
        logs.mkdir(parents=True, exist_ok=True)
    port = free_port(host)
    master = start_master(port, host=host,
                          log_path=None if logs is None else logs / "mooncake_master.log")
    holder = None
    try:
        holder = start_segment_holder(
            f"{host}:{port}", segment_mb, host=host,
            log_path=None if logs is None else logs / "mooncake_segment.log")
        yield f"{host}:{port}"
    finally:
        if holder is not None:
            stop(holder)
        stop(master)


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    """SIGTERM a process, SIGKILL it if it is still there after ``timeout_s``, and reap it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def serve(master: str, segment_mb: int, *, host: str = "127.0.0.1",
          metadata_server: str = "P2PHANDSHAKE", protocol: str = "tcp",
          device_name: str = "") -> int:
    """Hold a ``segment_mb`` segment of the store until SIGTERM or SIGINT; returns 0.

    Prints ``READY_LINE`` on stdout once the segment is mounted.
    """
    if segment_mb <= 0:
        raise StorageError(f"a segment holder needs segment_mb > 0, got {segment_mb}")
    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    client = connect(master, metadata_server=metadata_server, local_host=host,
                     protocol=protocol, device_name=device_name, segment_mb=segment_mb)
    print(f"{READY_LINE} {segment_mb} MB on {host} for master {master}", flush=True)
    while not stopping.wait(1.0):
        pass
    # Unmounting asks the master; a busy or gone master must not keep a stopping holder alive
    # (its segment leaves with the process either way).
    closer = threading.Thread(target=client.close, name="segment-close", daemon=True)
    closer.start()
    closer.join(CLOSE_TIMEOUT_S)
    if closer.is_alive():
        print(f"segment holder: close did not finish in {CLOSE_TIMEOUT_S:.0f} s; exiting",
              file=sys.stderr, flush=True)
    # Exit here, not through finalization: the transfer engine's native threads can keep a
    # finalizing interpreter waiting (a holder stopped under load took over 30 s), and a holder
    # has nothing left to flush or free once its segment is unmounted or abandoned.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
    return 0  # only where os._exit is replaced (tests)


def _serve_master(port: int, host: str) -> int:
    """Run ``mooncake_master`` on ``host:port`` until SIGTERM or SIGINT; returns its exit code."""
    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    proc = start_master(port, host=host, log_path="/dev/stderr")
    print(f"mooncake_master listening on {host}:{port}", flush=True)
    while not stopping.wait(1.0) and proc.poll() is None:
        pass
    stop(proc)
    return proc.returncode or 0


@contextlib.contextmanager
def _log_file(path: str | Path | None) -> Iterator[Any]:
    if path is None:
        yield subprocess.DEVNULL
        return
    with open(path, "ab") as file:
        yield file


def _await_line(proc: subprocess.Popen[bytes], prefix: str, timeout_s: float) -> bool:
    """Whether ``proc`` prints a line starting with ``prefix`` within ``timeout_s``."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if not ready:
            break
        line = proc.stdout.readline()
        if not line:  # the process closed stdout: it exited
            return False
        if line.decode(errors="replace").startswith(prefix):
            return True
    return False


def _tail(log_path: str | Path | None, lines: int = 5) -> str:
    if log_path is None or not Path(log_path).is_file():
        return ""
    text = Path(log_path).read_text(errors="replace").splitlines()[-lines:]
    return ": " + " | ".join(text)


@dataclass(frozen=True)
class SegmentHolderOptions:
    """``dualpath mooncake serve`` (``python -m dualpath.storage.mooncake_store serve``)."""

    segment_mb: int
    master: str = "127.0.0.1:50051"
    host: str = "127.0.0.1"
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    device_name: str = ""


def segment_add_arguments(parser: ArgumentParser) -> None:
    """The options of :class:`SegmentHolderOptions`."""
    parser.add_argument("--master", default="127.0.0.1:50051", help="the master's host:port")
    parser.add_argument("--segment-mb", type=int, required=True,
                        help="memory to contribute (MB)")
    parser.add_argument("--host", default="127.0.0.1", help="the address peers reach this at")
    parser.add_argument("--metadata-server", default="P2PHANDSHAKE")
    parser.add_argument("--protocol", default="tcp")
    parser.add_argument("--device-name", default="", help="RDMA devices (rdma only)")


def segment_run(options: SegmentHolderOptions) -> int:
    """Hold a segment until SIGTERM."""
    return serve(options.master, options.segment_mb, host=options.host,
                 metadata_server=options.metadata_server, protocol=options.protocol,
                 device_name=options.device_name)


@dataclass(frozen=True)
class MasterOptions:
    """``dualpath mooncake master`` (``python -m dualpath.storage.mooncake_store master``)."""

    port: int = 50051
    host: str = "127.0.0.1"


def master_add_arguments(parser: ArgumentParser) -> None:
    """The options of :class:`MasterOptions`."""
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on")


def master_run(options: MasterOptions) -> int:
    """Run ``mooncake_master`` until SIGTERM."""
    return _serve_master(options.port, options.host)


def main(argv: Sequence[str] | None = None) -> int:
    """``serve`` (hold a segment) or ``master`` (run ``mooncake_master``) until SIGTERM: the
    ``dualpath mooncake`` commands."""
    from dualpath.cli import main as cli_main

    return cli_main(["mooncake", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
