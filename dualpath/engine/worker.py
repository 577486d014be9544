"""What an engine process's loop asks of its role's worker, prefill or decode.

The loop (``engine/loop.py``) owns the sockets and the messages every engine answers alike
(``Peers``, ``GetMetrics``, ``Shutdown``); a worker owns a role's requests and never touches a
socket. The loop hands it each request message (``handle``), and between messages lets it work
(``work``): nano-vllm's schedule → run → postprocess, once per loop turn. Both return the
messages to send. ``PrefillWorker`` (``engine/prefill.py``) and ``DecodeWorker``
(``engine/decode.py``) are the two.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from dualpath.protocol import Message


@runtime_checkable
class Worker(Protocol):
    """One role's request handling and compute, driven by ``EngineProcess``."""

    # called inside each forward or step with its token count (the EP traffic generator's
    # exchange: the step waits for it, as MoE dispatch/combine would)
    on_step: Callable[[int], None]
    # polled during long work: True once the router dropped this engine (a prefill forward
    # then stops and sends nothing more)
    abandon: Callable[[], bool]
    name: str  # the engine's name (logs, test-only fault flags)

    def handle(self, msg: Message) -> list[Message]:
        """Take a request message of this role (``Abort`` included); returns the answers.
        ``ValueError`` for a message the role does not take."""
        ...

    @property
    def has_work(self) -> bool:
        """True when ``work`` would compute now (the loop then does not wait for messages)."""
        ...

    def work(self) -> list[Message]:
        """Advance: pick up finished I/O, then compute one batch or step if any is ready;
        returns the messages to send."""
        ...

    def held_requests(self) -> tuple[int, ...]:
        """Req ids this worker holds in any phase."""
        ...

    @property
    def free_kv_blocks(self) -> int:
        """Device KV blocks not held by a request (the heartbeat reports it)."""
        ...

    def metrics(self) -> dict[str, object]:
        """This worker's counters, by name."""
        ...

    def liveness(self) -> tuple[float, float]:
        """(monotonic seconds when its work last made progress, seconds the step under way
        should take: 0 when none is) — the heartbeat's progress clock."""
        ...

    def fenced_requests(self) -> tuple[int, ...]:
        """Req ids whose prompt buffer this worker keeps for a writer until ``Unfence``."""
        ...

    @property
    def read_queue_tokens(self) -> int:
        """Hit tokens of this engine's storage reads not yet done (the heartbeat reports them:
        Algorithm 1 picks the read path by them)."""
        ...

    def close(self) -> None:
        """Stop what the worker runs besides the loop (threads, calls in flight)."""
        ...

    def settled(self) -> bool:
        """True when no transfer this worker started into another engine's memory can still
        land (an engine dropped by its router says hello again only then)."""
        ...
