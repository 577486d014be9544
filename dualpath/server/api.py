"""The OpenAI-compatible HTTP API (FastAPI) in front of the router.

``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (with and without SSE streaming),
``/health`` (503 until the cluster is ready; then the registered engines), ``/version`` and
``/metrics``. Every error is answered in OpenAI's shape with a 4xx status, never a 5xx for
bad input: invalid JSON, a missing or mistyped field, an unknown model, a prompt longer than
the context (the lengths are in the message), a wrong or missing API key (401), a body over
``max_body_bytes`` (413), more than ``max_concurrent_requests`` generations at once (429). A
client that goes away aborts its request on the engines.

With ``return_token_ids`` a whole response carries ``prompt_token_ids`` and its choice the
generated ``token_ids``; a stream's first chunk carries ``prompt_token_ids`` and every chunk's
choice the ``token_ids`` it adds (a chunk is sent for new tokens even when their text is held
back), so the chunks' ids joined are the whole response's.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
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

# A temperature this close to 0 samples greedily: logits divided by it overflow float32 (at
# 5e-324 the sampler's softmax was all NaN and the request failed on every engine).
GREEDY_BELOW = 1e-5
# A top_p this small keeps only the most likely token (it holds at least 1/vocab of the mass),
# and so does any smaller one; below float32's range (5e-324) the sampler dropped every token.
TOP_P_MIN = 1e-6

ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 411, 413, 429, 503)}


@dataclass(frozen=True)
class ModelInfo:
    """What the API needs to know of the served model."""

    name: str
    vocab_size: int
    max_context: int  # tokens a request may span: prompt + max_tokens
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    encode_chat: Callable[[list[dict[str, str]]], list[int]]


@dataclass
class _Prepared:
    prompt_ids: list[int]
    params: SamplingParams
    mode: str | None
    read_path: str | None


def build_app(router: Router, model: ModelInfo, settings: ServeConfig,
              metrics: ServeMetrics) -> FastAPI:
    """The FastAPI application serving ``model`` through ``router``."""
    app = FastAPI(title="dualpath", version=dualpath.__version__,
                  description="OpenAI-compatible API of a DualPath PD-disaggregated cluster")
    gate = _Gate(settings.max_concurrent_requests)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    _install_errors(app)
    _install_limits(app, settings)

    @app.get("/health", responses={503: ERRORS[503]})
    async def health() -> JSONResponse:
        if not router.ready:
            return JSONResponse(error_body("the cluster is not ready", "service_unavailable"),
                                status_code=503)
        engines = [{"name": e.name, "role": e.role, "node_id": e.node_id,
                    "endpoint": e.endpoint} for e in router.engines.values()]
        return JSONResponse({"status": "ok", "engines": sorted(engines,
                                                               key=lambda e: e["name"])})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": dualpath.__version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        body = await asyncio.to_thread(metrics.render)
        return PlainTextResponse(body, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", responses={401: ERRORS[401]})
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model.name, "object": "model",
                                            "created": 0, "owned_by": "dualpath"}]}

    @app.post("/v1/completions", responses=ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        prepared = _prepare_completion(body, model, settings)
        return await _generate(router, model, metrics, gate, body, prepared, request, "text")

    @app.post("/v1/chat/completions", responses=ERRORS)
    async def chat(body: ChatRequest, request: Request) -> Response:
        prepared = _prepare_chat(body, model, settings)
        return await _generate(router, model, metrics, gate, body, prepared, request, "chat")

    return app


# -- requests -> engine inputs ------------------------------------------------------------------


def _prepare_completion(body: CompletionRequest, model: ModelInfo,
                        settings: ServeConfig) -> _Prepared:
    _check_model(body.model, model)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
        if len(prompt) != 1:
            raise APIError(400, "one prompt per request (n=1): send prompts separately",
                           param="prompt")
        prompt = prompt[0]
    try:
        ids = model.encode(prompt) if isinstance(prompt, str) else list(prompt)  # type: ignore[arg-type]
    except Exception as exc:  # the tokenizer refused the text (e.g. a lone surrogate)
        raise APIError(400, f"the prompt cannot be tokenized: {type(exc).__name__}",
                       param="prompt") from exc
    return _prepared(body, ids, body.max_tokens, model, settings)


def _prepare_chat(body: ChatRequest, model: ModelInfo, settings: ServeConfig) -> _Prepared:
    _check_model(body.model, model)
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        ids = model.encode_chat(messages)
    except Exception as exc:  # the chat template refused the conversation
        raise APIError(400, f"the chat template cannot render these messages: {exc}",
                       param="messages") from exc
    max_tokens = body.max_completion_tokens or body.max_tokens
    return _prepared(body, ids, max_tokens, model, settings)


def _prepared(body: CompletionRequest | ChatRequest, ids: list[int], max_tokens: int | None,
              model: ModelInfo, settings: ServeConfig) -> _Prepared:
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    if any(not 0 <= t < model.vocab_size for t in ids):
        raise APIError(400, f"token ids must be in [0, {model.vocab_size})", param="prompt")
    room = model.max_context - len(ids)
    if max_tokens is None:
        max_tokens = min(settings.default_max_tokens, room)
    if room < 1 or max_tokens > room:
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
    return _Prepared(ids, params, options and options.mode and str(options.mode),
                     options and options.read_path and str(options.read_path))


def _check_model(name: str, model: ModelInfo) -> None:
    if name != model.name:
        raise APIError(404, f"the model {name!r} does not exist; this server serves "
                       f"{model.name!r}", param="model", code="model_not_found")


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
    """One request on the cluster, bridged from the router thread into the event loop."""

    def __init__(self, router: Router, prepared: _Prepared, metrics: ServeMetrics) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, ...] | None] = asyncio.Queue()
        self.timer = RequestTimer(metrics)
        self.router = router
        self.future = router.submit(prepared.prompt_ids, prepared.params, prepared.mode,
                                    prepared.read_path, on_tokens=self._tokens)
        self.future.add_done_callback(lambda _: self.loop.call_soon_threadsafe(
            self.queue.put_nowait, None))

    def _tokens(self, tokens: tuple[int, ...]) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, tokens)

    async def chunks(self) -> AsyncIterator[tuple[int, ...]]:
        """New tokens as they come, until the request ends."""
        while (tokens := await self.queue.get()) is not None:
            self.timer.tokens(len(tokens))
            yield tokens

    def abort(self) -> None:
        if not self.future.done():
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
                    request: Request, kind: str) -> Response:
    if not router.ready:
        raise APIError(503, "the cluster is not ready", kind="service_unavailable")
    gate.enter()
    try:
        run = _Run(router, prepared, metrics)
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
    (documented through ``ERRORS``), never FastAPI's 422."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version,
                             description=app.description, routes=app.routes)
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
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


def _install_limits(app: FastAPI, settings: ServeConfig) -> None:
    @app.middleware("http")
    async def limits(request: Request, call_next: Callable) -> Response:
        if request.url.path.startswith("/v1/"):
            if settings.api_key is not None:
                auth = request.headers.get("authorization", "")
                if auth != f"Bearer {settings.api_key}":
                    return JSONResponse(error_body("incorrect or missing API key",
                                                   code="invalid_api_key"), status_code=401)
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
