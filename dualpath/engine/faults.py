"""Faults the fault suite injects into real engine processes, and the hook that abandons a
forward the router no longer wants.

Test-only hangs are off unless ``$DUALPATH_FAULT_HANG_DIR`` is set (the local launcher passes
the environment on): the work loop hangs between turns while ``DIR/NAME`` exists (as a deadlock
would, the heartbeat thread beating on), and a prefill forward hangs after a layer's KV has been
handed to the traffic manager, while ``DIR/NAME.forward`` exists (writing
``DIR/NAME.forward.hanging`` when it starts) — a test then stops the process mid-forward
(SIGSTOP) at a known point, with that layer's send possibly still on the wire.
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


class AbandonCheck(LayerHooks):
    """Runs ahead of a prefill forward's own hooks: before a layer computes and before its KV
    is sent, the engine must still be wanted (``abandon`` False), else ``ForwardAbandoned``."""

    def __init__(self, abandon: Callable[[], bool]) -> None:
        self.abandon = abandon

    def before_layer(self, layer_idx: int) -> None:
        self._check(layer_idx)

    def after_layer(self, layer_idx: int) -> None:
        self._check(layer_idx)

    def _check(self, layer_idx: int) -> None:
        if self.abandon():
            raise ForwardAbandoned(f"the router dropped this engine (at layer {layer_idx})")


class ForwardHang(LayerHooks):
    """Test-only, after a forward's own hooks: once a layer's KV has been handed to the
    traffic manager (its send may still be on the wire), hang while the flag exists."""

    def __init__(self, flag: Path) -> None:
        self.flag = flag

    def after_layer(self, layer_idx: int) -> None:
        if self.flag.exists():  # tell the test where (it may then SIGSTOP the process)
            self.flag.with_name(f"{self.flag.name}.hanging").write_text(str(layer_idx))
            hang_while(self.flag)


def forward_hooks(abandon: Callable[[], bool], name: str,
                  parts: list[LayerHooks]) -> list[LayerHooks]:
    """A prefill forward's hooks: the abandon check, its own, and (fault injection on) the
    test-only hang."""
    flag = fault_flag(f"{name}.forward")
    return [AbandonCheck(abandon), *parts, *([ForwardHang(flag)] if flag else [])]
