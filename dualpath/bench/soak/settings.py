"""What one soak run does (:class:`SoakSettings`, the command's options) and its error."""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.errors import DualPathError


class SoakError(DualPathError):
    """The soak could not run (the server did not start, or died)."""


@dataclass(frozen=True)
class SoakSettings:
    """What one soak run does."""

    agents: int = 100
    duration_s: float = 600.0
    model: str | None = None  # None: the default model
    json_path: str = "results/soak.json"
    prefill: int = 1
    decode: int = 2
    first_tokens: int = 256
    append_tokens: int = 64
    gen_tokens: int = 16
    max_context_tokens: int = 2048
    sample_s: float = 5.0
    warmup_fraction: float = 0.2
    max_rss_growth: float = 0.10
    drain_s: float = 60.0
    startup_timeout_s: float = 300.0
    seed: int = 0
    serve_sets: tuple[str, ...] = ()  # KEY=VALUE overrides passed to `dualpath serve --set`

    def __post_init__(self) -> None:
        if self.agents < 1 or self.duration_s <= 0 or self.sample_s <= 0:
            raise ValueError("agents, duration and sample interval must be positive")
        if min(self.first_tokens, self.append_tokens, self.gen_tokens) < 1:
            raise ValueError("first, append and gen token counts must be >= 1")
        if self.first_tokens + self.gen_tokens > self.max_context_tokens:
            raise ValueError("the first turn alone exceeds --max-context-tokens")
        if not 0 <= self.warmup_fraction < 1:
            raise ValueError("--warmup-fraction must be in [0, 1)")
