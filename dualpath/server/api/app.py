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
request's block keys, so tenants never learn from ``cached_tokens`` what others sent. A session
id (``X-Session-ID``, ``x-dynamo-session-id`` or the body's ``session_id``) and an
``agent_hint`` are checked (400 for ids that disagree, bad hints, a hint without a session) and
counted in ``/metrics``.

With ``return_token_ids`` a whole response carries ``prompt_token_ids`` and its choice the
generated ``token_ids``; a stream's first chunk carries ``prompt_token_ids`` and every chunk's
choice the ``token_ids`` it adds (a chunk is sent for new tokens even when their text is held
back), so the chunks' ids joined are the whole response's.

This module builds the app and its error handlers and limits; ``api/access.py`` holds the keys
and what a request may choose, ``api/requests.py`` parsing and validation, ``api/health.py``
``/health``'s probe, ``api/generate.py`` the generation, whole or streamed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import dualpath
from dualpath.config_file import ServeConfig
from dualpath.server.api.access import Keys, Policy
from dualpath.server.api.generate import Gate, generate
from dualpath.server.api.health import HealthProbe, shown
from dualpath.server.api.requests import ModelInfo, prepare_chat, prepare_completion, read
from dualpath.server.api.schema import (
    APIError,
    ChatRequest,
    CompletionRequest,
    ErrorResponse,
    error_body,
)
from dualpath.server.metrics import ServeMetrics
from dualpath.server.router.client import Router
from dualpath.sessions import MAX_SESSION_ID_CHARS, SESSION_ID

DOCS_PATHS = ("/docs", "/redoc", "/openapi.json")  # behind the API key, like /v1 and /metrics
SESSION_PARAMETERS = [  # the headers RL frameworks pin a trajectory with (or body session_id)
    {"name": name, "in": "header", "required": False,
     "description": f"the agent session this request continues ({who}); the same as the "
                    "body's session_id", "schema": {"type": "string", "pattern": SESSION_ID.pattern,
                                                    "maxLength": MAX_SESSION_ID_CHARS}}
    for name, who in (("X-Session-ID", "SkyRL's header"), ("x-dynamo-session-id", "Dynamo's"))]

ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 411, 413, 429, 503, 504)}


def build_app(router: Router, model: ModelInfo, settings: ServeConfig,
              metrics: ServeMetrics) -> FastAPI:
    """The FastAPI application serving ``model`` through ``router``."""
    app = FastAPI(title="dualpath", version=dualpath.__version__,
                  description="OpenAI-compatible API of a DualPath PD-disaggregated cluster")
    gate = Gate(settings.max_concurrent_requests)
    keys = Keys(settings)
    policy = Policy(settings, router.config.mode)
    probe = HealthProbe(router)
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
                body["engines"] = shown(engines, keys.open)
            return JSONResponse(body, status_code=503)
        if not detailed:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "ok", "engines": shown(engines, keys.open)})

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
        body, prepared = await read(request, prepare_completion, model, policy, keys)
        return await generate(router, model, metrics, gate, body, prepared, request, "text",
                              settings.request_timeout_s)

    @app.post("/v1/chat/completions", responses=ERRORS)
    async def chat(request: Request) -> Response:
        body, prepared = await read(request, prepare_chat, model, policy, keys)
        return await generate(router, model, metrics, gate, body, prepared, request, "chat",
                              settings.request_timeout_s)

    return app


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
            schema["paths"][path]["post"]["parameters"] = SESSION_PARAMETERS
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


def _install_limits(app: FastAPI, settings: ServeConfig, keys: Keys) -> None:
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
