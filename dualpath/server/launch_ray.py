"""Place a cluster's engines as Ray actors (the optional ``ray`` extra); the router stays here.

Ray places and supervises; it never carries KV. Each engine runs the same command line as
under every other launcher (``engine_command``), joins the router in this process over ZeroMQ
and moves KV with the other engines over Mooncake, exactly as a local child process would.

Placement: the engine of config node N requires ``ENGINE_RESOURCE_SHARE`` of the custom Ray
resource ``dualpath_node_N`` (``NODE_RESOURCE`` below). Give every Ray node the resources of the
config nodes it hosts, one unit each, e.g. ``ray start --resources '{"dualpath_node_0": 1}'``;
as an engine takes only a small share of its node's unit, several engines of one config node fit
on that Ray node. Engines ask for ``num_cpus=0`` (they use one torch/OpenMP thread each, set
through the actor's ``runtime_env``), so placement never waits for CPUs. On CUDA (``cuda``,
``cuda:N`` or ``auto`` where the Ray cluster offers GPUs) each asks for ``1 / k`` of a GPU, ``k``
the engines that must share one for all to fit on the cluster's GPUs (``devices.ray_gpu_share``),
Ray picks the device through ``CUDA_VISIBLE_DEVICES``, and the engine may allocate that same
share of the GPU's memory (or ``engine.gpu_memory_fraction``). A
config node that no Ray node offers fails ``start()`` at once, naming the missing resource; an
engine that Ray cannot place within ``placement_timeout_s`` (its node's unit used up, say)
fails it then. The model folder, the store root and ``log_dir`` are paths on each engine's host.

The actor process *is* the engine: its ``run`` method runs ``dualpath.cli.main`` on the
engine's command line in the actor's own process, on the actor's task thread, for the
engine's whole life. So ``ray.kill(actor)`` (or a crash of the actor's worker or node) is a
real engine loss — the process holding the engine's model, KV and sockets is gone — with no
child process left behind to orphan, which an actor that spawned the engine as a subprocess
could only prevent with a parent-death signal tied to the spawning thread. Each actor writes
its engine's output to ``log_dir/NAME.log`` on its host.

A watcher thread waits (``ray.wait``) on every engine's pending ``run`` result: an actor that
died (``RayActorError``), an engine that raised or returned on its own are each reported to the
router as ``engine_lost``, which fails or re-places what the engine held.

**Secrets.** An engine's control-plane key (``DUALPATH_ENGINE_KEY``) is an argument of its
actor's ``run`` call, set in the actor's process environment only there, never part of the
actor's ``runtime_env``. Ray keeps an actor's creation spec, ``runtime_env`` and every
variable in it included, in its GCS (the actor table and the task events), which its
dashboard, ``ray list actors --detail`` and any client of the cluster can read. A method call's
arguments go from this process straight to the actor's worker (a direct gRPC call; under 100 KiB
they are inlined into it, never put in the object store) and are kept in neither table: the
Ray tests read both tables and find no engine's secret. The other references considered: a key
file on a shared mount (needs a private folder every host mounts, and the run folder is not
one), a one-time token redeemed at join (needs a redeem step in the router's join protocol),
``ray.put`` (the object store is shared memory on every node the object visits and spills to
disk). What remains: Ray's own gRPC is unencrypted unless Ray's TLS is enabled, as Mooncake's
transfers are, so the cluster's network must be private. Variables the actors do get through
``runtime_env`` (``DUALPATH_*`` of this process, for the cache, traces and vLLM's python) leave
out every name that looks secret (``SECRET_ENV_NAME``: this process's ``DUALPATH_API_KEY`` too).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from dualpath.config import ClusterConfig
from dualpath.control_keys import ENGINE_KEY_ENV
from dualpath.devices import MEMORY_FRACTION_ENV, ray_gpu_share
from dualpath.errors import DualPathError
from dualpath.server.launch import ClusterBase, engine_command, engine_roles

try:
    import ray
    from ray.actor import ActorHandle
    from ray.exceptions import RayActorError, RayError
except ImportError as exc:  # the launcher is an optional extra
    raise DualPathError("the Ray launcher needs ray: pip install 'dualpath[ray]'") from exc

log = logging.getLogger("dualpath.launch_ray")

NODE_RESOURCE = "dualpath_node_{node_id}"  # the Ray resource an engine of config node N needs
ENGINE_RESOURCE_SHARE = 0.01  # of one unit of its node's resource: up to 100 engines a node
PLACEMENT_TIMEOUT_S = 120.0  # an engine Ray has not placed by then fails start()
STOP_GRACE_S = 15.0  # how long stop() waits for engines to exit before killing their actors
WATCH_INTERVAL_S = 0.2
LOCAL_OBJECT_STORE_BYTES = 256 * 1024 * 1024  # a local Ray's store: no KV ever goes through it
ENGINE_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
# Never forwarded through runtime_env (which Ray stores in its GCS): names that look secret.
SECRET_ENV_NAME = re.compile(r"KEY|SECRET|TOKEN|PASSWORD|CREDENTIAL", re.IGNORECASE)


def cli_args(command: list[str]) -> list[str]:
    """The ``dualpath`` arguments of an ``engine_command`` (``python -m dualpath.cli ...``)."""
    if command[1:3] != ["-m", "dualpath.cli"]:
        raise DualPathError(f"not a dualpath command line: {command[:3]}")
    return command[3:]


def actor_env_vars(environ: Mapping[str, str]) -> dict[str, str]:
    """The ``DUALPATH_*`` variables of ``environ`` an engine actor gets through its
    ``runtime_env``: every one whose name does not look secret (``SECRET_ENV_NAME``)."""
    return {name: value for name, value in environ.items()
            if name.startswith("DUALPATH_") and not SECRET_ENV_NAME.search(name)}


def node_resource(node_id: int) -> str:
    """The custom Ray resource that places the engines of config node ``node_id``."""
    return NODE_RESOURCE.format(node_id=node_id)


class EngineActor:
    """One engine as a Ray actor (wrapped by ``ray.remote`` when placed)."""

    def __init__(self, log_path: str) -> None:
        self._log_path = _redirect_output(log_path)

    def ready(self) -> dict[str, Any]:
        """Where this actor runs: Ray node id, pid and log file (answers once placed)."""
        return {"ray_node": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "log": self._log_path}

    def run(self, argv: list[str], engine_key: str) -> int:
        """Run the engine (``dualpath <argv>``) in this process until it stops; its exit
        status (0 when the router shut it down). ``engine_key``: its control-plane key
        (``EngineKey`` JSON), handed over in this call rather than in ``runtime_env`` (module
        doc), and put in this process's environment, where the engine reads it, for the
        engine's life only."""
        from dualpath.cli import main

        os.environ[ENGINE_KEY_ENV] = engine_key
        try:
            return main(argv)
        except SystemExit as exc:  # argparse rejects the command line this way
            return exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        finally:
            os.environ.pop(ENGINE_KEY_ENV, None)


