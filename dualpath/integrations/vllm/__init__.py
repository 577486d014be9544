"""vLLM integration. This package holds what runs inside vLLM's own processes: the KV
connector (``connector``, loaded by vLLM from ``kv_connector_module_path``), its per-step plan
and the request contract (``plan``), its moves, fences and setup. ``engines/`` holds what runs
in our engine process.

A ``kv_transfer_config`` written before the connector moved into ``connector`` names this
package as its module path: the connector's names are looked up here lazily for it (importing
the package imports no vLLM)."""

from __future__ import annotations

from typing import Any

_CONNECTOR_NAMES = ("DualPathConnector", "DualPathMeta")


def __getattr__(name: str) -> Any:
    """``DualPathConnector`` and ``DualPathMeta`` from ``connector``, on first use."""
    if name in _CONNECTOR_NAMES:
        from dualpath.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
