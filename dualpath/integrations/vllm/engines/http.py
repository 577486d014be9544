"""A small blocking HTTP client for one vLLM instance's OpenAI server (imports no vLLM).

The engine processes of ``engine_kind = "vllm"`` drive their instance through it
(``integrations/vllm/engines/prefill.py``): ``completions`` (one JSON answer),
``stream_completions`` (server-sent events, ``data: {...}`` lines until ``data: [DONE]``),
``healthy``, ``model_name`` and ``kv_cache_stats`` (vLLM's Prometheus ``/metrics``).

It is built on the standard library's ``http.client``, one connection per call, because a call
must be cancellable from another thread: ``HttpCall.close`` shuts the socket down, which wakes a
thread blocked reading it at once, and vLLM aborts a request whose client went away (its
routes run under ``with_cancellation``). Every failure is a ``VllmHttpError`` that names the
instance's URL; a call closed on purpose raises ``VllmCallClosed``.

An instance an engine started answers ``/v1/...`` only to its key (``VLLM_API_KEY`` in the
instance's environment): a client made with ``api_key`` sends it as ``Authorization: Bearer``
on every call. Each ``HttpCall`` records when its first and latest response bytes arrived
(``first_byte_s``/``last_byte_s``, monotonic seconds, set by the thread reading the response),
so a call that has received nothing tells from one that streams.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from dualpath.errors import DualPathError

PROBE_TIMEOUT_S = 5.0  # /health, /v1/models, /metrics
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


class VllmHttpError(DualPathError):
    """A call to a vLLM instance failed; ``url`` names the instance, ``detail`` what went
    wrong."""

    def __init__(self, url: str, detail: str) -> None:
        super().__init__(f"{url}: {detail}")
        self.url = url
        self.detail = detail


class VllmConnectionError(VllmHttpError):
    """The instance could not be reached, or the connection broke or timed out mid-call."""


class VllmStatusError(VllmHttpError):
    """The instance answered an error (an HTTP status >= 400, or an error event mid-stream)."""

    def __init__(self, url: str, detail: str, status: int | None = None) -> None:
        super().__init__(url, detail)
        self.status = status


class VllmResponseError(VllmHttpError):
    """The instance's answer is not what its API promises (bad JSON, an event stream that
    ended without ``[DONE]``)."""


class VllmCallClosed(VllmHttpError):
    """The call was closed by ``HttpCall.close`` (an abort), not by the instance."""


@dataclass(frozen=True)
class KvCacheStats:
    """An instance's KV cache and queues, from its ``/metrics``."""

    num_blocks: int | None  # vLLM's KV blocks (``vllm:cache_config_info``'s num_gpu_blocks)
    usage_frac: float  # ``vllm:kv_cache_usage_perc`` (a fraction, 0..1)
    num_running: int  # ``vllm:num_requests_running``
    num_waiting: int  # ``vllm:num_requests_waiting``

    @property
    def free_blocks(self) -> int:
        """KV blocks not in use (0 when the block count is unknown)."""
        if not self.num_blocks:
            return 0
        return max(0, round(self.num_blocks * (1.0 - self.usage_frac)))


def parse_kv_cache_stats(text: str) -> KvCacheStats:
    """``KvCacheStats`` from Prometheus exposition text (engines summed; usage averaged)."""
    usage: list[float] = []
    running = waiting = 0.0
    num_blocks: int | None = None
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, raw = match.group(1), match.group(3) or "", match.group(4)
        try:
            value = float(raw)
        except ValueError:
            continue
        if name == "vllm:kv_cache_usage_perc":
            usage.append(value)
        elif name == "vllm:num_requests_running":
            running += value
        elif name == "vllm:num_requests_waiting":
            waiting += value
        elif name == "vllm:cache_config_info":
            blocks = dict(_LABEL.findall(labels)).get("num_gpu_blocks", "")
            if blocks.isdigit():
                num_blocks = (num_blocks or 0) + int(blocks)
    return KvCacheStats(num_blocks, sum(usage) / len(usage) if usage else 0.0, int(running),
                        int(waiting))


class HttpCall:
    """One call's connection: ``close`` (from any thread) cuts it off; the thread running the
    call then raises ``VllmCallClosed``. ``first_byte_s`` and ``last_byte_s``: when its first
    and its latest response bytes arrived (``time.monotonic``; None before any)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._conn: http.client.HTTPConnection | None = None
        self.closed = False
        self.first_byte_s: float | None = None
        self.last_byte_s: float | None = None

    def heard(self) -> None:
        """Response bytes arrived just now (the thread reading the response calls this)."""
        now = time.monotonic()
        if self.first_byte_s is None:
            self.first_byte_s = now
        self.last_byte_s = now

    def attach(self, conn: http.client.HTTPConnection) -> None:
        """The call's connection (closed at once when the call was closed before)."""
        with self._lock:
            self._conn = conn
            if self.closed:
                _shut(conn)

    def close(self) -> None:
        """Cut the connection off (idempotent)."""
        with self._lock:
            self.closed = True
            if self._conn is not None:
                _shut(self._conn)


def _shut(conn: http.client.HTTPConnection) -> None:
    """Shut a connection's socket down (wakes a reader blocked on it), then close it."""
    sock = conn.sock
    if sock is not None:
        with contextlib.suppress(OSError):  # not connected yet, or already down
            sock.shutdown(socket.SHUT_RDWR)
    conn.close()