_REMOTE_ENGINE = ray.remote(EngineActor)


def _redirect_output(log_path: str) -> str:
    """Send this process's stdout and stderr to ``log_path`` (the actor's process is the
    engine's alone); the path, or Ray's own worker log when it cannot be opened."""
    try:
        Path(log_path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    except OSError:
        return "the Ray worker's log"
    for target in (1, 2):
        os.dup2(fd, target)
    os.close(fd)
    return log_path


class RayCluster(ClusterBase):
    """A router in this process plus engines placed as Ray actors (see the module doc).

    ``ray_address`` is passed to ``ray.init`` (``"auto"``, ``"ray://..."``, ``"HOST:PORT"``);
    ``None`` starts a local Ray whose one node offers every config node's resource. An
    already connected Ray is used as it is. Ray is disconnected on ``stop`` only if this
    cluster connected it.
    """

    def __init__(self, model_dir: str | Path, config: ClusterConfig,
                 log_dir: str | Path | None = None, ray_address: str | None = None,
                 placement_timeout_s: float = PLACEMENT_TIMEOUT_S) -> None:
        super().__init__(model_dir, config, log_dir)
        self.ray_address = ray_address
        self.placement_timeout_s = placement_timeout_s
        self._actors: dict[str, ActorHandle] = {}  # engine name -> actor handle
        self._runs: dict[ray.ObjectRef, str] = {}  # pending run() result -> engine name
        self._placed: dict[str, dict[str, Any]] = {}  # engine name -> what ready() said
        self._connected_ray = False
        self._gpu_share: float | None = None  # of a GPU, per engine (None: CPU engines)
        self._memory_fraction: float | None = None  # of its GPU's memory, per engine
        self._started = False  # every engine joined the router
        self._watcher: threading.Thread | None = None

    # -- public ---------------------------------------------------------------------------------
    def actor(self, name: str) -> ActorHandle:
        """The Ray actor handle of engine ``name`` (e.g. to ``ray.kill`` it in a failure test)."""
        return self._actors[name]

    def placement(self, name: str) -> dict[str, Any]:
        """Where engine ``name`` runs: ``ray_node`` (Ray node id), ``pid`` and ``log``."""
        return self._placed[name]

    # -- ClusterBase ----------------------------------------------------------------------------
    def start(self) -> None:
        """Connect to Ray, place the engines' devices on its GPUs (the router hands engines the
        resolved config), then start as every cluster does."""
        self._connect()
        try:
            self._place_devices()
        except DualPathError:
            self._stop_engines()  # none placed yet: disconnects the Ray this cluster connected
            raise
        super().start()

    def _place_devices(self) -> None:
        """The engines' device, GPU share and memory share, from the GPUs Ray offers."""
        engine = self.config.engine
        if engine.device == "cpu":
            return
        count = len(engine_roles(self.config))
        device, self._gpu_share, self._memory_fraction = ray_gpu_share(
            count, engine.device, ray.cluster_resources().get("GPU", 0.0),
            engine.gpu_memory_fraction)
        self.config = replace(self.config, engine=replace(engine, device=device))

    def _start_engines(self) -> None:
        """Place every engine's actor, start the engines, wait until each joined the router
        (all within the startup timeout)."""
        deadline = time.monotonic() + self._startup_timeout_s()
        self._connect()
        self._check_resources()
        for name, _, node_id in engine_roles(self.config):
            self._actors[name] = self._create_actor(name, node_id)
        self._wait_placed(min(deadline, time.monotonic() + self.placement_timeout_s))
        self._run_engines()
        self._wait_joined(deadline)
        self._started = True
        self._watcher = threading.Thread(target=self._watch, name="ray-watch", daemon=True)
        self._watcher.start()

    def _stop_engines(self) -> None:
        if self._runs and self._started:  # a failed start kills its engines at once
            ray.wait(list(self._runs), num_returns=len(self._runs), timeout=STOP_GRACE_S)
        for handle in self._actors.values():
            ray.kill(handle, no_restart=True)  # an engine that exited leaves an idle actor
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        self._actors.clear()
        self._runs.clear()
        if self._connected_ray:
            ray.shutdown()
            self._connected_ray = False

    # -- start ----------------------------------------------------------------------------------
    def _connect(self) -> None:
        """Connect to Ray unless this process already is connected."""
        if ray.is_initialized():
            return
        if self.ray_address is None:  # one local node standing in for every config node
            resources = {node_resource(node): 1.0 for _, _, node in engine_roles(self.config)}
            ray.init(address="local", resources=resources, include_dashboard=False,
                     object_store_memory=LOCAL_OBJECT_STORE_BYTES)
        else:
            ray.init(address=self.ray_address)
        self._connected_ray = True

    def _check_resources(self) -> None:
        """Fail at once when no Ray node offers a resource some engine needs."""
        offered = ray.cluster_resources()
        missing = sorted({node_resource(node) for _, _, node in engine_roles(self.config)
                          if node_resource(node) not in offered})
        if missing:
            raise DualPathError(
                f"no Ray node offers the resource(s) {', '.join(missing)}: start the Ray node "
                f"that hosts config node N with --resources '{{\"dualpath_node_N\": 1}}'")

    def _create_actor(self, name: str, node_id: int) -> ActorHandle:
        """Ask Ray for engine ``name``'s actor on config node ``node_id`` (not yet placed)."""
        env = {**actor_env_vars(os.environ), **ENGINE_ENV}  # no secret (module doc)
        options: dict[str, Any] = {"num_cpus": 0, "max_restarts": 0,
                                   "resources": {node_resource(node_id): ENGINE_RESOURCE_SHARE}}
        if self._gpu_share is not None:  # Ray sets the actor's CUDA_VISIBLE_DEVICES
            options["num_gpus"] = self._gpu_share
            env[MEMORY_FRACTION_ENV] = f"{self._memory_fraction:.6g}"
        options["runtime_env"] = {"env_vars": env}
        return _REMOTE_ENGINE.options(**options).remote(str(self.log_dir / f"{name}.log"))

    def _wait_placed(self, deadline: float) -> None:
        """Wait until Ray started every actor; fail naming the resources of those it did not."""
        pending = {handle.ready.remote(): name for name, handle in self._actors.items()}
        timeout_s = deadline - time.monotonic()
        while pending and time.monotonic() < deadline:
            done, _ = ray.wait(list(pending), num_returns=1,
                               timeout=max(0.0, deadline - time.monotonic()))
            for ref in done:
                name = pending.pop(ref)
                self._placed[name] = self._result(ref, name, "starting its actor")
        if pending:
            raise DualPathError(f"Ray did not start every engine's actor within "
                                f"{timeout_s:.0f} s: "
                                + "; ".join(self._unplaced(name) for name in pending.values()))

    def _unplaced(self, name: str) -> str:
        """Why engine ``name``'s actor is not up, as far as Ray's free resources tell."""
        node_id = next(n for engine, _, n in engine_roles(self.config) if engine == name)
        resource = node_resource(node_id)
        free = ray.available_resources().get(resource, 0.0)
        if free < ENGINE_RESOURCE_SHARE:
            return f"{name} needs {ENGINE_RESOURCE_SHARE:g} of {resource}, {free:g} is free"
        return f"{name}: {resource} is free, so its actor may still be starting"

    def _run_engines(self) -> None:
        """Start every placed actor's engine (``run`` returns only when the engine stops)."""
        assert self.router is not None
        for name, role, node_id in engine_roles(self.config):
            argv = cli_args(engine_command(name, role, node_id, self.router.address,
                                           self.model_dir))
            key = self.router.keys.engine_key(name).to_json()  # in the call (module doc)
            self._runs[self._actors[name].run.remote(argv, key)] = name

    def _wait_joined(self, deadline: float) -> None:
        """Wait until every engine joined the router; fail at once if one stops before."""
        assert self.router is not None
        while (missing := sorted(set(self._actors) - set(self.router.engines))):
            if time.monotonic() >= deadline:
                raise DualPathError(f"engine(s) {', '.join(missing)} did not join the router")
            done, _ = ray.wait(list(self._runs), num_returns=1, timeout=WATCH_INTERVAL_S)
            for ref in done:
                name = self._runs.pop(ref)
                status = self._result(ref, name, "joining the router")
                raise DualPathError(f"engine {name} exited with status {status} before joining "
                                    f"the router (log: {self._placed[name]['log']})")

    @staticmethod
    def _result(ref: ray.ObjectRef, name: str, doing: str) -> Any:
        """``ray.get(ref)``, a Ray failure turned into a DualPathError naming the engine."""
        try:
            return ray.get(ref)
        except RayError as exc:
            raise DualPathError(f"engine {name} failed {doing}: {exc}") from exc

    # -- watch ----------------------------------------------------------------------------------
    def _watch(self) -> None:
        """Report every engine whose actor died or whose run ended to the router."""
        pending = dict(self._runs)
        while pending and not self._stopping.is_set():
            done, _ = ray.wait(list(pending), num_returns=1, timeout=WATCH_INTERVAL_S)
            for ref in done:
                name = pending.pop(ref)
                if self._stopping.is_set():
                    return
                log.warning("engine %s is gone: %s", name, _ending(ref))
                router = self.router
                if router is not None:
                    router.engine_lost(name)


def _ending(ref: ray.ObjectRef) -> str:
    """How an engine's run ended, in words."""
    try:
        return f"it exited with status {ray.get(ref)}"
    except RayActorError as exc:
        return f"its Ray actor died ({type(exc).__name__})"
    except RayError as exc:
        return f"it raised {exc}"
