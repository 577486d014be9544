"""The router thread: a ZeroMQ loop around the socket-free ``RouterState``.

Per request: look up how many leading full blocks storage holds (the hit, block aligned and
leaving at least one token to compute) and hand it to the state machine
(``server/router/state.py``), which queues it in the global scheduler (``scheduler/``, the same
pure code the simulator runs), places it and drives it through the engines: DE allocates its
buffer (and reads the hit on the DE path) → PE prefills layer by layer into that buffer → DE
decodes and persists. The loop sends what the state asks, completes futures, and every
``HEARTBEAT_TICK_S`` lets the state declare silent engines lost. One bad message is logged and
counted, never the end of the loop. One thread owns the socket; the callers' side, whose
``submit`` and ``abort`` are thread-safe, is :class:`~dualpath.server.router.client.Router`.
"""

from __future__ import annotations

import itertools
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import zmq

from dualpath.config import ClusterConfig, cluster_config_to_json
from dualpath.control_keys import ClusterKeys
from dualpath.control_socket import ZapHandler
from dualpath.errors import DualPathError
from dualpath.kv.hashing import BlockKey
from dualpath.kv.layout import engine_layout, key_space_for
from dualpath.model.spec import load_spec, model_id
from dualpath.protocol import (
    HEARTBEAT_SUFFIX,
    JOIN_SUFFIX,
    Aborted,
    BufferReady,
    Failed,
    Finished,
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
    Tokens,
    decode,
    encode,
)
from dualpath.scheduler.global_scheduler import GlobalScheduler
from dualpath.server.router.sessions import MarkWrite, SessionBook
from dualpath.server.router.setup import bind, cluster_keys, kv_tokens, scheduler_params
from dualpath.server.router.state import RouterState
from dualpath.server.router.types import (
    Capacity,
    ClusterOutput,
    Effects,
    RequestFailed,
    RequestState,
)
from dualpath.storage import open_store
from dualpath.vocab import EngineKind, Mode, ReadPath, Role

log = logging.getLogger("dualpath.router")
HEARTBEAT_TICK_S = 0.1  # how often the loop checks engine silence
ORACLE_BLOCKS_KEPT = 1 << 20  # block keys oracle mode remembers (then it starts afresh)


class RequestFuture(Future):
    """The future of one submitted request; ``req_id`` names it for ``Router.abort``."""

    def __init__(self, req_id: int) -> None:
        super().__init__()
        self.req_id = req_id


class RouterLoop:
    """The router thread and what it owns (the socket, the state, the store): it carries out
    the state's effects and hands engines' messages to it."""

    def __init__(self, model_dir: str | Path, config: ClusterConfig,
                 clock: Callable[[], float] = time.monotonic,
                 keys: ClusterKeys | None = None) -> None:
        """``keys``: the control plane's (default: read from ``config.control_keys``, else
        made for the engines ``config`` names; launchers hand each engine its own)."""
        Mode(config.mode)  # ValueError names a bad mode
        ReadPath(config.read_path)  # ... or a bad read path
        self.config = config
        self._clock = clock
        engine = config.engine
        layout = engine_layout(load_spec(model_dir), engine.dtype, engine.kv_dtype,
                               engine.block_size, config.engine_kind)
        self.block_size = layout.block_size
        self.key_space = key_space_for(model_id(model_dir), layout, config.engine_kind)
        self.store = open_store(config.storage, layout)
        self.sessions = SessionBook(self.key_space, config.storage.session_window_s)
        self.mark_errors = 0  # session marks the store could not take
        capacity = Capacity(self.block_size, kv_tokens(config, layout, Role.DECODE),
                            config.host_pool_blocks, config.save_staging_blocks,
                            kv_tokens(config, layout, Role.PREFILL))
        self.state = RouterState(GlobalScheduler(scheduler_params(config, layout.full_block_bytes)),
                                 capacity, config.engine_timeout_s, config.heartbeat_s,
                                 prefetch=config.storage.session_prefetch
                                 and config.engine_kind == EngineKind.DUALPATH,
                                 local_prefill_tokens=config.local_prefill_tokens
                                 if config.engine_kind == EngineKind.DUALPATH else 0)
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
        engine_keys = self.keys.engines.items()
        self.state.members.public_keys = {name: pair.public for name, pair in engine_keys}
        self._context = zmq.Context()  # its own: its ZAP handler admits this cluster's engines
        self._zap = ZapHandler(self._context, self.keys)
        try:
            self.socket, self.address = bind(config.router_host, config.router_port, self.keys,
                                             self._context)
        except DualPathError:
            self._close_context()
            raise
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="router", daemon=True)
        self._thread.start()

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
                log.warning("router: request %d's stream moves off %s after %d tokens", req_id,
                            req.left_de, req.num_streamed)
                self._apply(self.state.resume(req_id, self._hit_blocks(req), self._clock()))
        for req_id, result in effects.done:
            self._listeners.pop(req_id, None)
            self._remember_oracle(req_id, result)
            self._mark_session(req_id, result)
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
        keys = self._lookup_keys(req)
        req.num_hit_blocks = self._count_hits(req, keys)
        self._write_mark(self.sessions.admit(req.req_id, req.session, req.mode,
                                             req.cache_salt, [key.block_hash for key in keys],
                                             req.num_hit_blocks, time.time_ns()))
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

    def _mark_session(self, req_id: int, result: ClusterOutput | Exception) -> None:
        """Tell the store where a finished turn left its session's chain (``sessions.py``)."""
        self._write_mark(self.sessions.finish(req_id, result, time.time_ns()))

    def _write_mark(self, write: MarkWrite | None) -> None:
        """Hand a session mark to the store (a failure costs the session its claim)."""
        if write is None:
            return
        try:
            self.store.mark_session(write.session_key, write.mark)
        except OSError as exc:  # costs the session its claim, never the request
            self.mark_errors += 1
            log.warning("router: the store could not take a session mark: %s", exc)

    def _lose(self, name: str, reason: str, exited: bool = False) -> Effects:
        for future in self._metrics.pop(name, []):
            if not future.done():
                future.set_exception(RequestFailed(reason))
        return self.state.lose(name, reason, exited)

    def _hit_blocks(self, req: RequestState) -> int:
        """Leading full blocks storage holds (leaving at least one token to compute); a store
        that cannot be asked counts as holding nothing."""
        return self._count_hits(req, self._lookup_keys(req))

    def _lookup_keys(self, req: RequestState) -> list[BlockKey]:
        """The keys a request's hit is looked up by: its leading full blocks, leaving at least
        one token to compute (none for recompute)."""
        if req.mode == Mode.RECOMPUTE:
            return []
        max_hit = (len(req.kv_ids) - 1) // self.block_size
        space = self.key_space if req.mode == Mode.ORACLE else self.key_space.salted(
            req.cache_salt)  # oracle hits are the router's own (unsalted) record
        return space.keys(req.kv_ids[: max_hit * self.block_size])

    def _count_hits(self, req: RequestState, keys: list[BlockKey]) -> int:
        """How many of ``keys`` lead the stored chain (the oracle: its own record)."""
        if not keys:
            return 0
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