class CompletionStream:
    """The chunks of a streamed completion, as dicts; iterate, then ``close`` (or use it as a
    context manager). Closing it early aborts the request in vLLM."""

    def __init__(self, client: VllmHttp, body: dict[str, Any], call: HttpCall) -> None:
        self._client, self._call = client, call
        self._conn, self._response = client.open(call, "POST", "/v1/completions", body)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        url = self._client.url
        while True:
            line = self._client.guard(self._call, self._response.readline)
            if not line:
                raise VllmResponseError(url, "the event stream ended without [DONE]")
            self._call.heard()
            text = line.decode("utf-8", "replace").strip()
            if not text.startswith("data:"):
                continue  # blank separators, comments
            data = text[len("data:"):].strip()
            if data == "[DONE]":
                return
            chunk = _json(url, data)
            if "error" in chunk:
                raise VllmStatusError(url, f"error event: {chunk['error']}")
            yield chunk

    def close(self) -> None:
        """Close the connection (idempotent)."""
        self._call.close()

    def __enter__(self) -> CompletionStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class VllmHttp:
    """Blocking calls to the vLLM instance at ``url`` (``http://host:port``)."""

    def __init__(self, url: str, request_timeout_s: float = 600.0,
                 probe_timeout_s: float = PROBE_TIMEOUT_S, api_key: str = "") -> None:
        """``request_timeout_s``: how long a completion call may wait for the instance's next
        bytes; ``probe_timeout_s`` the same for health, model and metrics calls; ``api_key``:
        the instance's key ("" for an instance without one)."""
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"a vLLM instance URL is http://host:port, got {url!r}")
        self.url = url.rstrip("/")
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.host = parts.hostname
        self.port = parts.port or 80
        self.request_timeout_s = request_timeout_s
        self.probe_timeout_s = min(probe_timeout_s, request_timeout_s)

    # -- calls ----------------------------------------------------------------------------------
    def completions(self, body: dict[str, Any], call: HttpCall | None = None) -> dict[str, Any]:
        """POST /v1/completions, not streamed; the answer's JSON. ``call``: a handle another
        thread may close to abort it."""
        call = call or HttpCall()
        conn, response = self.open(call, "POST", "/v1/completions", {**body, "stream": False})
        try:
            text = self.guard(call, response.read).decode("utf-8", "replace")
            call.heard()
            return _json(self.url, text)
        finally:
            conn.close()

    def stream_completions(self, body: dict[str, Any],
                           call: HttpCall | None = None) -> CompletionStream:
        """POST /v1/completions with ``stream: true``; the chunks as they come."""
        return CompletionStream(self, {**body, "stream": True}, call or HttpCall())

    def healthy(self) -> bool:
        """True when GET /health answers 200."""
        try:
            conn, _ = self.open(HttpCall(), "GET", "/health", None, self.probe_timeout_s)
        except VllmHttpError:
            return False
        conn.close()
        return True

    def model_name(self) -> str:
        """The first model id of GET /v1/models (what completions name as ``model``)."""
        answer = _json(self.url, self._get("/v1/models"))
        try:
            return str(answer["data"][0]["id"])
        except (KeyError, IndexError, TypeError) as exc:
            raise VllmResponseError(self.url, f"/v1/models lists no model: {answer}") from exc

    def kv_cache_stats(self) -> KvCacheStats:
        """The instance's KV cache use and queues, from GET /metrics."""
        return parse_kv_cache_stats(self._get("/metrics"))

    # -- plumbing -------------------------------------------------------------------------------
    def _get(self, path: str) -> str:
        call = HttpCall()
        conn, response = self.open(call, "GET", path, None, self.probe_timeout_s)
        try:
            return self.guard(call, response.read).decode("utf-8", "replace")
        finally:
            conn.close()

    def open(self, call: HttpCall, method: str, path: str, body: dict[str, Any] | None,
             timeout_s: float | None = None,
             ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send a request; its connection and response once the status line is in
        (``VllmStatusError`` for a status >= 400, its body in the message)."""
        conn = http.client.HTTPConnection(self.host, self.port,
                                          timeout=timeout_s or self.request_timeout_s)
        call.attach(conn)
        payload = None if body is None else json.dumps(body).encode()
        headers = dict(self._auth)
        if payload is not None:
            headers["Content-Type"] = "application/json"
        response = self.guard(call, lambda: _send(conn, method, path, payload, headers))
        call.heard()  # the status line is in
        if response.status >= 400:
            text = self.guard(call, response.read).decode("utf-8", "replace")[:500]
            conn.close()
            raise VllmStatusError(self.url, f"{method} {path}: HTTP {response.status}: {text}",
                                  response.status)
        return conn, response

    def guard(self, call: HttpCall, action: Any) -> Any:
        """Run ``action()``; its socket-level failures as ``VllmHttpError`` (``VllmCallClosed``
        when the call was closed)."""
        try:
            result = action()
        except (OSError, http.client.HTTPException, ValueError) as exc:
            if call.closed:
                raise VllmCallClosed(self.url, "call closed") from exc
            if isinstance(exc, TimeoutError | socket.timeout):
                raise VllmConnectionError(self.url, "timed out waiting for the instance") from exc
            raise VllmConnectionError(self.url, f"{type(exc).__name__}: {exc}") from exc
        if call.closed:
            raise VllmCallClosed(self.url, "call closed")
        return result


def _send(conn: http.client.HTTPConnection, method: str, path: str, payload: bytes | None,
          headers: dict[str, str]) -> http.client.HTTPResponse:
    conn.request(method, path, body=payload, headers=headers)
    return conn.getresponse()


def _json(url: str, text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise VllmResponseError(url, f"not JSON: {text[:200]!r}") from exc
    if not isinstance(value, dict):
        raise VllmResponseError(url, f"not a JSON object: {text[:200]!r}")
    return value
