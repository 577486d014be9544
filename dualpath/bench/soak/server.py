"""The soak's ``dualpath serve`` subprocess: start it on a free port, wait for ``/health``,
stop it and its engines; and the resident memory of it and each of its child processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx2
import psutil

from dualpath.bench.soak.settings import SoakError, SoakSettings

STOP_TIMEOUT_S = 30.0  # SIGINT to exit before the server is killed
MB = 1 << 20


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServeProcess:
    """A running ``dualpath serve`` subprocess."""

    proc: subprocess.Popen
    base_url: str
    log_path: Path

    def log_tail(self, chars: int = 3000) -> str:
        """The end of its output."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def engine_log_dir(self) -> str | None:
        """Where it wrote the engines' logs (the path it prints when ready)."""
        for line in self.log_tail(20_000).splitlines():
            if "logs and resolved config:" in line:
                return line.split("logs and resolved config:", 1)[1].strip()
        return None


def serve_command(settings: SoakSettings, port: int, storage: Path) -> list[str]:
    """The ``dualpath serve`` command line of a soak."""
    cmd = [sys.executable, "-m", "dualpath.cli", "serve", "--port", str(port),
           "--prefill", str(settings.prefill), "--decode", str(settings.decode),
           "--storage", str(storage)]
    if settings.model:
        cmd += ["--model", settings.model]
    for item in settings.serve_sets:
        cmd += ["--set", item]
    return cmd


def start_server(settings: SoakSettings, work: Path, attempts: int = 3) -> ServeProcess:
    """Start ``dualpath serve`` and wait until ``/health`` answers 200 (another port when the
    probed one was taken meanwhile)."""
    for attempt in range(attempts):
        port = _free_port()
        log_path = work / f"serve-{attempt}.log"
        with log_path.open("w") as out:
            proc = subprocess.Popen(serve_command(settings, port, work / "kv"), stdout=out,
                                    stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
        server = ServeProcess(proc, f"http://127.0.0.1:{port}", log_path)
        if _wait_ready(server, settings.startup_timeout_s):
            return server
    raise SoakError(f"no free port for dualpath serve in {attempts} tries")


def _wait_ready(server: ServeProcess, timeout_s: float) -> bool:
    """True once healthy; False if its port was taken; SoakError if it failed otherwise."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            if "address already in use" in server.log_tail().lower():
                return False
            raise SoakError(f"dualpath serve exited with {server.proc.returncode}:\n"
                            f"{server.log_tail()}")
        try:
            if httpx2.get(f"{server.base_url}/health", timeout=2,
                          trust_env=False).status_code == 200:
                return True
        except httpx2.TransportError:
            pass
        time.sleep(0.5)
    stop_server(server)
    raise SoakError(f"dualpath serve not ready within {timeout_s:g} s:\n{server.log_tail()}")


def served_model(server: ServeProcess) -> str:
    """The model name the server serves (``/v1/models``)."""
    reply = httpx2.get(f"{server.base_url}/v1/models", timeout=30, trust_env=False)
    reply.raise_for_status()
    return reply.json()["data"][0]["id"]


def stop_server(server: ServeProcess) -> int | None:
    """SIGINT (the server stops its engines), then kill it and any engine left; its exit code."""
    children = _children(server.proc.pid)
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGINT)
        try:
            server.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()
    _, alive = psutil.wait_procs(children, timeout=5)
    for proc in alive:
        proc.kill()
    return server.proc.returncode


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


# -- memory -------------------------------------------------------------------------------------


def _label(proc: psutil.Process) -> str:
    """An engine's ``--name`` (pe0, de1 …), else the process name and pid."""
    try:
        cmd = proc.cmdline()
    except psutil.Error:
        cmd = []
    if "--name" in cmd[:-1]:
        return cmd[cmd.index("--name") + 1]
    try:
        return f"{proc.name()}-{proc.pid}"
    except psutil.Error:
        return f"pid-{proc.pid}"


def tree_rss_mb(pid: int) -> dict[str, float]:
    """RSS (MB) of process ``pid`` (as ``serve``) and each of its descendants, by label."""
    rss: dict[str, float] = {}
    try:
        root = psutil.Process(pid)
        rss["serve"] = root.memory_info().rss / MB
    except psutil.Error:
        return rss
    for child in _children(pid):
        try:
            rss[_label(child)] = child.memory_info().rss / MB
        except psutil.Error:
            continue  # gone meanwhile
    return rss

