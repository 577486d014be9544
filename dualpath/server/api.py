"""The OpenAI-compatible HTTP API (FastAPI) in front of the router.

``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (with and without SSE streaming),
``/health``, ``/version`` and ``/metrics``. Every error is answered in OpenAI's shape with a
4xx status, never a 5xx for bad input: invalid JSON, a missing or mistyped field, an unknown
model, a mode the server does not allow, a prompt longer than the context (the lengths are in
the message), a wrong or missing API key (401), a body over ``max_body_bytes`` (413), more than
``max_concurrent_requests`` generations at once (429). A client that goes away aborts its
request on the engines; so does the server's deadline (``request_timeout_s``: 504, or an error
event in a stream), which frees the request's slot.

Nothing slow runs on the event loop: a body is parsed and tokenized on a worker thread, after
the limits that need no tokenizer (a text over ``max_context × max_token_chars`` characters,
more token ids than the context). With API keys, the key (compared in constant time) covers
``/v1``, ``/metrics`` and the docs; ``/health`` tells anyone whether the cluster serves (503 when
the router thread is dead or stuck or a role has no live engine) and only a client with the
key, or any client of a server without keys, which engines serve; transfer endpoints only to a
client with the key. ``cache_salt`` and, with ``salt_by_api_key``, the presented key salt the
request's block keys, so tenants never learn from ``cached_tokens`` what others sent.

With ``return_token_ids`` a whole response carries ``prompt_token_ids`` and its choice the
generated ``token_ids``; a stream's first chunk carries ``prompt_token_ids`` and every chunk's
choice the ``token_ids`` it adds (a chunk is sent for new tokens even when their text is held
back), so the chunks' ids joined are the whole response's.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import dualpath
from dualpath.config_file import ServeConfig
from dualpath.errors import DualPathError, RequestError
from dualpath.request import SamplingParams
from dualpath.server.api_schema import (
    APIError,
    ChatRequest,
    CompletionRequest,
    ErrorResponse,
    error_body,
)
from dualpath.server.detok import TextStream
from dualpath.server.metrics import RequestTimer, ServeMetrics
from dualpath.server.router import Router
from dualpath.server.router_types import ClusterOutput, RequestAborted
from dualpath.vocab import Mode, Role

# A temperature this close to 0 samples greedily: logits divided by it overflow float32 (at
# 5e-324 the sampler's softmax was all NaN and the request failed on every engine).
GREEDY_BELOW = 1e-5
# A top_p this small keeps only the most likely token (it holds at least 1/vocab of the mass),
# and so does any smaller one; below float32's range (5e-324) the sampler dropped every token.
TOP_P_MIN = 1e-6

# A router thread that cannot answer /health's query this fast is stuck: its loop polls every
# 5 ms, and its own queries wait 10 s (a probe thread of its own, one probe at a time).
HEALTH_TIMEOUT_S = 2.0
DOCS_PATHS = ("/docs", "/redoc", "/openapi.json")  # behind the API key, like /v1 and /metrics

ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 411, 413, 429, 503, 504)}


@dataclass(frozen=True)
class ModelInfo:
    """What the API needs to know of the served model."""

    name: str
    vocab_size: int
    max_context: int  # tokens a request may span: prompt + max_tokens
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    encode_chat: Callable[[list[dict[str, str]]], list[int]]
    # The most characters one token stands for: a text longer than max_context times this is
    # refused before tokenizing. None: unknown (only the body limit bounds the text).
    max_token_chars: int | None = None


@dataclass
class _Prepared:
    prompt_ids: list[int]
    params: SamplingParams
    mode: str | None
    read_path: str | None
    cache_salt: str = ""


def build_app(router: Router, model: ModelInfo, settings: ServeConfig,
              metrics: ServeMetrics) -> FastAPI:
    """The FastAPI application serving ``model`` through ``router``."""
    app = FastAPI(title="dualpath", version=dualpath.__version__,
                  description="OpenAI-compatible API of a DualPath PD-disaggregated cluster")
    gate = _Gate(settings.max_concurrent_requests)
    keys = _Keys(settings)
    policy = _Policy(settings, router.config.mode)
    probe = _HealthProbe(router)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    _install_errors(app)
    _install_limits(app, settings, keys)

    @app.get("/health", responses={503: ERRORS[503]})
    async def health(request: Request) -> JSONResponse:
        problem, engines = await probe.check()
        detailed = keys.open or keys.match(request) is not None
        if problem is not None:
            body = error_body(problem if detailed else "the cluster is not ready",
                              "service_unavailable")
            if detailed and engines:  # which engines are still in, beside what is missing
                body["engines"] = _shown(engines, keys.open)
            return JSONResponse(body, status_code=503)
        if not detailed:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "ok", "engines": _shown(engines, keys.open)})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": dualpath.__version__}

    @app.get("/metrics", responses={401: ERRORS[401]})
    async def prometheus() -> Response:
        body = await asyncio.to_thread(metrics.render)
        return PlainTextResponse(body, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", responses={401: ERRORS[401]})
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model.name, "object": "model",
                                            "created": 0, "owned_by": "dualpath"}]}

    @app.post("/v1/completions", responses=ERRORS)
    async def completions(request: Request) -> Response:
        body, prepared = await _read(request, _prepare_completion, model, policy, keys)
        return await _generate(router, model, metrics, gate, body, prepared, request, "text",
                               settings.request_timeout_s)

    @app.post("/v1/chat/completions", responses=ERRORS)
    async def chat(request: Request) -> Response:
        body, prepared = await _read(request, _prepare_chat, model, policy, keys)
        return await _generate(router, model, metrics, gate, body, prepared, request, "chat",
                               settings.request_timeout_s)

    return app


# -- who may ask what ---------------------------------------------------------------------------


class _Keys:
    """The server's API keys (none: an open server) and which one a request presents."""

    def __init__(self, settings: ServeConfig) -> None:
        keys = (settings.api_key, *settings.api_keys) if settings.api_key else settings.api_keys
        self.keys = tuple(k.encode() for k in keys)

    @property
    def open(self) -> bool:
        """True when the server has no key."""
        return not self.keys

    def match(self, request: Request) -> bytes | None:
        """The key in ``Authorization: Bearer KEY``, if it is one of the server's; compared in
        constant time against every key (a timing difference tells no prefix)."""
        auth = request.headers.get("authorization", "")
        token = auth.removeprefix("Bearer ").encode("latin-1") if auth.startswith(
            "Bearer ") else b""  # headers arrive as latin-1: these are the bytes sent
        found = None
        for key in self.keys:
            if hmac.compare_digest(token, key):
                found = key
        return found


