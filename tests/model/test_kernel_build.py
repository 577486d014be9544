"""The CPU fast path is on wherever it can be: the kernels build and load on a CPU with AVX-512F
(a failure there is a test failure, not a skip), and when they are off the reason says why."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dualpath.model import kernels as kernels_module
from dualpath.model.kernels import kernel_status


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {f for line in text.splitlines() if line.startswith("flags")
            for f in line.partition(":")[2].split()}


def test_the_fast_path_is_in_use_on_a_cpu_with_avx512f(tiny_llama_dir, monkeypatch):
    from dualpath.config import EngineConfig
    from dualpath.engine.llm_engine import LLMEngine
    from dualpath.request import SamplingParams

    if "avx512f" not in _cpu_flags():
        pytest.skip("this CPU has no AVX-512F, which the kernels are written for")
    if os.environ.get(kernels_module.ENV_SWITCH) == "0":
        pytest.skip(f"turned off on purpose: {kernels_module.ENV_SWITCH}=0")
    kernels, why = kernel_status()
    assert kernels is not None, f"AVX-512F CPU, yet the CPU kernels are off: {why}"
    calls = []
    attend = kernels.attend
    monkeypatch.setattr(kernels, "attend", lambda *a, **k: calls.append(1) or attend(*a, **k))
    engine = LLMEngine(tiny_llama_dir, EngineConfig(dtype="bfloat16", block_size=16,
                                                    num_kv_blocks=16))
    model = engine.runner.model
    assert model.kernels is kernels
    assert all(layer.fused is not None for layer in model.model.layers)
    engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(calls) == 3 * model.spec.num_layers  # one prefill step, two decode steps


def test_the_reason_the_kernels_are_off_names_the_cause(monkeypatch, tmp_path):
    load = kernels_module.try_load_kernels
    monkeypatch.setenv("DUALPATH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(kernels_module.ENV_SWITCH, "0")
    assert f"{kernels_module.ENV_SWITCH}=0" in load()[1]
    monkeypatch.delenv(kernels_module.ENV_SWITCH)

    monkeypatch.setattr(kernels_module, "cpu_flags", lambda: {"avx2", "fma"})
    kernels, why = load()
    assert kernels is None and "AVX-512F" in why

    monkeypatch.setattr(kernels_module, "cpu_flags", lambda: {"avx512f"})
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    kernels, why = load()
    assert kernels is None and "no C compiler" in why and "no-such-cc" in why

    fake_cc = tmp_path / "cc"  # a compiler that cannot find this Python's headers
    fake_cc.write_text("#!/bin/sh\necho 'cpu_kernels.c:222:10: fatal error: Python.h: No such "
                       "file or directory' >&2\nexit 1\n")
    fake_cc.chmod(0o755)
    monkeypatch.setenv("CC", str(fake_cc))
    kernels, why = load()
    assert kernels is None and "Python.h: No such file or directory" in why

