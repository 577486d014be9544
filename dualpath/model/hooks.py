"""Hooks the layer loop calls around each decoder layer.

Layerwise prefill hangs its KV loading (before a layer) and forwarding (after a layer) on
these calls. The base class is the no-op default, so a subclass overrides only what it needs.
"""

from __future__ import annotations


class LayerHooks:
    """Callbacks around each decoder layer of one forward pass (no-ops by default)."""

    def before_layer(self, layer_idx: int) -> None:
        """Called before layer ``layer_idx`` reads its KV cache (make its hit KV resident)."""

    def after_layer(self, layer_idx: int) -> None:
        """Called after layer ``layer_idx`` wrote the new tokens' KV (forward or save it)."""

    def finish(self) -> None:
        """Called once after the last layer (wait for outstanding transfers)."""


class ComposedHooks(LayerHooks):
    """Several hook objects run in order (one per request of a batched forward)."""

    def __init__(self, parts: list[LayerHooks]) -> None:
        self.parts = parts

    def before_layer(self, layer_idx: int) -> None:
        for part in self.parts:
            part.before_layer(layer_idx)

    def after_layer(self, layer_idx: int) -> None:
        for part in self.parts:
            part.after_layer(layer_idx)

    def finish(self) -> None:
        for part in self.parts:
            part.finish()


NO_HOOKS = LayerHooks()
