"""How an engine's work shows it moves: when a layer last finished, and how long the layer under
way should take (the heartbeat reports both; the router judges "no progress" against the
second, so a legitimately long layer is never taken for a hang: ``server/router/state.py``).

A layer's expected time is the previous layer's of the same forward (the layers of a decoder
are alike); a forward's first layer is predicted from its floating-point work at the rate the
last measured layer ran, and before any layer was measured at ``PRIOR_FLOPS_PER_S``, a rate
slower than any CPU thread's, so a first long layer is never judged too early. A wait with a
deadline of its own (a step's EP exchange, bounded by its peers' grant timeout: ``bounded``)
is budgeted at that deadline. The rules take times as arguments, so they are tested without
waiting.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

# before this engine has timed a layer: slower than one CPU thread runs a GEMM (tens of
# GFLOP/s), so the first layer's budget is generous rather than wrong
PRIOR_FLOPS_PER_S = 1e9


@dataclass(frozen=True)
class LayerWork:
    """One layer's work in a step: its new tokens and their attention pairs (the keys each new
    token attends to, summed)."""

    num_tokens: int
    num_pairs: float

    def flops(self, params_per_layer: int, attention_width: int) -> float:
        """Floating-point operations of one layer: the projections and MLP (2 per weight per
        token) and attention's scores and values (4 per pair per query channel)."""
        return 2.0 * self.num_tokens * params_per_layer + 4.0 * self.num_pairs * attention_width


NO_WORK = LayerWork(0, 0.0)


class StepClock:
    """Progress stamps of one engine's forwards (written by the compute thread, read by the
    heartbeat thread: plain attribute reads)."""

    def __init__(self, params_per_layer: int, attention_width: int, now_s: float) -> None:
        self.params_per_layer = params_per_layer
        self.attention_width = attention_width
        self.progress_s = now_s  # when a layer (or a forward) last finished
        self._layer_start_s: float | None = None  # None: no forward under way
        self._flops = 0.0
        self._last_layer_s: float | None = None  # the previous layer of this forward
        self._s_per_flop: float | None = None  # the rate the last timed layer ran at

    def begin(self, work: LayerWork, now_s: float) -> None:
        """A forward starts."""
        self._flops = work.flops(self.params_per_layer, self.attention_width)
        self._last_layer_s = None
        self._layer_start_s = now_s

    def layer_done(self, now_s: float) -> None:
        """A layer of the forward finished (its hooks included): progress."""
        if self._layer_start_s is None:
            return
        took_s = max(0.0, now_s - self._layer_start_s)
        self._last_layer_s = took_s
        if self._flops > 0:
            self._s_per_flop = took_s / self._flops
        self._layer_start_s = self.progress_s = now_s

    def wait(self, budget_s: float, now_s: float) -> None:
        """A wait bounded by its own deadline begins (``end`` ends it)."""
        self._flops, self._last_layer_s, self._layer_start_s = 0.0, budget_s, now_s

    def bounded(self, step: Callable[[int], None], budget_s: float) -> Callable[[int], None]:
        """``step`` budgeted at ``budget_s`` while it runs (a step hook: ``Worker.on_step``)."""
        def run(num_tokens: int) -> None:
            self.wait(budget_s, time.monotonic())
            try:
                step(num_tokens)
            finally:
                self.end(time.monotonic())
        return run

    def end(self, now_s: float) -> None:
        """The forward (or bounded wait) ended (finished, failed or abandoned)."""
        self._layer_start_s = None
        self.progress_s = now_s

    def budget_s(self) -> float:
        """Seconds the layer under way should take (0 between forwards)."""
        if self._layer_start_s is None:
            return 0.0
        if self._last_layer_s is not None:
            return self._last_layer_s
        s_per_flop = self._s_per_flop if self._s_per_flop is not None else 1 / PRIOR_FLOPS_PER_S
        return self._flops * s_per_flop
