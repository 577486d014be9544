"""The vLLM package's old module path: a ``kv_transfer_config`` written before the connector
moved into ``dualpath.integrations.vllm.connector`` names ``dualpath.integrations.vllm``, and
vLLM looks the class up there by name."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest

import dualpath.integrations.vllm as package


def test_the_package_hands_out_the_connector_lazily(monkeypatch):
    stub = types.ModuleType("dualpath.integrations.vllm.connector")
    stub.DualPathConnector = type("DualPathConnector", (), {})
    stub.DualPathMeta = type("DualPathMeta", (), {})
    monkeypatch.setitem(sys.modules, "dualpath.integrations.vllm.connector", stub)
    monkeypatch.setattr(package, "connector", stub, raising=False)
    assert package.DualPathConnector is stub.DualPathConnector
    assert package.DualPathMeta is stub.DualPathMeta
    with pytest.raises(AttributeError, match="no attribute 'Other'"):
        package.Other  # noqa: B018


def test_importing_the_package_imports_no_vllm():
    code = ("import sys, dualpath.integrations.vllm as p; "
            "print('vllm' in sys.modules, 'DualPathConnector' in vars(p))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.split() == ["False", "False"]  # looked up on use, not at import
