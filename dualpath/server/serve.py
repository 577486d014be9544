"""``dualpath serve``: a PD cluster behind the OpenAI-compatible API, until SIGINT/SIGTERM.

Starts the router and has the configured launcher place the engines (``serve.launcher``: local
child processes, Ray actors, or none — engines that join by ``dualpath engine --router``),
waits until every engine said hello, writes the resolved configuration beside the engines'
logs (``config.json``, 0600, every API key shown as ``"<redacted>"``, in a run folder only its
owner may enter), prints the endpoints and serves HTTP with uvicorn. API keys come from
``--api-key-file`` / ``serve.api_key_file``, else ``$DUALPATH_API_KEY``, or ``--api-key``.
Nothing it leaves grows without bound: an ``fs`` store without a ``capacity_gb`` gets one
(``serve.store_capacity_fraction`` of the disk), and only the last ``serve.keep_runs`` run
folders under ``<cache>/serve`` stay. On SIGINT or SIGTERM uvicorn stops accepting requests,
then every engine is told to shut down (and killed if it lingers): no process is left behind.
Engines whose server died without a word stop by themselves (they find their router silent).
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from dualpath.commands.args import add_device_argument, gigabytes
from dualpath.config import StorageConfig
from dualpath.config_file import API_KEY_ENV, AppConfig, config_to_json, load_config, with_api_keys
from dualpath.model.default_model import cache_dir, resolve_model
from dualpath.model.spec import load_spec
from dualpath.model.tokenizer import Tokenizer
from dualpath.server.api.app import ModelInfo, build_app
from dualpath.server.launch import ClusterBase, ExternalCluster, LocalCluster
from dualpath.server.metrics import ServeMetrics
from dualpath.server.router.client import Router
from dualpath.storage.fs_capacity import pid_alive, stored_bytes
from dualpath.vocab import EngineKind, Launcher

RUN_NAME = re.compile(r"[0-9]{8}-[0-9]{6}(-[0-9]+)?")  # a run folder's name: its start time
PID_FILE = "serve.pid"  # in a run folder: "PID START" of the serve process that uses it
# Run folders hold the engines' logs, the resolved config and (`--launcher none`) the engines'
# control keys: owner-only, as is the folder of run folders when serve creates it.
RUN_FOLDER_MODE = 0o700


if TYPE_CHECKING:
    from argparse import ArgumentParser

    import uvicorn

ROUTER_WATCH_S = 0.5  # how often serve checks that its router thread still runs


def model_info(model_dir: Path, name: str | None, kv_tokens: int) -> ModelInfo:
    """The served model as the API sees it (its tokenizer is required).

    The API tokenizes on worker threads, with ``tokenizers``' batch call: the single call holds
    the GIL (a 1 MiB prompt stalled the event loop 0.5 s of its 0.5 s), the batch call lets go of
    it (the longest stall: 12 ms), same ids. ``max_token_chars`` is the longest token's text
    plus one (a decoder may join tokens with a space): SmolLM2's is 81 characters.
    """
    from tokenizers import Tokenizer as FastTokenizer

    spec = load_spec(model_dir)
    tokenizer = Tokenizer(model_dir)
    fast = FastTokenizer.from_file(str(model_dir / "tokenizer.json"))

    def encode(text: str) -> list[int]:
        return fast.encode_batch([text], add_special_tokens=False)[0].ids

    def encode_chat(messages: list[dict[str, str]]) -> list[int]:
        return encode(tokenizer.render_chat(messages))

    tokens = fast.decode_batch([[i] for i in range(fast.get_vocab_size())],
                               skip_special_tokens=False)
    return ModelInfo(name or model_dir.name, spec.vocab_size, min(spec.max_position, kv_tokens),
                     encode, tokenizer.decode, encode_chat,
                     max_token_chars=max(map(len, tokens), default=0) + 1)


def serve(config: AppConfig, log_dir: Path | None = None) -> None:
    """Run the cluster and the HTTP server until a signal stops them."""
    import uvicorn

    config = replace(config, serve=with_api_keys(config.serve))  # a key file, $DUALPATH_API_KEY
    settings = config.serve
    if config.cluster.storage.root == StorageConfig().root:  # the default: under the cache
        storage = replace(config.cluster.storage, root=str(cache_dir() / "kv-store"))
        config = replace(config, cluster=replace(config.cluster, storage=storage))
    config = with_default_capacity(config)
    model_dir = resolve_model(settings.model)
    log_dir = log_dir or new_run_folder(cache_dir() / "serve", settings.keep_runs)
    log_dir.mkdir(mode=RUN_FOLDER_MODE, parents=True, exist_ok=True)
    write_private(log_dir / "config.json", config_to_json(config))  # keys redacted
    # The API's port is taken before any engine starts: a child's transfer engine or vLLM
    # instance, given a free port by the kernel, could otherwise take it first.
    listener = listen_socket(settings.host, settings.port)
    with listener, _launcher(model_dir, config, log_dir) as cluster:
        router = cluster.router
        assert router is not None
        info = model_info(model_dir, settings.model_name, router.state.capacity.kv_tokens)
        app = build_app(router, info, settings, ServeMetrics(router))
        server = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port,
                                               log_level="warning", timeout_graceful_shutdown=5))
        base = f"http://{settings.host}:{settings.port}"
        print(f"dualpath serve: {config.cluster.num_prefill} prefill + "
              f"{config.cluster.num_decode} decode engines of {info.name} ready\n"
              f"  {base}/v1/chat/completions  {base}/v1/completions  {base}/v1/models\n"
              f"  {base}/health  {base}/metrics  {base}/docs\n"
              f"  logs and resolved config: {log_dir}", flush=True)
        signal.signal(signal.SIGTERM, _interrupt)  # uvicorn re-raises it once it has stopped
        with RouterWatch(router, server) as watch, contextlib.suppress(KeyboardInterrupt):
            server.run(sockets=[listener])  # until SIGINT or SIGTERM; then leaving the
            # block stops every engine
    print("dualpath serve: stopped", flush=True)
    if watch.died:  # exit status 1, the message on stderr
        raise SystemExit("dualpath serve: the router thread died; see the log above")


class PortInUseError(SystemExit):
    """The API's address is taken by another process (raised before any engine starts)."""


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` (IPv4 or IPv6, as ``host`` resolves), closed on
    exec so no engine inherits it; ``PortInUseError`` when another process holds the port."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as error:
        sock.close()
        if error.errno == errno.EADDRINUSE:
            raise PortInUseError(f"dualpath serve: {host}:{port}: address already in use by "
                                 "another process (--port or serve.port picks another)") from error
        raise
    return sock


class RouterWatch:
    """Stops the HTTP server once the router thread has died (then ``died``): a server
    without its router would answer 503 for ever, so ``dualpath serve`` exits non-zero and a
    supervisor can restart it."""

    def __init__(self, router: Router, server: uvicorn.Server,
                 interval_s: float = ROUTER_WATCH_S) -> None:
        self.router, self.server, self.interval_s = router, server, interval_s
        self.died = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="router-watch", daemon=True)

    def __enter__(self) -> RouterWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            if not self.router.alive:
                self.died = True
                print("dualpath serve: the router thread died; stopping", file=sys.stderr,
                      flush=True)
                self.server.should_exit = True
                return


def _launcher(model_dir: Path, config: AppConfig, log_dir: Path) -> ClusterBase:
    """The cluster whose launcher ``serve.launcher`` names (Ray is imported only for it)."""
    launcher = config.serve.launcher
    if launcher == Launcher.RAY:
        from dualpath.server.launch_ray import RayCluster

        return RayCluster(model_dir, config.cluster, log_dir=log_dir,
                          ray_address=config.serve.ray_address)
    if launcher == Launcher.NONE:
        return ExternalCluster(model_dir, config.cluster, log_dir=log_dir)
    return LocalCluster(model_dir, config.cluster, log_dir=log_dir)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def with_default_capacity(config: AppConfig) -> AppConfig:
    """``config`` with its ``fs`` store capped at ``serve.store_capacity_fraction`` of the free
    disk plus what the store holds (printed), when ``storage.capacity_gb`` is unset. An
    explicit capacity, another backend or a fraction of 0 leaves ``config`` as it is."""
    storage = config.cluster.storage
    fraction = config.serve.store_capacity_fraction
    if storage.backend != "fs" or storage.capacity_gb is not None or fraction == 0:
        return config
    root = Path(storage.root)
    root.mkdir(parents=True, exist_ok=True)
    free, held = shutil.disk_usage(root).free, stored_bytes(root)
    capacity_gb = default_capacity_gb(free, held, fraction)
    print(f"dualpath serve: KV store {root} capped at {capacity_gb:g} GB ({fraction:.0%} of "
          f"{free / 1e9:.1f} GB free + {held / 1e9:.1f} GB stored; --store-capacity-gb or "
          "storage.capacity_gb sets it)", flush=True)
    storage = replace(storage, capacity_gb=capacity_gb)
    return replace(config, cluster=replace(config.cluster, storage=storage))


def default_capacity_gb(free_bytes: int, stored: int, fraction: float) -> float:
    """``fraction`` of the free and the stored bytes, in GB (1e9, as ``capacity_gb``), rounded
    down to 0.1 GB. The stored bytes count because eviction frees them: without them each
    restart would cap a full store lower than the last."""
    return math.floor(fraction * (free_bytes + stored) / 1e8) / 10


def new_run_folder(parent: Path, keep_runs: int) -> Path:
    """A new folder under ``parent`` named by the time, marked as this process's (its pid file);
    then run folders beyond the newest ``keep_runs`` are removed, unless a live process uses
    them. Only folders named like runs are considered; nothing outside ``parent`` is touched.
    The folder is owner-only (``RUN_FOLDER_MODE``), whatever the umask."""
    parent.mkdir(mode=RUN_FOLDER_MODE, parents=True, exist_ok=True)
    name = time.strftime("%Y%m%d-%H%M%S")
    folder = parent / name
    try:
        folder.mkdir(mode=RUN_FOLDER_MODE)
    except FileExistsError:  # another server started in the same second
        folder = parent / f"{name}-{os.getpid()}"
        folder.mkdir(mode=RUN_FOLDER_MODE, exist_ok=True)
    os.chmod(folder, RUN_FOLDER_MODE)  # mkdir's mode passes through the umask
    (folder / PID_FILE).write_text(f"{os.getpid()} {_started(os.getpid())}\n")
    removed = prune_runs(parent, keep_runs, current=folder)
    if removed:
        print(f"dualpath serve: removed {len(removed)} old run folders of {parent} "
              f"(serve.keep_runs = {keep_runs})", flush=True)
    return folder


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, a file only its owner may read (0600 from its creation)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)  # a file that was there keeps its mode through O_TRUNC
    with os.fdopen(fd, "w") as file:
        file.write(text)


def prune_runs(parent: Path, keep_runs: int, current: Path | None = None) -> list[Path]:
    """Remove the run folders of ``parent`` older than the newest ``keep_runs`` (by name, the
    start time), except ``current`` and those whose serve process is alive; returns them."""
    runs = sorted((p for p in parent.iterdir()
                   if RUN_NAME.fullmatch(p.name) and p.is_dir() and not p.is_symlink()),
                  key=lambda p: p.name)
    removed = []
    for folder in runs[: max(0, len(runs) - keep_runs)]:
        if folder != current and not run_in_use(folder):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def run_in_use(folder: Path) -> bool:
    """Whether the serve process named in ``folder``'s pid file is alive: its pid exists and,
    where the file gives its start time, the process with that pid started then (a reused
    pid, as in a container where every server is pid 1, is not the same server)."""
    try:
        pid_text, _, started = (folder / PID_FILE).read_text().strip().partition(" ")
        pid = int(pid_text)
    except (OSError, ValueError):
        return False  # no pid file (a run from before they existed) or a damaged one
    if not pid_alive(pid):
        return False
    now = _started(pid)
    try:
        return abs(float(started) - float(now)) < 1.0
    except ValueError:  # a start time unknown then or now: the pid alone decides
        return True


def _started(pid: int) -> str:
    """When process ``pid`` started (epoch seconds, as psutil gives it), or "" if unknown."""
    import psutil

    try:
        return f"{psutil.Process(pid).create_time():.2f}"
    except (psutil.Error, OSError):
        return ""


@dataclass(frozen=True)
class ServeOptions:
    """The ``dualpath serve`` command line; None leaves the config file's (or default) value."""

    host: str | None = None
    port: int | None = None
    prefill: int | None = None
    decode: int | None = None
    model: str | None = None
    device: str | None = None
    storage: str | None = None
    store_capacity_gb: float | None = None
    config: str | None = None
    sets: tuple[str, ...] = ()
    api_key: str | None = None
    api_key_file: str | None = None
    launcher: str | None = None
    ray_address: str | None = None
    router_host: str | None = None
    router_port: int | None = None
    engine: str | None = None


def add_arguments(parser: ArgumentParser) -> None:
    """The options of :class:`ServeOptions`."""
    parser.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="HTTP port (default 8000)")
    parser.add_argument("--prefill", type=int, default=None, help="prefill engines (default 1)")
    parser.add_argument("--decode", type=int, default=None, help="decode engines (default 2)")
    parser.add_argument("--model", default=None, help="HF model folder (default: SmolLM2)")
    add_device_argument(parser, None)  # None: the config's engine.device (cpu unless it says)
    parser.add_argument("--storage", default=None, help="KV store root (an fs directory)")
    parser.add_argument("--store-capacity-gb", type=gigabytes, default=None, metavar="GB",
                        help="cap on the fs store's block files (default: half of the free "
                        "disk plus what the store holds; serve.store_capacity_fraction)")
    parser.add_argument("--config", default=None, help="TOML config file")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. storage.read_cap_mb_s=200 "
                        "(repeatable)")
    parser.add_argument("--api-key-file", default=None, metavar="PATH",
                        help="require 'Authorization: Bearer KEY' for a KEY in this file (one "
                        f"a line; owner-only). Without a key: ${API_KEY_ENV} if set")
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help="as --api-key-file, the key itself (other users can read a command "
                        f"line: prefer --api-key-file or ${API_KEY_ENV})")
    parser.add_argument("--launcher", default=None, choices=tuple(Launcher),
                        help="who starts the engines: local child processes (default), Ray "
                        "actors, or none (engines join with `dualpath engine --router`)")
    parser.add_argument("--ray-address", default=None,
                        help="the Ray cluster for --launcher ray (default: a local one)")
    parser.add_argument("--router-host", default=None,
                        help="address the engine endpoint binds (default 127.0.0.1; 0.0.0.0 "
                        "for engines on other hosts)")
    parser.add_argument("--router-port", type=int, default=None,
                        help="engine endpoint port (default: any free one)")
    parser.add_argument("--engine", default=None, choices=tuple(EngineKind),
                        help="what computes behind each engine process: dualpath's engine "
                        "(default) or a vLLM instance with dualpath's KV connector (needs "
                        "`make peers`; docs/vllm-connector.md)")


def serve_config(options: ServeOptions) -> AppConfig:
    """The configuration ``options`` ask for: the file's, then the flags, then each ``--set``."""
    base: dict[str, object] = {}
    for key, value in (("serve.host", options.host), ("serve.port", options.port),
                       ("num_prefill", options.prefill), ("num_decode", options.decode),
                       ("serve.model", options.model), ("storage.root", options.storage),
                       ("storage.capacity_gb", options.store_capacity_gb),
                       ("serve.api_key", options.api_key),
                       ("serve.api_key_file", options.api_key_file),
                       ("serve.launcher", options.launcher),
                       ("serve.ray_address", options.ray_address),
                       ("engine.device", options.device), ("router_host", options.router_host),
                       ("router_port", options.router_port),
                       ("engine_kind", options.engine)):
        if value is not None:
            base[key] = value
    return load_config(options.config, list(options.sets), base)


def run(options: ServeOptions) -> int:
    """``dualpath serve``: serve until interrupted."""
    serve(serve_config(options))
    return 0
