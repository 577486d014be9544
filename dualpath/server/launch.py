"""Start a PD cluster: the router in this process, each engine as its own OS process.

Prefill engine i runs on node i and decode engine j on node ``num_prefill + j``, each with its
own storage client (its node's storage NIC and read queue) over the shared store root, and its
own Mooncake endpoint. ``ClusterBase`` owns the router and the request API; a launcher
subclass places the engines: ``LocalCluster`` as children of this process (logs in
``log_dir``, each rotated at ``LOG_MAX_BYTES`` with ``LOG_BACKUPS`` old files), ``RayCluster``
(``launch_ray.py``) as Ray actors, and ``ExternalCluster`` starts none and waits for engines
that join by ``dualpath engine --router tcp://HOST:PORT``.
Every launcher starts an engine with the same command line (``engine_command``): the engine
takes its configuration from the router, never from its arguments.

Engines on CUDA (``engine.device`` ``cuda``, ``cuda:N``, or ``auto`` on a host with a GPU):
``LocalCluster`` gives each engine process its own GPU through ``CUDA_VISIBLE_DEVICES``, round
robin over the GPUs this process sees, and the engines sharing one GPU an even share of its
memory (``dualpath/devices.py`` states the rule); it refuses at once a Mooncake build that cannot
move GPU memory (``transfer/mooncake_build.py``; each engine checks again when it starts).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace
from pathlib import Path

from dualpath.config import ClusterConfig, engine_roles
from dualpath.control_keys import ENGINE_KEY_ENV
from dualpath.devices import DevicePlan, plan_devices
from dualpath.errors import DualPathError
from dualpath.kv.shm_files import orphaned_pool_files, sweep_dead, wait_unheld
from dualpath.local_devices import local_gpu_ids
from dualpath.request import SamplingParams
from dualpath.server.router.client import ClusterOutput, RequestFuture, Router
from dualpath.sessions import Session
from dualpath.storage.node_nic import remove_dead_accounts
from dualpath.vocab import EngineKind

STARTUP_TIMEOUT_S = 180.0
ENGINE_STOP_S = 15.0  # how long stop waits for an engine process (plus a vLLM instance's grace)
WATCH_INTERVAL_S = 0.2
# An engine's output (stdout and stderr) goes to NAME.log, which rotates to NAME.log.1, .2 when
# it would pass LOG_MAX_BYTES: at most 15 MiB per engine. A decode engine logs a line per
# request (~120 bytes): a file holds ~40,000 requests.
LOG_MAX_BYTES = 5 << 20
LOG_BACKUPS = 2
PIPE_READ_BYTES = 1 << 16


def engine_command(name: str, role: str, node_id: int, router_address: str,
                   model_dir: str | Path, python: str = sys.executable) -> list[str]:
    """The command line that starts one engine and joins it to the router at
    ``router_address`` (``tcp://HOST:PORT``); the engine asks the router for its config."""
    return [python, "-m", "dualpath.cli", "engine", "--role", role, "--node-id", str(node_id),
            "--name", name, "--router", router_address, "--model", str(model_dir)]


def engine_env() -> dict[str, str]:
    """The environment an engine process runs with (one OpenMP thread, unbuffered logs)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def local_device_plan(config: ClusterConfig,
                      gpu_ids: Sequence[str] | None = None) -> tuple[ClusterConfig, DevicePlan]:
    """Where a local cluster's engines run (``plan_devices`` over ``gpu_ids``, default the GPUs
    this process sees) and the config whose engines say so (``cpu`` or ``cuda``). A CUDA plan
    first checks the installed Mooncake build."""
    engine = config.engine
    if engine.device == "cpu":
        return config, DevicePlan("cpu")
    ids = local_gpu_ids() if gpu_ids is None else list(gpu_ids)
    names = [name for name, _, _ in engine_roles(config)]
    plan = plan_devices(names, engine.device, ids, engine.gpu_memory_fraction)
    if plan.device != "cpu":
        from dualpath.transfer.mooncake_build import check_build, installed_builds

        check_build(plan.device, installed_builds())
    return replace(config, engine=replace(engine, device=plan.device)), plan


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
        self.log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # logs: owner-only
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

    def _engine_env(self, name: str) -> dict[str, str]:
        """Engine ``name``'s environment: ``engine_env`` plus its control-plane key."""
        assert self.router is not None
        return {**engine_env(), ENGINE_KEY_ENV: self.router.keys.engine_key(name).to_json()}

    def _start_engines(self) -> None:
        """Place every engine (non-blocking: ``start`` waits for their hellos)."""
        raise NotImplementedError

    def _stop_engines(self) -> None:
        """Wait for (or kill) the placed engines once the router has shut them down."""
        raise NotImplementedError

    def submit(self, prompt_ids: list[int], params: SamplingParams, mode: str | None = None,
               read_path: str | None = None,
               on_tokens: Callable[[tuple[int, ...]], None] | None = None,
               cache_salt: str = "", session: Session | None = None) -> RequestFuture:
        """Start one request; ``on_tokens``, ``cache_salt`` and ``session`` as in
        :meth:`Router.submit`."""
        assert self.router is not None, "start() the cluster first"
        return self.router.submit(prompt_ids, params, mode, read_path, on_tokens, cache_salt,
                                  session)

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
    """Engines as child processes of this one, logging to ``log_dir/NAME.log``; on CUDA each on
    its GPU (``local_device_plan``; ``gpu_ids``: the GPUs to use, default those this process
    sees)."""

    def __init__(self, model_dir: str | Path, config: ClusterConfig,
                 log_dir: str | Path | None = None,
                 gpu_ids: Sequence[str] | None = None) -> None:
        config, self.devices = local_device_plan(config, gpu_ids)
        super().__init__(model_dir, config, log_dir)
        self._names: dict[str, subprocess.Popen] = {}  # engine name -> its process
        self._pumps: list[threading.Thread] = []  # each copies an engine's output to its log

    def _start_engines(self) -> None:
        assert self.router is not None
        sweep_host_files("at start")  # what clusters and engines that were killed left
        for name, role, node_id in engine_roles(self.config):
            cmd = self._engine_argv(name, role, node_id)
            env = {**self._engine_env(name), **self.devices.env(name)}
            proc, pump = spawn_logged(cmd, self.log_dir / f"{name}.log", env)
            self._names[name] = proc
            self._pumps.append(pump)
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

    def engine_cpu_s(self) -> dict[str, float]:
        """CPU-seconds (user + system) the engine processes and their children (a vLLM
        instance) have used so far, summed by role; an engine that has exited counts 0."""
        roles = {name: role for name, role, _ in engine_roles(self.config)}
        out: dict[str, float] = {}
        for name, proc in self._names.items():
            out[roles[name]] = out.get(roles[name], 0.0) + _tree_cpu_s(proc.pid)
        return out

    def _stop_engines(self) -> None:
        """Wait for each engine process (``ENGINE_STOP_S``, plus a vLLM instance's grace for
        vLLM engines, which stop their instance first), kill stragglers, then sweep what killed
        engines left in shared memory."""
        grace_s = self._vllm_grace_s()
        for proc in self._names.values():
            try:
                proc.wait(timeout=ENGINE_STOP_S + grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pump in self._pumps:  # the last lines an engine wrote reach its log
            pump.join(timeout=5)
        if self._names:
            # a killed vLLM engine's instance got SIGTERM when the engine died: it may still
            # map the engine's pool file while it exits
            wait_unheld(orphaned_pool_files(), grace_s)
            sweep_host_files("at stop")

    def _vllm_grace_s(self) -> float:
        """How long a vLLM engine may take to stop its instance (0 for our engines)."""
        if self.config.engine_kind != EngineKind.VLLM:
            return 0.0
        from dualpath.integrations.vllm.engines.instance import STOP_GRACE_S

        return STOP_GRACE_S


def sweep_host_files(when: str) -> None:
    """Remove this host's files of dead processes: storage-NIC accounts no live process holds
    (``remove_dead_accounts``) and shared-memory files no live process maps or holds
    (``shm_files.sweep_dead``: killed vLLM instances' segments, killed engines' pool files);
    says what went."""
    accounts = remove_dead_accounts()
    if accounts:
        print(f"dualpath: removed {accounts} storage-NIC files of dead processes ({when})",
              flush=True)
    try:
        swept = sweep_dead()
    except OSError as exc:
        print(f"dualpath: shared-memory sweep failed ({when}): {exc}", flush=True)
        return
    if swept:
        print(f"dualpath: removed {len(swept)} shared-memory files of dead processes ({when}): "
              + ", ".join(path.name for path in swept), flush=True)


def spawn_logged(cmd: list[str], log_path: Path, env: dict[str, str] | None = None,
                 max_bytes: int | None = None,
                 backups: int = LOG_BACKUPS) -> tuple[subprocess.Popen, threading.Thread]:
    """Start ``cmd`` with its stdout and stderr going to ``log_path`` through a pipe that a
    daemon thread (returned, ending when the process and its children closed the pipe) copies
    into a ``RotatingLog``."""
    log = RotatingLog(log_path, LOG_MAX_BYTES if max_bytes is None else max_bytes, backups)
    read_fd, write_fd = os.pipe()
    try:
        proc = subprocess.Popen(cmd, stdout=write_fd, stderr=subprocess.STDOUT, env=env)
    except BaseException:
        os.close(read_fd)
        log.close()
        raise
    finally:
        os.close(write_fd)
    pump = threading.Thread(target=_pump, args=(read_fd, log), name=f"log-{log_path.stem}",
                            daemon=True)
    pump.start()
    return proc, pump


def _pump(read_fd: int, log: RotatingLog) -> None:
    try:
        while chunk := os.read(read_fd, PIPE_READ_BYTES):
            log.write(chunk)
    finally:
        os.close(read_fd)
        log.close()


class RotatingLog:
    """A log file that never passes ``max_bytes``: when the next write would, the file becomes
    ``PATH.1`` (``PATH.1`` becomes ``PATH.2``, …, the oldest beyond ``backups`` is dropped)
    and a new one starts. Lines are written whole (an unfinished one waits for its end, or
    ``close``), so files end at a line's end unless one line is longer than a file."""

    def __init__(self, path: Path, max_bytes: int = LOG_MAX_BYTES,
                 backups: int = LOG_BACKUPS) -> None:
        if max_bytes < 1 or backups < 0:
            raise ValueError(f"max_bytes must be >= 1 and backups >= 0, got {max_bytes}, "
                             f"{backups}")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self._file = self.path.open("wb")  # a run's log starts empty, as before rotation
        self._size = 0
        self._unfinished = b""  # the last line written, until its end comes

    def write(self, data: bytes) -> None:
        """Append ``data``'s finished lines (flushed), rotating first where they would not fit."""
        data = self._unfinished + data
        end = data.rfind(b"\n") + 1
        if len(data) - end <= self.max_bytes:
            data, self._unfinished = data[:end], data[end:]
        else:
            self._unfinished = b""
        self._append(data)

    def close(self) -> None:
        """Write what is left of an unfinished line and close the file."""
        self._append(self._unfinished)
        self._unfinished = b""
        self._file.close()

    def _append(self, data: bytes) -> None:
        while len(data) > self.max_bytes - self._size:
            room = self.max_bytes - self._size
            cut = data.rfind(b"\n", 0, room) + 1  # the whole lines that still fit
            if cut == 0 and self._size == 0:
                cut = room  # a line longer than a whole file: split it
            self._file.write(data[:cut])
            data = data[cut:]
            self._rotate()
        self._file.write(data)
        self._size += len(data)
        self._file.flush()

    def _rotate(self) -> None:
        self._file.close()
        for i in range(self.backups - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{i}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{i + 1}"))
        if self.backups:
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self._file = self.path.open("wb")
        self._size = 0


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
        keys = self.config.control_keys
        if not keys:  # the router made them: hand them over through the run folder
            keys = str(self.router.keys.write(self.log_dir / "keys"))
        print(f"dualpath: waiting for {self.config.num_prefill} prefill + "
              f"{self.config.num_decode} decode engines to join {self.router.address}\n"
              f"  each engine needs its key: copy {keys}/engines/NAME.json to its host only "
              "and start it with `dualpath engine --key FILE`", flush=True)

    def _stop_engines(self) -> None:
        """Nothing to reap: joined engines exit when the router tells them (or falls silent)."""


def _tree_cpu_s(pid: int) -> float:
    """User + system CPU-seconds of process ``pid`` and its live descendants (0 if gone)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total
