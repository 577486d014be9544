"""The router's I/O: a ZeroMQ loop around the socket-free ``RouterState``.

Per request: look up how many leading full blocks storage holds (the hit, block aligned and
leaving at least one token to compute) and hand it to the state machine
(``server/router_state.py``), which queues it in the global scheduler (``scheduler/``, the same
pure code the simulator runs), places it and drives it through the engines: DE allocates its
buffer (and reads the hit on the DE path) → PE prefills layer by layer into that buffer → DE
decodes and persists. The loop sends what the state asks, completes futures, and every
``HEARTBEAT_TICK_S`` lets the state declare silent engines lost. One bad message is logged and
counted, never the end of the loop. One thread owns the socket; ``submit`` and ``abort`` are
thread-safe.
"""

from __future__ import annotations

import itertools
import json
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TypeVar

import zmq

from dualpath.config import (
    ClusterConfig,
    cluster_config_to_json,
    engine_config_for,
    engine_roles,
)
from dualpath.control_keys import ClusterKeys
from dualpath.control_socket import ZapHandler, router_socket
from dualpath.errors import DualPathError, RequestError
from dualpath.kv.hashing import KeySpace
from dualpath.kv.layout import KVLayout
from dualpath.model.spec import load_spec, model_id, resolve_dtype, resolve_kv_dtype
from dualpath.protocol import (
    HEARTBEAT_SUFFIX,
    JOIN_SUFFIX,
    Aborted,
    BufferReady,
    Failed,
    Finished,
    GetMetrics,
    Heartbeat,
    HeartbeatAck,
    Hello,
    Join,
    JoinConfig,
    Message,
    Metrics,
    Prefilled,
    ProtocolError,
    ReadDone,
    Shutdown,
    Tokens,
    decode,
    encode,
)
from dualpath.request import SamplingParams
from dualpath.scheduler.global_scheduler import GlobalScheduler, SchedulerParams
from dualpath.server.router_state import RouterState
from dualpath.server.router_types import (
    Capacity,
    ClusterOutput,
    Effects,
    EngineInfo,
    RequestAborted,
    RequestFailed,
    RequestState,
)
from dualpath.storage import open_store
from dualpath.vocab import Mode, ReadPath, Role

log = logging.getLogger("dualpath.router")
__all__ = ["ClusterOutput", "EngineInfo", "RequestAborted", "RequestFailed", "RequestFuture",
           "Router", "scheduler_params"]

T = TypeVar("T")
HEARTBEAT_TICK_S = 0.1  # how often the loop checks engine silence
ORACLE_BLOCKS_KEPT = 1 << 20  # block keys oracle mode remembers (then it starts afresh)


class RequestFuture(Future):
    """The future of one submitted request; ``req_id`` names it for ``Router.abort``."""

    def __init__(self, req_id: int) -> None:
        super().__init__()
        self.req_id = req_id


