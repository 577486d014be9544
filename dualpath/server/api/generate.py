"""One generation on the cluster, bridged from the router thread into the event loop: the
concurrency gate, the deadline, the whole or streamed (SSE) OpenAI reply, and the metrics.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from dualpath.errors import DualPathError, RequestError
from dualpath.server.api.requests import ModelInfo, Prepared
from dualpath.server.api.schema import APIError, ChatRequest, CompletionRequest
from dualpath.server.detok import TextStream
from dualpath.server.metrics import RequestTimer, ServeMetrics
from dualpath.server.router.client import Router
from dualpath.server.router.types import ClusterOutput, RequestAborted


class Gate:
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

    def __init__(self, router: Router, prepared: Prepared, metrics: ServeMetrics,
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
                                    cache_salt=prepared.cache_salt, session=prepared.session)
        metrics.count_session(prepared.session)
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


async def generate(router: Router, model: ModelInfo, metrics: ServeMetrics, gate: Gate,
                   body: CompletionRequest | ChatRequest, prepared: Prepared,
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


async def _stream(reply: _Reply, metrics: ServeMetrics, gate: Gate) -> AsyncIterator[str]:
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
    metrics.observe_stages(output.timings, run.timer.ttft_s)


class _Reply:
    """OpenAI response objects for one request (completion or chat, whole or chunked)."""

    def __init__(self, kind: str, model: ModelInfo, body: CompletionRequest | ChatRequest,
                 prepared: Prepared, run: _Run) -> None:
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
