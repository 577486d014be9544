"""Faults the fault suite injects into real engine processes, and the hook that abandons a
forward the router no longer wants.

Test-only hangs are off unless ``$DUALPATH_FAULT_HANG_DIR`` is set (the local launcher passes
the environment on): the work loop hangs between turns while ``DIR/NAME`` exists (as a deadlock
would, the heartbeat thread beating on), and a prefill forward hangs after a layer's compute,
before its KV is sent, while ``DIR/NAME.forward`` exists — a test then stops the process
mid-forward (SIGSTOP) at a known point.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from dualpath.errors import DualPathError
from dualpath.model.hooks import LayerHooks

FAULT_HANG_ENV = "DUALPATH_FAULT_HANG_DIR"
POLL_S = 0.05


class ForwardAbandoned(DualPathError):
    """The engine was dropped by its router mid-forward: the rest of the forward is not run
    and nothing more of it is sent."""


def fault_flag(name: str) -> Path | None:
    """The file whose existence hangs ``name`` (a loop, or ``NAME.forward``), or None when
    fault injection is off."""
    folder = os.environ.get(FAULT_HANG_ENV)
    return Path(folder) / name if folder else None


def hang_while(flag: Path | None, running: Callable[[], bool] = lambda: True) -> None:
    """Block while ``flag`` exists (and ``running()``)."""
    while flag is not None and flag.exists() and running():
        time.sleep(POLL_S)


class ForwardFaults(LayerHooks):
    """The layer hooks that run ahead of a prefill forward's own: the test-only hang after a
    layer's compute, then the check that the engine is still wanted (``abandon``)."""

    def __init__(self, abandon: Callable[[], bool], hang_flag: Path | None = None) -> None:
        self.abandon = abandon
        self.hang_flag = hang_flag

    def before_layer(self, layer_idx: int) -> None:
        self._check(layer_idx)

    def after_layer(self, layer_idx: int) -> None:
        hang_while(self.hang_flag)
        self._check(layer_idx)

    def _check(self, layer_idx: int) -> None:
        if self.abandon():
            raise ForwardAbandoned(f"the router dropped this engine (at layer {layer_idx})")