class _Policy:
    """What a request may ask of the cluster: a mode the operator allows, a salt of its own."""

    def __init__(self, settings: ServeConfig, cluster_mode: str) -> None:
        self.modes = settings.allowed_modes or tuple(dict.fromkeys((Mode.DUALPATH,
                                                                    Mode(cluster_mode))))
        self.salt_by_key = settings.salt_by_api_key
        self.default_max_tokens = settings.default_max_tokens

    def mode(self, mode: Mode | None) -> str | None:
        """``mode`` if the server allows it (None: the cluster's own); else a 400."""
        if mode is not None and mode not in self.modes:
            raise APIError(400, f"the mode {str(mode)!r} is not allowed on this server; "
                           f"allowed: {', '.join(self.modes)}", param="dualpath.mode",
                           code="mode_not_allowed")
        return mode and str(mode)

    def salt(self, cache_salt: str | None, key: bytes | None) -> str:
        """The request's cache salt: the client's, behind one derived from its API key when
        ``salt_by_api_key`` (an HMAC: the key itself never reaches the engines or the store)."""
        if not (self.salt_by_key and key):
            return cache_salt or ""
        tenant = hmac.new(key, b"dualpath cache salt", hashlib.sha256).hexdigest()[:32]
        return f"{tenant}:{cache_salt or ''}"


# -- requests -> engine inputs ------------------------------------------------------------------


async def _read(request: Request, prepare: Callable[..., tuple[Any, _Prepared]],
                model: ModelInfo, policy: _Policy, keys: _Keys) -> tuple[Any, _Prepared]:
    """The body parsed and tokenized on a worker thread. On the event loop a 1 MiB prompt
    held every other request 0.6-0.9 s (SmolLM2's tokenizer); now it is refused untokenized in
    10-20 ms, and a 600 K-character one is tokenized in 0.4 s while /health answers within
    20 ms."""
    raw = await request.body()
    return await asyncio.to_thread(prepare, raw, request.headers.get("content-type"), model,
                                   policy, keys.match(request))


