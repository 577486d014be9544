"""The router: owns the request flow across prefill and decode engines.

Per request: look up how many leading full blocks storage holds (the hit, block aligned and
leaving at least one token to compute) and queue it in the global scheduler (``scheduler/``,
the same pure code the simulator runs). Whenever something changes — a request arrives, a
prefill or a decode ends — the router builds a ``ClusterView`` from what it tracks (per engine
``seq``, ``tok`` and free KV; per node the tokens being read) and lets the scheduler place the
queued requests: PE by Algorithm 1, DE by the two-phase rule, the read path by the shorter node
read queue. Then it drives the engines: DE allocates its buffer (and reads the hit on the DE
path) → PE prefills layer by layer into that buffer → DE decodes and persists. A request no DE
has room for waits in the queue. One thread owns the socket; ``submit`` is thread-safe.
"""

from __future__ import annotations

import itertools
import json
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import zmq

from dualpath.config import ClusterConfig
from dualpath.errors import DualPathError
from dualpath.kv.hashing import KeySpace
from dualpath.kv.layout import KVLayout
from dualpath.model.spec import load_spec, model_id, resolve_dtype, resolve_kv_dtype
from dualpath.protocol import (
    AllocBuffer,
    BufferReady,
    Decode,
    Failed,
    Finished,
    GetMetrics,
    Hello,
    Message,
    Metrics,
    Prefill,
    Prefilled,
    ReadDone,
    Release,
    Shutdown,
    decode,
    encode,
)
from dualpath.request import SamplingParams
from dualpath.scheduler.global_scheduler import GlobalScheduler, SchedulerParams
from dualpath.scheduler.view import Assignment, ClusterView, EngineView, NodeView, PendingRequest
from dualpath.storage import open_store

MODES = ("basic", "layerwise", "dualpath", "oracle", "recompute")
READ_PATHS = ("auto", "pe", "de")


class RequestFailed(DualPathError):
    """An engine could not serve a request."""


@dataclass(frozen=True)
class EngineInfo:
    """A registered engine."""

    name: str
    role: str
    node_id: int
    endpoint: str


@dataclass(frozen=True)
class ClusterOutput:
    """A finished request and how it was served."""

    req_id: int
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str
    num_hit_tokens: int
    read_path: str
    prefill_engine: str
    decode_engine: str


@dataclass
class _Load:
    """What the router has placed on one engine and not yet seen finish."""

    seq: int = 0
    tok: int = 0
    kv_tokens: int = 0  # DE: device KV reserved (prompt + max_tokens)
    buffer_tokens: int = 0  # DE: host-buffer tokens reserved until decode starts


@dataclass
class _Request:
    req_id: int
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    future: Future[ClusterOutput]
    pe: EngineInfo | None = None
    de: EngineInfo | None = None
    mode: str = "dualpath"
    read_path: str = "auto"  # requested ("auto", "pe", "de"), then the chosen path
    num_hit_blocks: int = 0
    prefilled: bool = False


