"""The workers of engine processes that drive vLLM instances (``engine_kind = "vllm"``).

They speak our protocol to the router like ``PrefillWorker`` and ``DecodeWorker``
(``engine/worker.py``), and turn it into HTTP calls on their vLLM instance
(``integrations/vllm/engines/http.py``), whose dualpath KV connector moves the KV; the per-request
instructions travel in ``kv_transfer_params["dualpath"]``. Calls run on a thread pool (``handle``
and ``work`` never block on one); their results come back through a queue that ``work``
drains.

- ``VllmPrefillWorker``: a ``Prefill`` is one completion of ``max_tokens: 1``; the connector
  reads the hit (PE path) or pulls it from the DE buffer (DE path) and pushes the prompt's KV
  into that buffer. Its answer's first token and cached-token count make the ``Prefilled``.
- ``VllmDecodeWorker`` (``vllm/engines/decode.py``): the decode node's buffer service (the host
  buffer the decode instance's connector maps, DE-path reads) and a streamed completion per
  ``Decode``.

An abort closes the call's connection: vLLM then aborts the request. A prefill engine answers
``Aborted`` or ``Failed`` only once the request's fence has settled (``vllm/fence.py``): no step
of the instance that might still push the request's KV into its DE buffer is running.

Liveness: a call whose answer has not begun (no byte received) is work that has not moved; the
heartbeat reports the age of the oldest such call beside how long it should take (its prompt at
the pace of the calls that finished), so a hung instance is told from a busy one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from dualpath.errors import RequestError
from dualpath.integrations.vllm.engines.http import HttpCall, VllmHttp, VllmHttpError
from dualpath.integrations.vllm.fence import FenceTable, fence_path_for
from dualpath.integrations.vllm.plan import PrefillParams, vllm_salt
from dualpath.kv.block_plan import load_blocks
from dualpath.protocol import (
    Abort,
    Aborted,
    Failed,
    Message,
    Prefill,
    Prefilled,
)
from dualpath.request import SamplingParams
from dualpath.vocab import PrefillMode, ReadPath

log = logging.getLogger("dualpath.vllm")
STATS_EVERY_S = 0.5  # the instance's /metrics is read at most this often
DE_STREAM_THREADS = 64  # concurrent decode streams (a thread each)
PE_CALL_THREADS = 16  # concurrent prefill calls
# seconds per prompt token a call is allowed before any call has finished: slower than a CPU
# thread prefills a model of billions of weights, so a first call is never judged too early
PRIOR_S_PER_TOKEN = 0.05


def sampling_body(params: SamplingParams) -> dict[str, Any]:
    """The OpenAI sampling fields of ``params`` (``seed`` only when set)."""
    body: dict[str, Any] = {"temperature": params.temperature, "top_p": params.top_p}
    if params.seed is not None:
        body["seed"] = params.seed
    return body


class VllmWorkerBase:
    """What both roles share: the instance, the call pool, the result queue, the cached KV
    stats and the counters."""

    def __init__(self, http: VllmHttp, model: str, block_size: int, threads: int) -> None:
        self.http = http
        self.model = model
        self.block_size = block_size
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="vllm-call")
        self._stats_pool = ThreadPoolExecutor(1, thread_name_prefix="vllm-stats")
        self._stats_future: Future[None] | None = None
        self._stats_at_s = 0.0
        self._free_kv_blocks = 0
        self._events: queue.Queue[Callable[[], list[Message]]] = queue.Queue()
        self._s_per_token: float | None = None  # how fast finished calls went, per token
        self.num_requests = 0
        self.num_failures = 0
        self.num_aborted = 0
        self.http_s_total = 0.0  # wall time of finished calls
        # Called with a step's token count (the EP traffic generator's exchange); vLLM runs
        # the steps, so this worker never calls it.
        self.on_step: Callable[[int], None] = lambda num_tokens: None
        self.abandon: Callable[[], bool] = lambda: False  # calls end on abort: not polled
        self.name = ""

    def liveness(self) -> tuple[float, float]:
        """(when work last moved, how long the waiting call should take): the oldest call that
        has received nothing yet counts as work not moving since it started."""
        waiting = [(started_s, tokens) for started_s, tokens in self._calls_waiting()]
        if not waiting:
            return time.monotonic(), 0.0
        started_s, tokens = min(waiting)
        s_per_token = self._s_per_token if self._s_per_token is not None else PRIOR_S_PER_TOKEN
        return started_s, tokens * s_per_token

    def _calls_waiting(self) -> list[tuple[float, int]]:
        """(started, prompt tokens) of each call in flight that has received nothing yet (each
        role keeps its own)."""
        return []

    def _timed(self, elapsed_s: float, num_tokens: int) -> None:
        """A call of ``num_tokens`` prompt tokens answered in ``elapsed_s``: the pace later
        calls are judged by (the slowest of the latest and the running mean)."""
        if num_tokens <= 0:
            return
        pace = elapsed_s / num_tokens
        mean = pace if self._s_per_token is None else (self._s_per_token + pace) / 2
        self._s_per_token = max(pace, mean)

    def _post(self, event: Callable[[], list[Message]]) -> None:
        """Hand a call's result to the loop thread (``work`` runs ``event``)."""
        self._events.put(event)

    def drain(self) -> list[Message]:
        """Run the results the calls posted; returns the messages to send."""
        out: list[Message] = []
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return out
            out.extend(event())

    @property
    def has_work(self) -> bool:
        """True when call results wait to be picked up."""
        return not self._events.empty()

    @property
    def free_kv_blocks(self) -> int:
        """The instance's free KV blocks, from its metrics (refreshed in the background at
        most every ``STATS_EVERY_S``; 0 until first read)."""
        now = time.monotonic()
        busy = self._stats_future is not None and not self._stats_future.done()
        if now - self._stats_at_s >= STATS_EVERY_S and not busy:
            self._stats_at_s = now
            with contextlib.suppress(RuntimeError):  # closed: the cached count stands
                self._stats_future = self._stats_pool.submit(self._refresh_stats)
        return self._free_kv_blocks

    def _refresh_stats(self) -> None:
        try:
            self._free_kv_blocks = self.http.kv_cache_stats().free_blocks
        except VllmHttpError as exc:
            log.warning("vLLM metrics: %s", exc)

    def base_metrics(self) -> dict[str, object]:
        """The counters both roles keep."""
        return {"vllm_requests": self.num_requests, "vllm_failures": self.num_failures,
                "vllm_aborted": self.num_aborted, "vllm_http_s_total": self.http_s_total}

    def _open_calls(self) -> list[HttpCall]:
        """The calls in flight (each role keeps its own)."""
        return []

    def close(self) -> None:
        """Close the calls in flight (vLLM aborts them) and stop the call threads."""
        for call in self._open_calls():
            call.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._stats_pool.shutdown(wait=False, cancel_futures=True)