def _parse(cls: type[CompletionRequest] | type[ChatRequest], raw: bytes,
           content_type: str | None) -> Any:
    """The body as ``cls``, or FastAPI's errors (the 400s of ``_install_errors``)."""
    kind = (content_type or "").partition(";")[0].strip().lower()
    if not (kind == "application/json" or (kind.startswith("application/")
                                           and kind.endswith("+json"))):
        raise APIError(400, "the request body must be JSON (Content-Type: application/json)")
    try:
        data = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
        raise APIError(400, "the request body is not valid JSON") from exc
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from exc


def _prepare_completion(raw: bytes, content_type: str | None, model: ModelInfo,
                        policy: _Policy, key: bytes | None) -> tuple[CompletionRequest, _Prepared]:
    body = _parse(CompletionRequest, raw, content_type)
    _check_model(body.model, model)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
        if len(prompt) != 1:
            raise APIError(400, "one prompt per request (n=1): send prompts separately",
                           param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        _check_chars(len(prompt), model, "prompt")
        try:
            ids = model.encode(prompt)
        except Exception as exc:  # the tokenizer refused the text (e.g. a lone surrogate)
            raise APIError(400, f"the prompt cannot be tokenized: {type(exc).__name__}",
                           param="prompt") from exc
    else:
        ids = list(prompt)  # type: ignore[arg-type]
    return body, _prepared(body, ids, body.max_tokens, model, policy, key)


def _prepare_chat(raw: bytes, content_type: str | None, model: ModelInfo, policy: _Policy,
                  key: bytes | None) -> tuple[ChatRequest, _Prepared]:
    body = _parse(ChatRequest, raw, content_type)
    _check_model(body.model, model)
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    _check_chars(sum(len(m["content"]) for m in messages), model, "messages")
    try:
        ids = model.encode_chat(messages)
    except Exception as exc:  # the chat template refused the conversation
        raise APIError(400, f"the chat template cannot render these messages: {exc}",
                       param="messages") from exc
    max_tokens = body.max_completion_tokens or body.max_tokens
    return body, _prepared(body, ids, max_tokens, model, policy, key)


def _check_chars(chars: int, model: ModelInfo, param: str) -> None:
    """A text of more characters than the context's tokens can span: refused untokenized."""
    if model.max_token_chars is not None and chars > model.max_context * model.max_token_chars:
        raise APIError(400, f"this model's maximum context length is {model.max_context} "
                       f"tokens; the {param} has {chars} characters, more than that many "
                       f"tokens can hold", param=param, code="context_length_exceeded")


def _prepared(body: CompletionRequest | ChatRequest, ids: list[int], max_tokens: int | None,
              model: ModelInfo, policy: _Policy, key: bytes | None) -> _Prepared:
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    room = model.max_context - len(ids)
    if room < 1:
        raise APIError(400, f"this model's maximum context length is {model.max_context} "
                       f"tokens; the prompt has {len(ids)} tokens", param="prompt",
                       code="context_length_exceeded")
    if any(not 0 <= t < model.vocab_size for t in ids):
        raise APIError(400, f"token ids must be in [0, {model.vocab_size})", param="prompt")
    if max_tokens is None:
        max_tokens = min(policy.default_max_tokens, room)
    if max_tokens > room:
        raise APIError(400, f"this model's maximum context length is {model.max_context} "
                       f"tokens; the request has {len(ids)} prompt tokens and asks for "
                       f"{max_tokens} completion tokens", param="max_tokens",
                       code="context_length_exceeded")
    try:
        temperature = body.temperature if body.temperature >= GREEDY_BELOW else 0.0
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                top_p=max(body.top_p, TOP_P_MIN), seed=body.seed,
                                stop=body.stop_strings(), ignore_eos=body.ignore_eos,
                                min_tokens=min(body.min_tokens, max_tokens))
    except RequestError as exc:
        raise APIError(400, str(exc)) from exc
    options = body.dualpath
    return _Prepared(ids, params, policy.mode(options and options.mode),
                     options and options.read_path and str(options.read_path),
                     policy.salt(body.cache_salt, key))


