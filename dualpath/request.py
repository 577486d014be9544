"""Requests and their per-sequence state inside an engine."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from dualpath.errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop (OpenAI-style semantics)."""

    max_tokens: int = 256
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop strings count only from this many output tokens on

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise RequestError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise RequestError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise RequestError("top_p must be in (0, 1]")
        if any(not s for s in self.stop):
            raise RequestError("stop strings must be non-empty")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestError("min_tokens must be between 0 and max_tokens")

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax."""
        return self.temperature == 0


class SeqStatus(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One request's tokens, KV blocks and progress inside one engine."""

    prompt_ids: list[int]
    params: SamplingParams
    seq_id: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(init=False)  # prompt then generated tokens
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_prompt_tokens: int = 0  # prompt tokens reused from the prefix cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0  # leading blocks published to the prefix cache
    finish_reason: str | None = None
    output_text: str = ""
    cache_salt: str = ""  # a tenant's salt of the block hashes (kv/hashing.salted_seed)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise RequestError("the prompt is empty")
        self.token_ids = list(self.prompt_ids) + list(self.output_ids)

    def append_token(self, token_id: int) -> None:
        """Record one generated token."""
        self.output_ids.append(token_id)
        self.token_ids.append(token_id)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose KV still has to be computed."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        """True once a stop condition was met."""
        return self.status is SeqStatus.FINISHED