# -- prefill ------------------------------------------------------------------------------------
@dataclass(eq=False)
class _PrefillCall:
    msg: Prefill
    call: HttpCall
    hit_tokens: int  # tokens the instance reads from storage (PE path), for the read queue
    started_s: float = field(default_factory=time.monotonic)


@dataclass
class _Fencing:
    """A request given up on, answered once its fence settles (``vllm/fence.py``)."""

    answer: Message  # Aborted or Failed
    steps: int | None = None  # the instance's steps begun at the revocation (None: not yet)


class VllmPrefillWorker(VllmWorkerBase):
    """``Prefill`` → one completion of ``max_tokens: 1`` on the prefill instance."""

    def __init__(self, http: VllmHttp, model: str, block_size: int,
                 threads: int = PE_CALL_THREADS, block_bytes: int = 0) -> None:
        """``block_bytes``: one stored block (all layers), for the node's storage-read
        figure."""
        super().__init__(http, model, block_size, threads)
        self.block_bytes = block_bytes
        self.num_store_read_blocks = 0  # hit blocks the instance read from the store
        self._calls: dict[int, _PrefillCall] = {}
        self._fencing: dict[int, _Fencing] = {}  # req_id -> its answer, once settled
        self._fence: FenceTable | None = None  # made on first use, named in every call
        self.num_prefilled = 0
        self.num_hit_tokens = 0
        self.num_computed_tokens = 0

    def handle(self, msg: Message) -> list[Message]:
        """``Prefill`` or ``Abort``; returns the answers."""
        if isinstance(msg, Prefill):
            self.accept(msg)
            return []
        if isinstance(msg, Abort):
            return self.abort(msg.req_id)
        raise ValueError(f"a prefill engine cannot handle {msg.type!r}")

    def fence_table(self) -> FenceTable:
        """This engine's fence table (created on first use)."""
        if self._fence is None:
            self._fence = FenceTable.create(fence_path_for(self.name or "pe"))
        return self._fence

    def accept(self, msg: Prefill) -> None:
        """Start the request's completion call."""
        if not 0 <= msg.num_prior_outputs < len(msg.prompt_ids):
            raise RequestError(f"{msg.num_prior_outputs} prior outputs of "
                               f"{len(msg.prompt_ids)} tokens")
        reads = load_blocks(msg.read_path, msg.num_hit_blocks, msg.num_pe_read_blocks)
        job = _PrefillCall(msg, HttpCall(), reads * self.block_size)
        self._calls[msg.req_id] = job
        self.num_requests += 1
        self._pool.submit(self._run, job, self.prefill_body(msg))

    def prefill_body(self, msg: Prefill) -> dict[str, Any]:
        """The completion request of a ``Prefill`` (the connector's contract)."""
        params, salt = msg.params, msg.cache_salt
        body: dict[str, Any] = {
            "model": self.model, "prompt": list(msg.prompt_ids), "max_tokens": 1,
            **sampling_body(params), "min_tokens": min(1, params.min_tokens),
            "return_token_ids": True, "stream": False}
        if salt:
            body["cache_salt"] = vllm_salt(salt)  # vLLM's limits; keys use the salt itself
        body["kv_transfer_params"] = PrefillParams(
            msg.req_id, ReadPath(msg.read_path), msg.num_hit_blocks, msg.num_pe_read_blocks,
            msg.de_endpoint, msg.de_buffer_addr, -(-len(msg.prompt_ids) // self.block_size),
            PrefillMode(msg.mode), self.fence_table().path, salt).to_params()
        return body

    def _run(self, job: _PrefillCall, body: dict[str, Any]) -> None:
        started_s = time.monotonic()
        try:
            answer: dict[str, Any] | Exception = self.http.completions(body, job.call)
        except Exception as exc:  # reported to the router as this request's failure
            answer = exc
        elapsed_s = time.monotonic() - started_s
        self._post(lambda: self._done(job, answer, elapsed_s))

    def _done(self, job: _PrefillCall, answer: dict[str, Any] | Exception,
              elapsed_s: float) -> list[Message]:
        msg = job.msg
        if self._calls.get(msg.req_id) is not job:
            return []  # aborted: answered then
        del self._calls[msg.req_id]
        self.http_s_total += elapsed_s
        try:
            if isinstance(answer, Exception):
                raise answer
            first, cached = _first_token(answer)
        except Exception as exc:  # vLLM may still run a step of it: answer once settled
            self.num_failures += 1
            job.call.close()
            return self._revoke(msg.req_id, Failed(msg.req_id, f"vllm prefill instance "
                                                              f"{self.http.url}: "
                                                              f"{error_detail(exc)}"))
        self._timed(elapsed_s, len(msg.prompt_ids) - cached)
        self.num_prefilled += 1
        hit_blocks = min(msg.num_hit_blocks, cached // self.block_size)
        self.num_hit_tokens += cached
        self.num_store_read_blocks += min(hit_blocks, job.hit_tokens // self.block_size)
        self.num_computed_tokens += len(msg.prompt_ids) - cached
        return [Prefilled(msg.req_id, first, hit_blocks, len(msg.prompt_ids) - cached,
                          forward_s=elapsed_s)]

    def abort(self, req_id: int) -> list[Message]:
        """Close the request's call (vLLM aborts it); answers ``Aborted`` once its fence has
        settled (at once for a request with no call: it was never sent)."""
        job = self._calls.pop(req_id, None)
        if job is None:
            return [] if req_id in self._fencing else [Aborted(req_id)]
        job.call.close()
        self.num_aborted += 1
        return self._revoke(req_id, Aborted(req_id))

    def _revoke(self, req_id: int, answer: Message) -> list[Message]:
        """Revoke the request in the fence table; ``answer`` goes out once it has settled."""
        self._fencing[req_id] = _Fencing(answer)
        return self._settle()

    def _settle(self) -> list[Message]:
        """Revocations the ring had no room for, then the answers of settled fences."""
        if not self._fencing:
            return []
        table = self.fence_table()
        for fencing in self._fencing.values():
            if fencing.steps is None:
                fencing.steps = table.revoke(fencing.answer.req_id)  # type: ignore[attr-defined]
        done = table.done()
        settled = [r for r, f in self._fencing.items() if f.steps is not None and done >= f.steps]
        return [self._fencing.pop(req_id).answer for req_id in settled]

    def settled(self) -> bool:
        """True when no request's fence is still waiting for the instance's steps."""
        return not self._fencing

    def fenced_requests(self) -> tuple[int, ...]:
        """A prefill engine keeps no buffer for another engine's writes."""
        return ()

    def work(self) -> list[Message]:
        """Pick up finished calls and settled fences; returns the messages to send."""
        return self.drain() + self._settle()

    def _open_calls(self) -> list[HttpCall]:
        return [job.call for job in list(self._calls.values())]

    def _calls_waiting(self) -> list[tuple[float, int]]:
        """Every prefill call in flight: its answer is one piece, at its end."""
        return [(job.started_s, len(job.msg.prompt_ids)) for job in list(self._calls.values())]

    def held_requests(self) -> tuple[int, ...]:
        """Req ids with a call in flight, or given up on and not yet settled."""
        return tuple(sorted({*self._calls, *self._fencing}))

    def close(self) -> None:
        """Close the calls, stop the threads, remove the fence table."""
        super().close()
        if self._fence is not None:
            self._fence.close()
            with contextlib.suppress(OSError):
                os.unlink(self._fence.path)

    @property
    def read_queue_tokens(self) -> int:
        """Hit tokens of the PE-path prefills in flight (the instance reads them)."""
        return sum(job.hit_tokens for job in list(self._calls.values()))

    def metrics(self) -> dict[str, object]:
        """This worker's counters."""
        # The PE-path reads run inside the vLLM instance (its connector's StorageClient), not
        # in this process: this node's storage-NIC bytes are those of the hit blocks it used
        return {**self.base_metrics(), "num_prefilled": self.num_prefilled,
                "num_hit_tokens": self.num_hit_tokens,
                "num_computed_tokens": self.num_computed_tokens,
                "storage_snic_read_bytes": self.num_store_read_blocks * self.block_bytes}


def error_detail(exc: Exception) -> str:
    """What went wrong, without the instance URL the message already names."""
    return exc.detail if isinstance(exc, VllmHttpError) else f"{type(exc).__name__}: {exc}"


def _first_token(answer: dict[str, Any]) -> tuple[int, int]:
    """(first token, cached prompt tokens) of a completion's JSON."""
    try:
        first = int(answer["choices"][0]["token_ids"][0])
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise RequestError(f"the answer has no token_ids: {str(answer)[:300]}") from exc
    details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
    return first, int(details.get("cached_tokens") or 0)