def _check_model(name: str, model: ModelInfo) -> None:
    if name != model.name:
        raise APIError(404, f"the model {name!r} does not exist; this server serves "
                       f"{model.name!r}", param="model", code="model_not_found")


# -- health -------------------------------------------------------------------------------------


def _shown(engines: list[dict[str, Any]], unauthenticated: bool) -> list[dict[str, Any]]:
    """The engines as /health shows them: no transfer endpoint to an unauthenticated client."""
    if not unauthenticated:
        return engines
    return [{k: v for k, v in e.items() if k != "endpoint"} for e in engines]


class _HealthProbe:
    """Whether the cluster serves: the router thread runs and answers, and every role has an
    engine heard from within the engine timeout. The router's queries block (10 s on a stuck
    thread), so they run on a thread of their own, one at a time, and /health waits at most
    ``HEALTH_TIMEOUT_S`` for them."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="health")
        self._asking: asyncio.Future[dict[str, float]] | None = None

    async def check(self) -> tuple[str | None, list[dict[str, Any]]]:
        """What keeps the cluster from serving (None: nothing), and its engines."""
        if not self.router.alive:
            return "the router thread is not running", []
        if self._asking is None or self._asking.done():
            self._asking = asyncio.get_running_loop().run_in_executor(
                self._pool, self.router.heartbeat_ages)
            self._asking.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            ages = await asyncio.wait_for(asyncio.shield(self._asking), HEALTH_TIMEOUT_S)
        except Exception:  # TimeoutError: stuck; or the router stopped meanwhile
            return f"the router thread does not answer within {HEALTH_TIMEOUT_S:g} s", []
        timeout_s = self.router.config.engine_timeout_s
        engines = sorted(({"name": e.name, "role": e.role, "node_id": e.node_id,
                           "endpoint": e.endpoint, "heartbeat_age_s": round(ages[e.name], 3)}
                          for e in self.router.engines.values() if e.name in ages),
                         key=lambda e: e["name"])
        live = {e["role"] for e in engines if e["heartbeat_age_s"] < timeout_s}
        missing = [role for role in Role if role not in live]
        if missing:
            return f"no live {' or '.join(missing)} engine", engines
        return None, engines


# -- generation ---------------------------------------------------------------------------------


class _Gate:
    """At most ``limit`` generations at once; the rest get 429."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = 0

    def enter(self) -> None:
        if self.active >= self.limit:
            raise APIError(429, f"more than {self.limit} requests at once; retry later",
                           kind="rate_limit_error")
        self.active += 1

    def leave(self) -> None:
        self.active -= 1


class _Run:
    """One request on the cluster, bridged from the router thread into the event loop; past
    ``timeout_s`` it is aborted on the engines and ends ``timed_out``."""

    def __init__(self, router: Router, prepared: _Prepared, metrics: ServeMetrics,
                 timeout_s: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, ...] | None] = asyncio.Queue()
        self.timer = RequestTimer(metrics)
        self.router = router
        self.timeout_s = timeout_s
        self.deadline_s = time.monotonic() + timeout_s
        self.timed_out = False
        self.future = router.submit(prepared.prompt_ids, prepared.params, prepared.mode,
                                    prepared.read_path, on_tokens=self._tokens,
                                    cache_salt=prepared.cache_salt)
        self.future.add_done_callback(lambda _: self.loop.call_soon_threadsafe(
            self.queue.put_nowait, None))

    def _tokens(self, tokens: tuple[int, ...]) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, tokens)

    async def chunks(self) -> AsyncIterator[tuple[int, ...]]:
        """New tokens as they come, until the request ends or its deadline passes."""
        while True:
            try:
                tokens = await asyncio.wait_for(self.queue.get(),
                                                max(0.0, self.deadline_s - time.monotonic()))
            except TimeoutError:
                self._expire()
                return
            if tokens is None:
                return
            self.timer.tokens(len(tokens))
            yield tokens

    def _expire(self) -> None:
        if self.future.done():  # it ended just now: its result stands
            return
        self.timed_out = True
        self.timer.metrics.requests.labels("timed_out").inc()
        self.router.abort(self.future.req_id,
                          f"past the server's deadline of {self.timeout_s:g} s")

    def abort(self) -> None:
        if not self.future.done() and not self.timed_out:
            self.timer.metrics.requests.labels("aborted").inc()
            self.router.abort(self.future.req_id, "the client went away")

    async def wait(self, request: Request) -> bool:
        """Wait until the request ends (True); abort it if the client goes away first (False).

        A handler that is not streaming is not cancelled when its client disconnects, so
        the ASGI ``http.disconnect`` message is watched for beside the tokens.
        """
        async def drain() -> None:
            async for _ in self.chunks():
                pass

        async def gone() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        ended, left = asyncio.ensure_future(drain()), asyncio.ensure_future(gone())
        try:
            await asyncio.wait((ended, left), return_when=asyncio.FIRST_COMPLETED)
            if left.done() and left.exception() is not None:  # cannot watch: just wait
                await ended
        finally:
            ended.cancel()
            left.cancel()
        if ended.done() and not ended.cancelled():
            return True
        self.abort()
        return False


