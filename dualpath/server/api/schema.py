"""The OpenAI-compatible request bodies (pydantic) and the OpenAI error shape.

Fields the OpenAI API defines and dualpath ignores (``user``, ``logprobs: false`` …) are
accepted and ignored, as vLLM does; fields it cannot honour (``n`` > 1, ``logprobs``) are
refused with 400. Extensions for trace replay and ablations: ``ignore_eos``, ``min_tokens``,
``return_token_ids`` (vLLM's name: the prompt and generated token ids come back with the text),
``cache_salt`` (vLLM's name: a request hits only prefixes stored under the same salt), a
``dualpath`` object (``mode``, ``read_path``; the server decides which modes are allowed), and
for agents ``session_id`` and ``agent_hint`` (``dualpath/sessions.py``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dualpath.sessions import (
    MAX_HINT_S,
    MAX_PRIORITY,
    MAX_SESSION_ID_CHARS,
    MIN_PRIORITY,
    AgentHint,
)
from dualpath.vocab import Mode, ReadPath

NonNegInt = Annotated[int, Field(ge=0)]
MAX_CACHE_SALT_CHARS = 256


class APIError(Exception):
    """An error answered in OpenAI's shape with an HTTP status."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = (
            status, message, kind, param, code)

    def body(self) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class ErrorResponse(BaseModel):
    """OpenAI's error shape (for the OpenAPI document)."""

    error: dict[str, Any]


class StreamOptions(BaseModel):
    """``stream_options``: whether a last chunk carries the usage."""

    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class DualPathOptions(BaseModel):
    """Per-request ablation switches."""

    model_config = ConfigDict(extra="forbid")
    mode: Mode | None = None
    read_path: ReadPath | None = None


class AgentHintBody(BaseModel):
    """``agent_hint``: what the agent harness says about this session's next turns (the names
    of vLLM's agent-hint RFC where it has them; ``dualpath/sessions.py``)."""

    model_config = ConfigDict(extra="forbid")
    priority: Annotated[int, Field(ge=MIN_PRIORITY, le=MAX_PRIORITY)] = 0
    lease_s: Annotated[float, Field(ge=0.0, le=MAX_HINT_S)] | None = None
    next_turn_in_s: Annotated[float, Field(ge=0.0, le=MAX_HINT_S)] | None = None
    end_of_session: bool = False

    @model_validator(mode="after")
    def _no_next_turn_after_the_end(self) -> AgentHintBody:
        if self.end_of_session and (self.lease_s is not None or self.next_turn_in_s is not None):
            raise ValueError("end_of_session says no turn follows: it takes no lease_s or "
                             "next_turn_in_s")
        return self

    def hint(self) -> AgentHint:
        """As the cluster takes it."""
        return AgentHint(self.priority, self.lease_s, self.next_turn_in_s, self.end_of_session)


class _Sampling(BaseModel):
    """What completions and chat share."""

    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    n: Literal[1] = 1
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: Literal[False, None] = None
    ignore_eos: bool = False
    min_tokens: NonNegInt = 0
    return_token_ids: bool = False
    cache_salt: Annotated[str, Field(max_length=MAX_CACHE_SALT_CHARS)] | None = None
    dualpath: DualPathOptions | None = None
    # the agent session this request continues (or the X-Session-ID / x-dynamo-session-id
    # header), and the harness's hint about its next turns
    session_id: Annotated[str, Field(min_length=1, max_length=MAX_SESSION_ID_CHARS)] | None = None
    agent_hint: AgentHintBody | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        items = [stop] if isinstance(stop, str) else stop or []
        if len(items) > 4 or any(not s for s in items):
            raise ValueError("stop takes up to 4 non-empty strings")
        if not all(_is_utf8(s) for s in items):  # msgpack could not send them to the engines
            raise ValueError("stop strings must be valid Unicode (no lone surrogates)")
        return stop

    @field_validator("cache_salt")
    @classmethod
    def _salt_text(cls, salt: str | None) -> str | None:
        if salt is not None and not _is_utf8(salt):  # it travels to the engines in msgpack
            raise ValueError("cache_salt must be valid Unicode (no lone surrogates)")
        return salt

    def stop_strings(self) -> tuple[str, ...]:
        """``stop`` as a tuple."""
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


def _is_utf8(text: str) -> bool:
    """Whether ``text`` can be encoded as UTF-8 (JSON's ``\\ud800`` escapes cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: one prompt, text or token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: Literal[False] = False
    suffix: None = None


class ContentPart(BaseModel):
    """A text part of a message's content."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message of a chat."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        """The message's text (parts joined)."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
