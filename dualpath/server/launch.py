"""Start a PD cluster: the router in this process, each engine as its own OS process.

Prefill engine i runs on node i and decode engine j on node ``num_prefill + j``, each with its
own storage client (its node's storage NIC and read queue) over the shared store root, and its
own Mooncake endpoint. ``ClusterBase`` owns the router and the request API; a launcher
subclass places the engines: ``LocalCluster`` as children of this process (logs in
``log_dir``), ``RayCluster`` (``launch_ray.py``) as Ray actors, and ``ExternalCluster`` starts
none and waits for engines that join by ``dualpath engine --router tcp://HOST:PORT``.
Every launcher starts an engine with the same command line (``engine_command``): the engine
takes its configuration from the router, never from its arguments.
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

from dualpath.config import ClusterConfig
from dualpath.errors import DualPathError
from dualpath.request import SamplingParams
from dualpath.server.router import ClusterOutput, RequestFuture, Router

STARTUP_TIMEOUT_S = 180.0
WATCH_INTERVAL_S = 0.2


def engine_roles(config: ClusterConfig) -> list[tuple[str, str, int]]:
    """``(name, role, node_id)`` of every engine the config asks for, prefill first."""
    roles = ["prefill"] * config.num_prefill + ["decode"] * config.num_decode
    return [(f"{role[0]}e{node_id}", role, node_id) for node_id, role in enumerate(roles)]


def engine_command(name: str, role: str, node_id: int, router_address: str,
                   model_dir: str | Path, python: str = sys.executable) -> list[str]:
    """The command line that starts one engine and joins it to the router at
    ``router_address`` (``tcp://HOST:PORT``); the engine asks the router for its config."""
    return [python, "-m", "dualpath.cli", "engine", "--role", role, "--node-id", str(node_id),
            "--name", name, "--router", router_address, "--model", str(model_dir)]


def engine_env() -> dict[str, str]:
    """The environment an engine process runs with (one OpenMP thread, unbuffered logs)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


class ClusterBase:
    """A router plus engines that some launcher places (a context manager).

    Subclasses implement ``_start_engines`` (place every engine of ``engine_roles``),
    ``_stop_engines`` (after the router told them to shut down) and may call
    ``self.router.engine_lost(name)`` when their placement layer reports an engine gone.
    """

    def __init__(self, model_dir: str | Path, config: ClusterConfig,
                 log_dir: str | Path | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.config = config
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="dualpath-logs-"))
        self.router: Router | None = None
        self._stopping = threading.Event()

    def __enter__(self) -> ClusterBase:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start the router and the engines; wait until every engine said hello."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.router = Router(self.model_dir, self.config)
        count = self.config.num_prefill + self.config.num_decode
        try:
            self._start_engines()
            self.router.wait_for_engines(count, self._startup_timeout_s())
        except DualPathError as exc:
            self.stop()
            raise DualPathError(f"{exc}; see the logs in {self.log_dir}") from exc

    def _startup_timeout_s(self) -> float:
        return STARTUP_TIMEOUT_S

    def _start_engines(self) -> None:
        """Place every engine (non-blocking: ``start`` waits for their hellos)."""
        raise NotImplementedError

    def _stop_engines(self) -> None:
        """Wait for (or kill) the placed engines once the router has shut them down."""
        raise NotImplementedError

    def submit(self, prompt_ids: list[int], params: SamplingParams, mode: str | None = None,
               read_path: str | None = None,
               on_tokens: Callable[[tuple[int, ...]], None] | None = None,
               cache_salt: str = "") -> RequestFuture:
        """Start one request; ``on_tokens`` and ``cache_salt`` as in :meth:`Router.submit`."""
        assert self.router is not None, "start() the cluster first"
        return self.router.submit(prompt_ids, params, mode, read_path, on_tokens, cache_salt)

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
        self._stop_engines()


class LocalCluster(ClusterBase):
    """Engines as child processes of this one, logging to ``log_dir/NAME.log``."""

    def __init__(self, model_dir: str | Path, config: ClusterConfig,
                 log_dir: str | Path | None = None) -> None:
        super().__init__(model_dir, config, log_dir)
        self._names: dict[str, subprocess.Popen] = {}  # engine name -> its process

    def _start_engines(self) -> None:
        assert self.router is not None
        for name, role, node_id in engine_roles(self.config):
            cmd = self._engine_argv(name, role, node_id)
            log = (self.log_dir / f"{name}.log").open("w")
            self._names[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                 env=engine_env())
        watcher = threading.Thread(target=self._watch, name="engine-watch", daemon=True)
        watcher.start()

    def _engine_argv(self, name: str, role: str, node_id: int) -> list[str]:
        """How one engine is started (a subclass may run it elsewhere, e.g. in a namespace)."""
        assert self.router is not None
        return engine_command(name, role, node_id, self.router.address, self.model_dir)

    def _watch(self) -> None:
        """Tell the router when an engine process exits on its own."""
        reported: set[str] = set()
        while not self._stopping.wait(WATCH_INTERVAL_S):
            for name, proc in list(self._names.items()):
                if name not in reported and proc.poll() is not None:
                    reported.add(name)
                    if self.router is not None:
                        self.router.engine_lost(name)

    def process(self, name: str) -> subprocess.Popen:
        """The OS process of engine ``name`` (e.g. to stop it in a failure test)."""
        return self._names[name]

    def _stop_engines(self) -> None:
        for proc in self._names.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class ExternalCluster(ClusterBase):
    """Starts no engine: waits for ``num_prefill + num_decode`` engines to join the router
    (``dualpath engine --router tcp://HOST:PORT`` on their hosts; the router's engine
    endpoint binds ``config.router_host:config.router_port``)."""

    def __init__(self, model_dir: str | Path, config: ClusterConfig,
                 log_dir: str | Path | None = None, join_timeout_s: float = 600.0) -> None:
        super().__init__(model_dir, config, log_dir)
        self.join_timeout_s = join_timeout_s

    def _startup_timeout_s(self) -> float:
        return self.join_timeout_s

    def _start_engines(self) -> None:
        assert self.router is not None
        print(f"dualpath: waiting for {self.config.num_prefill} prefill + "
              f"{self.config.num_decode} decode engines to join {self.router.address}",
              flush=True)

    def _stop_engines(self) -> None:
        """Nothing to reap: joined engines exit when the router tells them (or falls silent)."""