async def _generate(router: Router, model: ModelInfo, metrics: ServeMetrics, gate: _Gate,
                    body: CompletionRequest | ChatRequest, prepared: _Prepared,
                    request: Request, kind: str, timeout_s: float) -> Response:
    if not (router.alive and router.ready):
        raise APIError(503, "the cluster is not ready", kind="service_unavailable")
    gate.enter()
    try:
        run = _Run(router, prepared, metrics, timeout_s)
    except (DualPathError, ValueError) as exc:
        gate.leave()
        raise APIError(400, str(exc)) from exc
    reply = _Reply(kind, model, body, prepared, run)
    if body.stream:
        return StreamingResponse(_stream(reply, metrics, gate), media_type="text/event-stream")
    try:
        if not await run.wait(request):
            return Response(status_code=499)  # "client closed request": nobody reads it
        output = _result(run)
        metrics_done(metrics, run, output)
        return JSONResponse(reply.whole(output))
    except asyncio.CancelledError:  # the server is stopping
        run.abort()
        raise
    finally:
        gate.leave()


async def _stream(reply: _Reply, metrics: ServeMetrics, gate: _Gate) -> AsyncIterator[str]:
    run = reply.run
    try:
        yield _sse(reply.chunk(role=True))
        async for tokens in run.chunks():
            delta = reply.text.add(tokens)
            if delta or reply.return_ids:
                yield _sse(reply.chunk(delta, token_ids=tokens))
        try:
            output = _result(run)
        except APIError as exc:
            yield _sse(exc.body())
            yield "data: [DONE]\n\n"
            return
        metrics_done(metrics, run, output)
        tail = reply.text.finish(output.output_ids)
        yield _sse(reply.chunk(tail, finish_reason=output.finish_reason,
                               token_ids=output.output_ids[reply.ids_sent:]))
        if reply.include_usage:
            yield _sse(reply.usage_chunk(output))
        yield "data: [DONE]\n\n"
    finally:  # normal end, or the client went away (the generator is closed)
        run.abort()
        gate.leave()


def _result(run: _Run) -> ClusterOutput:
    if run.timed_out:
        raise APIError(504, f"the request did not finish within the server's deadline of "
                       f"{run.timeout_s:g} s; it was aborted", kind="timeout_error",
                       code="request_timeout")
    try:
        return run.future.result(0)
    except RequestAborted as exc:
        run.timer.metrics.requests.labels("aborted").inc()
        raise APIError(400, f"the request was aborted: {exc}") from exc
    except RequestError as exc:
        run.timer.metrics.requests.labels("rejected").inc()
        raise APIError(400, str(exc)) from exc
    except DualPathError as exc:
        run.timer.metrics.requests.labels("failed").inc()
        raise APIError(503, f"the cluster could not finish the request: {exc}",
                       kind="service_unavailable") from exc


def metrics_done(metrics: ServeMetrics, run: _Run, output: ClusterOutput) -> None:
    """Count a finished request."""
    run.timer.done()
    metrics.requests.labels("finished").inc()
    metrics.prompt_tokens.inc(len(output.prompt_ids))
    metrics.cached_tokens.inc(output.num_hit_tokens)
    metrics.computed_tokens.inc(output.num_computed_tokens)
    metrics.generation_tokens.inc(len(output.output_ids))
    metrics.read_paths.labels(str(output.read_path)).inc()


