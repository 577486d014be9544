"""The router, its callers' side: the I/O around the socket-free ``RouterState``.

``Router`` submits requests (each future resolves to a ``ClusterOutput``), aborts them and
answers questions about the cluster. Every call is thread-safe: it posts to the inbox of the
router thread (``router/loop.py``: the ZeroMQ loop that owns the socket and the state, and the
handling of engines' messages) and, where it needs an answer, waits for it. ``router/setup.py``
holds what the router is built from (control keys, the bound socket, KV capacities, the
scheduler's α and β).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from dualpath.config import engine_config_for
from dualpath.errors import DualPathError, RequestError
from dualpath.protocol import GetMetrics, Heartbeat, Shutdown
from dualpath.request import SamplingParams
from dualpath.server.router.loop import RequestFuture, RouterLoop
from dualpath.server.router.setup import scheduler_params
from dualpath.server.router.types import (
    ClusterOutput,
    EngineInfo,
    RequestAborted,
    RequestFailed,
    RequestState,
)
from dualpath.sessions import Session
from dualpath.vocab import Mode, ReadPath, Role

__all__ = ["ClusterOutput", "EngineInfo", "RequestAborted", "RequestFailed", "RequestFuture",
           "Router", "scheduler_params"]

T = TypeVar("T")


class Router(RouterLoop):
    """Routes requests through the engines of a cluster: the I/O around ``RouterState``."""

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
               cache_salt: str = "", session: Session | None = None) -> RequestFuture:
        """Start a request (mode and read path default to the config's); resolves when done.

        ``cache_salt`` (a tenant's, as vLLM spells it) salts the request's block keys: it hits
        only blocks stored by requests of the same salt. ``session``: the agent session the
        request continues, with its harness's hint (``dualpath/sessions.py``).

        ``on_tokens`` is called on the router thread with each batch of new output tokens as
        they arrive (the first one as soon as the prefill engine sampled it); it must not block.
        Fails at once (``RequestError`` in the future) when it could never fit an engine.
        """
        req = RequestState(next(self._ids), tuple(prompt_ids), params,
                           Mode(mode or self.config.mode),
                           ReadPath(read_path or self.config.read_path), cache_salt=cache_salt,
                           session=session)
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
                                  "moved": self.state.moved,
                                  "local_prefills": self.state.placement.num_local,
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
        """An engine process exited (its launcher saw it): fail or re-place what it held, place
        new work elsewhere, lift the write fences it held (it writes nowhere any more)."""
        self._inbox.put(lambda: self._lose(name, f"engine {name} exited", exited=True))

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