class Router:
    """Routes requests through the engines of a local cluster."""

    def __init__(self, model_dir: str | Path, config: ClusterConfig) -> None:
        if config.mode not in MODES or config.read_path not in READ_PATHS:
            raise ValueError(f"mode must be one of {MODES} and read_path one of {READ_PATHS}")
        self.config = config
        spec = load_spec(model_dir)
        kv_dtype = resolve_kv_dtype(config.engine.kv_dtype,
                                    resolve_dtype(config.engine.dtype, spec))
        layout = KVLayout.from_spec(spec, kv_dtype, config.engine.block_size)
        self.block_size = layout.block_size
        self.key_space = KeySpace(model_id(model_dir), layout.layout_id, layout.block_size)
        self.store = open_store(config.storage, layout)
        self.scheduler = GlobalScheduler(scheduler_params(config, layout.full_block_bytes))
        blocks = config.engine.num_kv_blocks or layout.blocks_in(config.engine.kv_cache_mb)
        self._kv_capacity_tokens = blocks * self.block_size
        self._buffer_capacity_tokens = config.host_pool_blocks * self.block_size
        self.engines: dict[str, EngineInfo] = {}
        self.pending_read_tokens: dict[int, int] = {}  # node -> tokens being read
        self.decisions: list[tuple[int, str, str, str, int]] = []  # req, pe, de, path, hit
        self._load: dict[str, _Load] = {}
        self._queued: dict[int, _Request] = {}  # waiting for the scheduler
        self._requests: dict[int, _Request] = {}  # placed on engines
        self._ids = itertools.count(1)
        self._inbox: queue.Queue[_Request | Message | tuple[str, object]] = queue.Queue()
        self._metrics: dict[str, Future[dict]] = {}
        self._hello = threading.Condition()
        self.socket = zmq.Context.instance().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="router", daemon=True)
        self._thread.start()

    # -- public ---------------------------------------------------------------------------------
    def wait_for_engines(self, count: int, timeout_s: float) -> None:
        """Block until ``count`` engines said hello."""
        with self._hello:
            if not self._hello.wait_for(lambda: len(self.engines) >= count, timeout_s):
                raise DualPathError(f"only {len(self.engines)} of {count} engines came up")

    def submit(self, prompt_ids: list[int], params: SamplingParams, mode: str | None = None,
               read_path: str | None = None) -> Future[ClusterOutput]:
        """Start a request (mode and read path default to the config's); resolves when done."""
        mode = mode or self.config.mode
        read_path = read_path or self.config.read_path
        if mode not in MODES or read_path not in READ_PATHS:
            raise ValueError(f"mode must be one of {MODES} and read_path one of {READ_PATHS}")
        req = _Request(next(self._ids), tuple(prompt_ids), params, Future(), mode=mode,
                       read_path=read_path)
        self._inbox.put(req)
        return req.future

    def collect_metrics(self, timeout_s: float = 30.0) -> dict[str, dict]:
        """Every engine's counters, by engine name."""
        futures = {name: Future() for name in self.engines}
        self._inbox.put(("metrics", futures))
        return {name: f.result(timeout_s) for name, f in futures.items()}

    def engine_lost(self, name: str) -> None:
        """An engine process is gone: fail what it held, place new work elsewhere."""
        self._inbox.put(("lost", name))

    def shutdown(self) -> None:
        """Tell every engine to stop and end the router thread."""
        self._inbox.put(("shutdown", None))
        self._thread.join(timeout=10)
        self.store.close()

    # -- loop -----------------------------------------------------------------------------------
    def _loop(self) -> None:
        while self._running:
            if self.socket.poll(5):
                name, raw = self.socket.recv_multipart()
                self._on_message(name.decode(), decode(raw))
            self._drain_inbox()
        self.socket.close(0)

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Request):
                self._start(item)
            elif item[0] == "metrics":
                self._metrics.update(item[1])  # type: ignore[arg-type]
                for name in item[1]:  # type: ignore[union-attr]
                    self._send(name, GetMetrics())
            elif item[0] == "lost":
                self._lose(str(item[1]))
            elif item[0] == "shutdown":
                for name in self.engines:
                    self._send(name, Shutdown())
                self._running = False

    def _send(self, engine: str, msg: Message) -> None:
        self.socket.send_multipart([engine.encode(), encode(msg)])

    # -- request flow ----------------------------------------------------------------------------
    def _start(self, req: _Request) -> None:
        req.num_hit_blocks = self._hit_blocks(req)
        self._queued[req.req_id] = req
        self.scheduler.submit(PendingRequest(req.req_id, len(req.prompt_ids),
                                             self._read_tokens(req)))
        self._schedule()

    def _schedule(self) -> None:
        """Let the scheduler place what it can on the current view."""
        if not self._queued or not self.engines:
            return
        for assignment in self.scheduler.schedule(self._view()):
            self._dispatch(self._queued.pop(assignment.req_id), assignment)

    def _dispatch(self, req: _Request, assignment: Assignment) -> None:
        req.pe = self.engines[assignment.prefill]
        req.de = self.engines[assignment.decode]
        req.read_path = self._read_path(req, assignment.read_path)
        self._requests[req.req_id] = req
        self._reserve(req, +1)
        self.decisions.append((req.req_id, req.pe.name, req.de.name, req.read_path,
                               req.num_hit_blocks))
        reader = req.pe if req.read_path == "pe" else req.de
        self._add_pending(reader.node_id, self._read_tokens(req))
        num_blocks = -(-len(req.prompt_ids) // self.block_size)
        de_reads = req.num_hit_blocks if req.read_path == "de" and _reads(req) else 0
        self._send(req.de.name, AllocBuffer(req.req_id, req.prompt_ids, num_blocks, de_reads))

    def _reserve(self, req: _Request, sign: int) -> None:
        """Count (+1) or release (-1) a request on its engines."""
        assert req.pe is not None and req.de is not None
        tokens = len(req.prompt_ids)
        pe, de = self._load[req.pe.name], self._load[req.de.name]
        pe.seq += sign
        pe.tok += sign * tokens
        de.seq += sign
        de.tok += sign * tokens
        de.kv_tokens += sign * (tokens + req.params.max_tokens)
        de.buffer_tokens += sign * tokens

    def _view(self) -> ClusterView:
        engines = []
        for e in self.engines.values():
            load = self._load[e.name]
            free = max(0, min(self._kv_capacity_tokens - load.kv_tokens,
                              self._buffer_capacity_tokens - load.buffer_tokens))
            engines.append(EngineView(e.name, e.role, e.node_id, f"{e.role}-node{e.node_id}",
                                      load.seq, load.tok, free))
        nodes = tuple(NodeView(n, max(0, q)) for n, q in sorted(self.pending_read_tokens.items()))
        return ClusterView(tuple(engines), nodes)

    def _on_message(self, engine: str, msg: Message) -> None:
        if isinstance(msg, Hello):
            self._register(msg)
        elif isinstance(msg, Metrics):
            future = self._metrics.pop(msg.name, None)
            if future is not None:
                future.set_result(msg.values)
        elif isinstance(msg, BufferReady):
            self._buffer_ready(self._requests[msg.req_id], msg)
        elif isinstance(msg, ReadDone):
            req = self._requests[msg.req_id]
            self._add_pending(req.pe.node_id, -self._read_tokens(req))
        elif isinstance(msg, Prefilled):
            self._prefilled(self._requests[msg.req_id], msg)
        elif isinstance(msg, Finished):
            self._finished(self._requests.pop(msg.req_id), msg)
        elif isinstance(msg, Failed):
            self._failed(msg)

    def _buffer_ready(self, req: _Request, msg: BufferReady) -> None:
        assert req.pe is not None and req.de is not None
        if req.read_path == "de":
            self._add_pending(req.de.node_id, -self._read_tokens(req))
            if _reads(req):
                req.num_hit_blocks = msg.num_loaded_blocks
        p = req.params
        self._send(req.pe.name, Prefill(req.req_id, req.prompt_ids, req.num_hit_blocks,
                                        req.read_path, req.de.endpoint, msg.buffer_addr,
                                        _pe_mode(req), p.temperature, p.top_p, p.seed))

    def _prefilled(self, req: _Request, msg: Prefilled) -> None:
        assert req.pe is not None and req.de is not None
        req.num_hit_blocks = msg.num_hit_blocks
        req.prefilled = True
        tokens = len(req.prompt_ids)
        pe, de = self._load[req.pe.name], self._load[req.de.name]
        pe.seq, pe.tok = pe.seq - 1, pe.tok - tokens
        de.buffer_tokens -= tokens  # the DE frees the buffer as decoding starts
        p = req.params
        self._send(req.de.name, Decode(req.req_id, req.prompt_ids, msg.first_token,
                                       msg.num_hit_blocks, p.max_tokens, p.temperature, p.top_p,
                                       p.seed, p.ignore_eos, oracle=req.mode == "oracle",
                                       stop=p.stop))
        self._schedule()

    def _finished(self, req: _Request, msg: Finished) -> None:
        assert req.pe is not None and req.de is not None
        tokens = len(req.prompt_ids)
        de = self._load[req.de.name]
        de.seq, de.tok = de.seq - 1, de.tok - tokens
        de.kv_tokens -= tokens + req.params.max_tokens
        self._schedule()
        req.future.set_result(ClusterOutput(
            req.req_id, list(req.prompt_ids), list(msg.output_ids), msg.finish_reason,
            req.num_hit_blocks * self.block_size, req.read_path, req.pe.name, req.de.name))

    def _failed(self, msg: Failed) -> None:
        req = self._requests.pop(msg.req_id, None)
        if req is None:
            return
        if req.de is not None:
            self._send(req.de.name, Release(req.req_id))
        self._release_all(req)
        req.future.set_exception(RequestFailed(msg.error))
        self._schedule()

    def _lose(self, name: str) -> None:
        info = self.engines.pop(name, None)
        if info is None:
            return
        pending_metrics = self._metrics.pop(name, None)
        if pending_metrics is not None:
            pending_metrics.set_exception(RequestFailed(f"engine {name} exited"))
        for req in [r for r in self._requests.values() if name in (r.pe.name, r.de.name)]:  # type: ignore[union-attr]
            self._failed(Failed(req.req_id, f"engine {name} exited"))
        self._schedule()

    def _release_all(self, req: _Request) -> None:
        """Forget whatever of a failed request is still counted on its engines."""
        if req.pe is None or req.de is None:
            return
        tokens = len(req.prompt_ids)
        pe, de = self._load[req.pe.name], self._load[req.de.name]
        if not req.prefilled:
            pe.seq, pe.tok = pe.seq - 1, pe.tok - tokens
            de.buffer_tokens -= tokens
        de.seq, de.tok = de.seq - 1, de.tok - tokens
        de.kv_tokens -= tokens + req.params.max_tokens

    # -- decisions ------------------------------------------------------------------------------
    def _register(self, msg: Hello) -> None:
        with self._hello:
            self.engines[msg.name] = EngineInfo(msg.name, msg.role, msg.node_id, msg.endpoint)
            self._load.setdefault(msg.name, _Load())
            self.pending_read_tokens.setdefault(msg.node_id, 0)
            self._hello.notify_all()
        self._schedule()

    def _hit_blocks(self, req: _Request) -> int:
        if req.mode == "recompute":
            return 0
        max_hit = (len(req.prompt_ids) - 1) // self.block_size  # compute at least one token
        keys = self.key_space.keys(req.prompt_ids[: max_hit * self.block_size])
        return self.store.exists_prefix(keys)

    @staticmethod
    def _read_path(req: _Request, scheduled: str) -> str:
        """basic/layerwise read on the PE; a forced path wins; else the scheduler's choice."""
        if req.mode in ("basic", "layerwise"):
            return "pe"
        if req.read_path != "auto":
            return req.read_path
        if scheduled not in ("pe", "de"):
            raise DualPathError(f"read path {scheduled!r} is not supported by the engines")
        return scheduled

    def _read_tokens(self, req: _Request) -> int:
        return req.num_hit_blocks * self.block_size if _reads(req) else 0

    def _add_pending(self, node: int, tokens: int) -> None:
        self.pending_read_tokens[node] = self.pending_read_tokens.get(node, 0) + tokens


def _pe_mode(req: _Request) -> str:
    """What the PE does with the KV: all at once (basic), per layer, or nothing (oracle)."""
    return {"basic": "basic", "oracle": "oracle"}.get(req.mode, "layerwise")


def _reads(req: _Request) -> bool:
    return req.mode != "oracle"


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
                           block_size=config.engine.block_size)