class _Reply:
    """OpenAI response objects for one request (completion or chat, whole or chunked)."""

    def __init__(self, kind: str, model: ModelInfo, body: CompletionRequest | ChatRequest,
                 prepared: _Prepared, run: _Run) -> None:
        self.kind = kind
        self.model = model
        self.run = run
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.text = TextStream(model.decode, prepared.params.stop)
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.return_ids = body.return_token_ids
        self.prompt_ids = prepared.prompt_ids
        self.ids_sent = 0  # generated ids a stream has handed on

    def _object(self, chunk: bool) -> str:
        base = "chat.completion" if self.kind == "chat" else "text_completion"
        return base + ".chunk" if chunk and self.kind == "chat" else base

    def _envelope(self, chunk: bool, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": self._object(chunk), "created": self.created,
                "model": self.model.name, "choices": choices}

    def whole(self, output: ClusterOutput) -> dict[str, Any]:
        text = self.text.finish(output.output_ids)
        if self.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant",
                                                              "content": text}}
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
        choice["finish_reason"] = output.finish_reason
        reply = self._envelope(False, [choice])
        if self.return_ids:
            choice["token_ids"] = list(output.output_ids)
            reply["prompt_token_ids"] = list(output.prompt_ids)
        return {**reply, "usage": _usage(output)}

    def chunk(self, text: str = "", role: bool = False, finish_reason: str | None = None,
              token_ids: tuple[int, ...] | list[int] = ()) -> dict[str, Any]:
        """One SSE chunk; with ``return_token_ids`` its choice carries ``token_ids`` (the
        role chunk: none, and the envelope ``prompt_token_ids``)."""
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else (
                {"content": text} if text else {})
            choice: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
        choice["finish_reason"] = finish_reason
        chunk = self._envelope(True, [choice])
        if self.return_ids:
            choice["token_ids"] = list(token_ids)
            self.ids_sent += len(token_ids)
            if role:
                chunk["prompt_token_ids"] = list(self.prompt_ids)
        return chunk

    def usage_chunk(self, output: ClusterOutput) -> dict[str, Any]:
        return {**self._envelope(True, []), "usage": _usage(output)}


def _usage(output: ClusterOutput) -> dict[str, Any]:
    prompt, completion = len(output.prompt_ids), len(output.output_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": output.num_hit_tokens}}


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


# -- errors and limits --------------------------------------------------------------------------


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document, true to the handlers: validation errors are 400s in OpenAI's shape
    (documented through ``ERRORS``), never FastAPI's 422; the request bodies the handlers
    parse themselves (off the event loop) are documented from their models."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version,
                             description=app.description, routes=app.routes)
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, cls in (("/v1/completions", CompletionRequest),
                          ("/v1/chat/completions", ChatRequest)):
            doc = cls.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(doc.pop("$defs", {}))
            components[cls.__name__] = doc
            schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{cls.__name__}"}}}}
        app.openapi_schema = schema
    return app.openapi_schema


def _install_errors(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return JSONResponse(error_body("the request body is not valid JSON"),
                                status_code=400)
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else str(
            first.get("msg", "invalid request body"))
        return JSONResponse(error_body(message, param=where or None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail)), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}",
                                       "internal_error"), status_code=500)


def _install_limits(app: FastAPI, settings: ServeConfig, keys: _Keys) -> None:
    @app.middleware("http")
    async def limits(request: Request, call_next: Callable) -> Response:
        path = request.url.path
        guarded = path.startswith(("/v1/", *DOCS_PATHS)) or path == "/metrics"
        if guarded and not keys.open and keys.match(request) is None:
            return JSONResponse(error_body("incorrect or missing API key",
                                           code="invalid_api_key"), status_code=401)
        if path.startswith("/v1/"):
            length = request.headers.get("content-length")
            if request.method == "POST" and length is None:
                return JSONResponse(error_body("a Content-Length header is required"),
                                    status_code=411)
            if length is not None and (not length.isdigit()
                                       or int(length) > settings.max_body_bytes):
                return JSONResponse(error_body(f"the request body is over "
                                               f"{settings.max_body_bytes} bytes"),
                                    status_code=413)
        return await call_next(request)