class Router:
    """Routes requests through the engines of a cluster: the I/O around ``RouterState``."""

    def __init__(self, model_dir: str | Path, config: ClusterConfig,
                 clock: Callable[[], float] = time.monotonic,
                 keys: ClusterKeys | None = None) -> None:
        """``keys``: the control plane's (default: read from ``config.control_keys``, else
        made for the engines ``config`` names; launchers hand each engine its own)."""
        Mode(config.mode)  # ValueError names a bad mode
        ReadPath(config.read_path)  # ... or a bad read path
        self.config = config
        self._clock = clock
        spec = load_spec(model_dir)
        kv_dtype = resolve_kv_dtype(config.engine.kv_dtype,
                                    resolve_dtype(config.engine.dtype, spec))
        layout = KVLayout.from_spec(spec, kv_dtype, config.engine.block_size)
        self.block_size = layout.block_size
        self.key_space = KeySpace(model_id(model_dir), layout.layout_id, layout.block_size)
        self.store = open_store(config.storage, layout)
        capacity = Capacity(self.block_size, _kv_tokens(config, layout, Role.DECODE),
                            config.host_pool_blocks, config.save_staging_blocks,
                            _kv_tokens(config, layout, Role.PREFILL))
        self.state = RouterState(GlobalScheduler(scheduler_params(config, layout.full_block_bytes)),
                                 capacity, config.engine_timeout_s, config.heartbeat_s)
        self.bad_messages = 0  # handler errors, logged and skipped
        self.refused_messages = 0  # frames dropped unread: malformed, or speaking for another
        self._ids = itertools.count(1)
        self._futures: dict[int, RequestFuture] = {}
        self._listeners: dict[int, Callable[[tuple[int, ...]], None]] = {}
        self._inbox: queue.Queue[Callable[[], Effects | None]] = queue.Queue()
        # engine -> the scrapes waiting for its counters (one reply answers them all)
        self._metrics: dict[str, list[Future[dict]]] = {}
        # oracle mode moves no KV, so the store never holds its blocks: its hits are the blocks
        # its own finished requests would have stored (a perfect cache, no I/O)
        self._oracle_blocks: set = set()
        self._oracle_ids: set[int] = set()
        self._hello = threading.Condition()
        self.model_id = self.key_space.model_id
        self.cluster_id = secrets.token_hex(6)
        self.keys = keys or cluster_keys(config)
        self._context = zmq.Context()  # its own: its ZAP handler admits this cluster's engines
        self._zap = ZapHandler(self._context, self.keys)
        try:
            self.socket, self.address = _bind(config.router_host, config.router_port, self.keys,
                                              self._context)
        except DualPathError:
            self._close_context()
            raise
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="router", daemon=True)
        self._thread.start()

    # -- public ---------------------------------------------------------------------------------
    @property
    def engines(self) -> dict[str, EngineInfo]:
        """The registered engines by name."""
        return {name: e.info for name, e in list(self.state.engines.items())}

    @property
    def decisions(self) -> list[tuple[int, str, str, str, int]]:
        """The latest placements, oldest first: (req id, PE, DE, read path, hit blocks)."""
        return self._ask(lambda: list(self.state.decisions))

    def wait_for_engines(self, count: int, timeout_s: float) -> None:
        """Block until ``count`` engines said hello."""
        with self._hello:
            if not self._hello.wait_for(lambda: len(self.state.engines) >= count, timeout_s):
                raise DualPathError(f"only {len(self.state.engines)} of {count} engines came up")

    def submit(self, prompt_ids: list[int], params: SamplingParams, mode: str | None = None,
               read_path: str | None = None,
               on_tokens: Callable[[tuple[int, ...]], None] | None = None,
               cache_salt: str = "") -> RequestFuture:
        """Start a request (mode and read path default to the config's); resolves when done.

        ``cache_salt`` (a tenant's, as vLLM spells it) salts the request's block keys: it hits
        only blocks stored by requests of the same salt.

        ``on_tokens`` is called on the router thread with each batch of new output tokens as
        they arrive (the first one as soon as the prefill engine sampled it); it must not block.
        Fails at once (``RequestError`` in the future) when it could never fit an engine.
        """
        req = RequestState(next(self._ids), tuple(prompt_ids), params,
                           Mode(mode or self.config.mode),
                           ReadPath(read_path or self.config.read_path), cache_salt=cache_salt)
        future = RequestFuture(req.req_id)
        if req.mode == Mode.BASIC and engine_config_for(self.config, Role.PREFILL).layer_window:
            future.set_exception(RequestError(
                "basic prefill keeps every layer resident, and this cluster's prefill engines "
                "hold a layer window: start a cluster with mode=basic for it"))
            return future
        self._futures[req.req_id] = future
        if on_tokens is not None:
            self._listeners[req.req_id] = on_tokens
        self._inbox.put(lambda: self._admit(req))
        return future

    def abort(self, req_id: int, reason: str = "aborted by the caller") -> None:
        """Cancel a request in whatever phase it is; its future fails with RequestAborted."""
        self._inbox.put(lambda: self.state.abort(req_id, reason))

    def counters(self) -> dict[str, int]:
        """The router's own accounting (all zero once idle) plus its fault counters."""
        return self._ask(lambda: {**self.state.counters(),
                                  "dropped_messages": self.state.dropped_messages,
                                  "bad_messages": self.bad_messages,
                                  "refused_messages": self.refused_messages,
                                  "refused_peers": self._zap.refused,
                                  "corrected": self.state.corrected,
                                  "stuck": sum(self.state.stuck.values()),
                                  "drift": sum(self.state.drift.values())})

    def phases(self) -> dict[int, tuple[str, str, str]]:
        """Every request not yet completed: ``req_id -> (phase, PE, DE)``."""
        return self._ask(lambda: {r.req_id: (str(r.phase), r.pe, r.de)
                                  for r in self.state.requests.values()})

    def reports(self) -> dict[str, Heartbeat | None]:
        """Each registered engine's last heartbeat (its own view of its state)."""
        return self._ask(lambda: {n: e.report for n, e in self.state.engines.items()})

    def heartbeat_ages(self) -> dict[str, float]:
        """Seconds since each registered engine was last heard from."""
        return self._ask(lambda: {n: max(0.0, self._clock() - e.last_heard_s)
                                  for n, e in self.state.engines.items()})

    @property
    def alive(self) -> bool:
        """True while the router thread runs (a dead one answers nothing: serve must say so)."""
        return self._thread.is_alive()

    @property
    def ready(self) -> bool:
        """True while at least one prefill and one decode engine are registered."""
        roles = {e.info.role for e in list(self.state.engines.values())}
        return set(Role) <= roles

    def _ask(self, query: Callable[[], T]) -> T:
        """Run ``query`` on the router thread (which owns the state) and return its answer."""
        result: Future[T] = Future()
        self._inbox.put(lambda: result.set_result(query()))
        return result.result(10)

    def collect_metrics(self, timeout_s: float = 30.0) -> dict[str, dict]:
        """Every engine's counters, by engine name; engines lost meanwhile, or silent for
        ``timeout_s``, are left out. Concurrent callers each get a whole answer."""
        futures: dict[str, Future[dict]] = {name: Future() for name in self.engines}

        def ask() -> None:
            for name, future in futures.items():
                waiting = [f for f in self._metrics.get(name, []) if not f.done()]
                self._metrics[name] = [*waiting, future]
                self._send(name, GetMetrics())

        self._inbox.put(ask)
        out = {}
        deadline = time.monotonic() + timeout_s
        for name, f in futures.items():
            try:
                out[name] = f.result(max(0.0, deadline - time.monotonic()))
            except (RequestFailed, TimeoutError):
                f.cancel()  # the next scrape drops it
        return out

    def engine_lost(self, name: str) -> None:
        """An engine process is gone: fail or re-place what it held, place new work elsewhere."""
        self._inbox.put(lambda: self._lose(name, f"engine {name} exited"))

    def shutdown(self, notify_engines: bool = True) -> None:
        """Tell every engine to stop and end the router thread (without telling them, the
        engines find the router gone by its silence, as after a crash)."""
        def stop() -> None:
            for name in self.state.engines if notify_engines else ():
                self._send(name, Shutdown())
            self._running = False

        self._inbox.put(stop)
        self._thread.join(timeout=10)
        self.store.close()
        if not self._thread.is_alive():  # its socket is closed: the context can end
            self._close_context()

    def _close_context(self) -> None:
        self._zap.close()
        self._context.term()

    # -- loop -----------------------------------------------------------------------------------
    def _loop(self) -> None:
        next_tick = self._clock()
        while self._running:
            try:
                if self.socket.poll(5):
                    self._receive()
                self._drain_inbox()
                now = self._clock()
                if now >= next_tick:
                    next_tick = now + HEARTBEAT_TICK_S
                    self._apply(self.state.tick(now))
            except Exception:  # one bad step never ends the loop (a dead one: ``alive``)
                self.bad_messages += 1
                log.exception("router: a loop step failed")
        self.socket.close(0)

    def _receive(self) -> None:
        """One message; a bad one is counted (and logged), never the end of the loop. Each
        engine speaks only for itself, each of its sockets only its own messages: the join
        socket ``Join``, the heartbeat socket ``Heartbeat``, the main one the rest."""
        frames = self.socket.recv_multipart(copy=False)
        try:
            identity, raw = frames
            name = identity.bytes.decode()
            sender, channel = _channel(name)
            if raw.get("User-Id") != sender:  # the engine whose key the connection holds
                self._refuse(f"a frame of {raw.get('User-Id')!r} under the identity {name!r}")
                return
            msg = decode(raw.bytes)
        except (ValueError, ProtocolError) as exc:
            self._refuse(f"an undecodable frame: {exc}")
            return
        if not isinstance(msg, _CHANNELS[channel]) or getattr(msg, "name", sender) != sender:
            self._refuse(f"{name} sent a {msg.type} it may not send")
            return
        try:
            self._handle(sender, name, msg)
        except Exception:
            self.bad_messages += 1
            log.exception("router: a message could not be handled")

    def _handle(self, sender: str, identity: str, msg: Message) -> None:
        if isinstance(msg, Join):
            self._send(identity, self._join_config(msg))
        elif isinstance(msg, Hello):
            with self._hello:
                self._apply(self.state.on_message(sender, msg, self._clock()))
                self._hello.notify_all()
        elif isinstance(msg, Metrics):
            for future in self._metrics.pop(sender, []):  # its own counters only
                if not future.done():
                    future.set_result(msg.values)
        else:
            self._apply(self.state.on_message(sender, msg, self._clock()))

    def _refuse(self, why: str) -> None:
        """Count a message that is dropped unread; log the first few and then every 1,000th."""
        self.refused_messages += 1
        if self.refused_messages <= 10 or self.refused_messages % 1000 == 0:
            log.warning("router: dropped %s (%d dropped so far)", why, self.refused_messages)

    def _drain_inbox(self) -> None:
        while True:
            try:
                action = self._inbox.get_nowait()
            except queue.Empty:
                return
            try:
                effects = action()
                if effects is not None:
                    self._apply(effects)
            except Exception:
                self.bad_messages += 1
                log.exception("router: an action failed")

    def _apply(self, effects: Effects) -> None:
        for engine, msg in effects.sends:
            self._send(engine + HEARTBEAT_SUFFIX if isinstance(msg, HeartbeatAck) else engine, msg)
        for req_id, tokens in effects.streamed:
            listener = self._listeners.get(req_id)
            if listener is not None:
                try:
                    listener(tokens)
                except Exception:  # a caller's bug must not stop the router
                    log.exception("router: a token listener failed")
        for req_id in effects.lookups:  # a moved request: its stream's blocks are stored now
            req = self.state.requests.get(req_id)
            if req is not None:
                self._apply(self.state.resume(req_id, self._hit_blocks(req), self._clock()))
        for req_id, result in effects.done:
            self._listeners.pop(req_id, None)
            self._remember_oracle(req_id, result)
            future = self._futures.pop(req_id, None)
            if future is None or future.done():
                continue
            if isinstance(result, ClusterOutput):
                future.set_result(result)
            else:
                future.set_exception(result)

    def _send(self, engine: str, msg: Message) -> None:
        try:
            self.socket.send_multipart([engine.encode(), encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError:  # unroutable or full: the engine's silence will tell
            log.warning("router: could not send %s to %s", msg.type, engine)
        except (TypeError, ValueError):  # not encodable: the rest of the batch still goes; the
            self.bad_messages += 1  # heartbeats re-place (then fail) the request it was for
            log.exception("router: could not encode %s for %s", msg.type, engine)

    def _join_config(self, msg: Join) -> JoinConfig:
        """What a joining engine runs with (or why it may not join)."""
        error = ""
        if msg.role not in tuple(Role):
            error = f"role must be prefill or decode, got {msg.role!r}"
        elif msg.node_id < 0:
            error = f"node id must be >= 0, got {msg.node_id}"
        return JoinConfig(cluster_config_to_json(self.config), self.model_id, self.cluster_id,
                          error)

    def _admit(self, req: RequestState) -> Effects:
        if req.mode == Mode.ORACLE:
            self._oracle_ids.add(req.req_id)
        req.num_hit_blocks = self._hit_blocks(req)
        return self.state.submit(req, self._clock())

    def _remember_oracle(self, req_id: int, out: ClusterOutput | Exception) -> None:
        """An oracle request's full blocks (prompt and generated tokens whose KV the decode
        engine computed: all but the last) count as stored for later oracle requests."""
        if req_id not in self._oracle_ids:
            return
        self._oracle_ids.discard(req_id)
        if not isinstance(out, ClusterOutput):
            return
        if len(self._oracle_blocks) > ORACLE_BLOCKS_KEPT:  # a bench mode: bound it anyway
            self._oracle_blocks.clear()
        self._oracle_blocks.update(self.key_space.keys(out.prompt_ids + out.output_ids[:-1]))

    def _lose(self, name: str, reason: str) -> Effects:
        for future in self._metrics.pop(name, []):
            if not future.done():
                future.set_exception(RequestFailed(reason))
        return self.state.lose(name, reason)

    def _hit_blocks(self, req: RequestState) -> int:
        """Leading full blocks storage holds (leaving at least one token to compute); a store
        that cannot be asked counts as holding nothing."""
        if req.mode == Mode.RECOMPUTE:
            return 0
        max_hit = (len(req.kv_ids) - 1) // self.block_size
        space = self.key_space if req.mode == Mode.ORACLE else self.key_space.salted(
            req.cache_salt)  # oracle hits are the router's own (unsalted) record
        keys = space.keys(req.kv_ids[: max_hit * self.block_size])
        if req.mode == Mode.ORACLE:
            return next((i for i, key in enumerate(keys) if key not in self._oracle_blocks),
                        len(keys))
        try:
            return self.store.exists_prefix(keys)
        except OSError:
            log.warning("router: the store could not be asked; the request recomputes")
            return 0


_CHANNELS: dict[str, tuple[type[Message], ...]] = {
    "join": (Join,), "hb": (Heartbeat,),
    "main": (Hello, Metrics, BufferReady, ReadDone, Prefilled, Tokens, Finished, Failed,
             Aborted)}


def _channel(identity: str) -> tuple[str, str]:
    """The engine a socket identity names and which of its sockets it is."""
    for suffix, channel in ((HEARTBEAT_SUFFIX, "hb"), (JOIN_SUFFIX, "join")):
        if identity.endswith(suffix):
            return identity.removesuffix(suffix), channel
    return identity, "main"


def cluster_keys(config: ClusterConfig) -> ClusterKeys:
    """The control keys of ``config.control_keys``, else new ones for the engines it names."""
    if config.control_keys:
        return ClusterKeys.load(config.control_keys)
    return ClusterKeys.generate(name for name, _, _ in engine_roles(config))


def _bind(host: str, port: int, keys: ClusterKeys,
          context: zmq.Context) -> tuple[zmq.Socket, str]:
    """The engine endpoint, bound; and the address a local engine connects to."""
    try:
        socket, port = router_socket(host, port, keys, context)
    except zmq.ZMQError as exc:
        raise DualPathError(f"the router cannot bind tcp://{host}:{port or '*'}: {exc}") from exc
    local = "127.0.0.1" if host in ("0.0.0.0", "*") else host
    return socket, f"tcp://{local}:{port}"


def _kv_tokens(config: ClusterConfig, layout: KVLayout, role: Role) -> int:
    """Tokens of KV one engine of ``role`` holds (a layerwise PE: with its layer window)."""
    engine = engine_config_for(config, role)
    return layout.cache_blocks(engine.num_kv_blocks, engine.kv_cache_mb,
                               engine.layer_window) * layout.block_size


def scheduler_params(config: ClusterConfig, full_block_bytes: int) -> SchedulerParams:
    """α and β: as configured, else from the profile, else α from the storage read cap.

    Without any of these α and β are unbounded: every node counts as short-queued and no PE as
    overloaded, so PE choice is least-tokens and the path the shorter queue.
    """
    unbounded = 1 << 40
    alpha, beta = config.alpha_tokens, config.beta_tokens
    if config.profile_path:
        profiled = json.loads(Path(config.profile_path).read_text())["summary"]
        alpha = alpha if alpha is not None else int(profiled["alpha_tokens"])
        beta = beta if beta is not None else int(profiled["beta_tokens"])
    if alpha is None and config.storage.read_cap_mb_s:
        tokens_per_s = config.storage.read_cap_mb_s * 1e6 / full_block_bytes
        alpha = int(3.0 * tokens_per_s * config.engine.block_size)
    return SchedulerParams(alpha_tokens=unbounded if alpha is None else alpha,
                           beta_tokens=unbounded if beta is None else beta, policy=config.policy,
                           block_size=config.engine.block_size, split_read=config.split_read)
