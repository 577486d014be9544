"""Start a local PD cluster: the router in this process, each engine as its own OS process.

Prefill engine i runs on node i and decode engine j on node ``num_prefill + j``, each with its
own storage client (its node's storage NIC and read queue) over the shared store root, and its
own Mooncake endpoint. Engine logs go to ``log_dir``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

from dualpath.config import ClusterConfig, cluster_config_to_json
from dualpath.errors import DualPathError
from dualpath.request import SamplingParams
from dualpath.server.router import ClusterOutput, RequestFuture, Router

STARTUP_TIMEOUT_S = 180.0
WATCH_INTERVAL_S = 0.2


class LocalCluster:
    """A router plus ``num_prefill`` PE and ``num_decode`` DE processes (a context manager)."""

    def __init__(self, model_dir: str | Path, config: ClusterConfig,
                 log_dir: str | Path | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.config = config
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="dualpath-logs-"))
        self.router: Router | None = None
        self._procs: list[subprocess.Popen] = []
        self._names: dict[str, subprocess.Popen] = {}  # engine name -> its process
        self._stopping = threading.Event()

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start the router and the engines; wait until every engine said hello."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.router = Router(self.model_dir, self.config)
        roles = ["prefill"] * self.config.num_prefill + ["decode"] * self.config.num_decode
        for node_id, role in enumerate(roles):
            name = f"{role[0]}e{node_id}"
            self._names[name] = self._spawn(name, role, node_id)
            self._procs.append(self._names[name])
        try:
            self.router.wait_for_engines(len(roles), STARTUP_TIMEOUT_S)
        except DualPathError as exc:
            self.stop()
            raise DualPathError(f"{exc}; see the logs in {self.log_dir}") from exc
        self._watcher = threading.Thread(target=self._watch, name="engine-watch", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        """Tell the router when an engine process exits on its own."""
        reported: set[str] = set()
        while not self._stopping.wait(WATCH_INTERVAL_S):
            for name, proc in self._names.items():
                if name not in reported and proc.poll() is not None:
                    reported.add(name)
                    if self.router is not None:
                        self.router.engine_lost(name)

    def _spawn(self, name: str, role: str, node_id: int) -> subprocess.Popen:
        assert self.router is not None
        cmd = [sys.executable, "-m", "dualpath.cli", "engine", "--role", role,
               "--node-id", str(node_id), "--name", name, "--router", self.router.address,
               "--model", str(self.model_dir), "--config", cluster_config_to_json(self.config)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        log = (self.log_dir / f"{name}.log").open("w")
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def submit(self, prompt_ids: list[int], params: SamplingParams, mode: str | None = None,
               read_path: str | None = None,
               on_tokens: Callable[[tuple[int, ...]], None] | None = None) -> RequestFuture:
        """Start one request; ``on_tokens`` as in :meth:`Router.submit` (streamed tokens)."""
        assert self.router is not None, "start() the cluster first"
        return self.router.submit(prompt_ids, params, mode, read_path, on_tokens)

    def abort(self, future: RequestFuture) -> None:
        """Cancel a submitted request wherever it is; its future fails with RequestAborted."""
        assert self.router is not None, "start() the cluster first"
        self.router.abort(future.req_id)

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 mode: str | None = None, read_path: str | None = None,
                 timeout_s: float = 600.0) -> list[ClusterOutput]:
        """Run prompts concurrently; outputs in prompt order. Requests not done within
        ``timeout_s`` are aborted on their engines and ``TimeoutError`` is raised."""
        futures = [self.submit(p, params, mode, read_path) for p in prompts]
        deadline = time.monotonic() + timeout_s
        try:
            return [f.result(max(0.0, deadline - time.monotonic())) for f in futures]
        except FutureTimeout as exc:
            for f in futures:
                if not f.done():
                    self.abort(f)
            raise TimeoutError(f"requests not done within {timeout_s:g} s were aborted") from exc

    def process(self, name: str) -> subprocess.Popen:
        """The OS process of engine ``name`` (e.g. to stop it in a failure test)."""
        return self._names[name]

    def metrics(self) -> dict[str, dict]:
        """Every engine's counters."""
        assert self.router is not None
        return self.router.collect_metrics()

    def stop(self) -> None:
        """Shut engines down (killing stragglers) and stop the router."""
        self._stopping.set()
        if self.router is not None:
            self.router.shutdown()
            self.router = None
        for proc in self._procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs.clear()
