"""HTTP requests -> engine inputs: the body parsed, validated against the model and the limits,
and tokenized, on a worker thread (never on the event loop).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from dualpath.errors import RequestError
from dualpath.request import SamplingParams
from dualpath.server.api.access import Keys, Policy
from dualpath.server.api.schema import APIError, ChatRequest, CompletionRequest
from dualpath.sessions import SESSION_HEADERS, Session, session_of

# A temperature this close to 0 samples greedily: logits divided by it overflow float32 (at
# 5e-324 the sampler's softmax was all NaN and the request failed on every engine).
GREEDY_BELOW = 1e-5
# A top_p this small keeps only the most likely token (it holds at least 1/vocab of the mass),
# and so does any smaller one; below float32's range (5e-324) the sampler dropped every token.
TOP_P_MIN = 1e-6


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
class Prepared:
    prompt_ids: list[int]
    params: SamplingParams
    mode: str | None
    read_path: str | None
    cache_salt: str = ""
    session: Session | None = None  # the agent session it continues, with the harness's hint


async def read(request: Request, prepare: Callable[..., tuple[Any, Prepared]],
               model: ModelInfo, policy: Policy, keys: Keys) -> tuple[Any, Prepared]:
    """The body parsed and tokenized on a worker thread. On the event loop a 1 MiB prompt
    held every other request 0.6-0.9 s (SmolLM2's tokenizer); now it is refused untokenized in
    10-20 ms, and a 600 K-character one is tokenized in 0.4 s while /health answers within
    20 ms."""
    raw = await request.body()
    body, prepared = await asyncio.to_thread(prepare, raw, request.headers.get("content-type"),
                                             model, policy, keys.match(request))
    prepared.session = _session(request, body)
    return body, prepared


def _session(request: Request, body: CompletionRequest | ChatRequest) -> Session | None:
    """The request's session from its headers and body (``dualpath/sessions.py``)."""
    headers = {name: request.headers[name] for name in SESSION_HEADERS
               if name in request.headers}
    hint = body.agent_hint.hint() if body.agent_hint is not None else None
    try:
        return session_of(headers, body.session_id, hint)
    except RequestError as exc:
        param = "session_id" if body.session_id is not None or headers else "agent_hint"
        raise APIError(400, str(exc), param=param) from exc


def _parse(cls: type[CompletionRequest] | type[ChatRequest], raw: bytes,
           content_type: str | None) -> Any:
    """The body as ``cls``, or FastAPI's errors (the 400s of ``api._install_errors``)."""
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


def prepare_completion(raw: bytes, content_type: str | None, model: ModelInfo,
                       policy: Policy, key: bytes | None) -> tuple[CompletionRequest, Prepared]:
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


def prepare_chat(raw: bytes, content_type: str | None, model: ModelInfo, policy: Policy,
                 key: bytes | None) -> tuple[ChatRequest, Prepared]:
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
              model: ModelInfo, policy: Policy, key: bytes | None) -> Prepared:
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
    return Prepared(ids, params, policy.mode(options and options.mode),
                    options and options.read_path and str(options.read_path),
                    policy.salt(body.cache_salt, key))


def _check_model(name: str, model: ModelInfo) -> None:
    if name != model.name:
        raise APIError(404, f"the model {name!r} does not exist; this server serves "
                       f"{model.name!r}", param="model", code="model_not_found")
