"""``dualpath bench engine``: every system in its own process, the same prompts and method,
medians with spreads, the cores each used, the ratios; the vLLM peer where ``make peers`` ran."""

from __future__ import annotations

import json
import os

import pytest

from dualpath.bench.engine.compare import DEFAULT_PEERS_PYTHON, peers_python
from dualpath.bench.engine.method import spread
from dualpath.cli import main
from dualpath.errors import DualPathError

QUICK = ["--prompt-tokens", "48", "--decode-batches", "1,4", "--decode-tokens", "5",
         "--decode-prompt-tokens", "16", "--repeats", "2", "--dtype", "float32"]


def test_spread_reports_median_and_range():
    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0,
                                       "samples": [3.0, 1.0, 2.0]}


def test_bench_engine_against_transformers_writes_summary_spreads_and_cores(tiny_llama_dir,
                                                                          tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["bench", "engine", "--json", str(out), "--model", str(tiny_llama_dir), *QUICK]
    assert main(args) == 0
    result = json.loads(out.read_text())
    summary = result["summary"]
    for key in ("prefill_ratio_vs_transformers", "decode_ratio_vs_transformers_b1",
                "decode_ratio_vs_transformers_b4"):
        assert summary[key] > 0
    assert set(result["measured"]) == {"dualpath", "transformers"}
    ours = result["measured"]["dualpath"]
    assert ours["fast_path"] is True and ours["weights_mb"] > 0  # the engine ran on the kernels
    for name in ("dualpath", "transformers"):  # each system's resident memory, its peak beside
        m = result["measured"][name]
        assert 50 < m["rss_mb"]["median"] <= m["rss_mb"]["max"] <= m["peak_rss_mb"]
        assert summary[f"rss_mb_{name}"] == m["rss_mb"]["median"]
    for figure in (ours["prefill_tok_s"], ours["decode_tok_s"]["4"]):
        assert len(figure["samples"]) == 2 and figure["min"] <= figure["median"] <= figure["max"]
    for name in ("dualpath", "transformers"):
        assert summary[f"cores_busy_{name}"] > 0  # (this short a run counts in 10 ms ticks)
        assert "one torch thread" in result["cores"][name]
        assert result["measured"][name]["cpu_affinity"] == sorted(os.sched_getaffinity(0))
    assert result["machine"]["cpu_model"] and isinstance(result["machine"]["cpu_flags"], list)
    assert out.with_suffix(".png").stat().st_size > 1000
    assert (tmp_path / "bench.logs" / "dualpath.log").exists()
    printed = capsys.readouterr().out
    assert "vs transformers" in printed and "RSS (MB)" in printed


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two cores to show the pinning")
def test_pin_core_confines_each_system_to_one_core(tiny_llama_dir, tmp_path):
    out = tmp_path / "pinned.json"
    args = ["bench", "engine", "--json", str(out), "--model", str(tiny_llama_dir), *QUICK,
            "--pin-core", "1"]
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["setup"]["pin_core"] == 1
    assert {m["cpu_affinity"] == [1] for m in result["measured"].values()} == {True}


def test_unknown_peer_and_missing_peers_environment_are_clear_errors(tiny_llama_dir, tmp_path,
                                                                     capsys, monkeypatch):
    args = ["bench", "engine", "--json", str(tmp_path / "x.json"), "--model",
            str(tiny_llama_dir), "--against", "sglang"]
    assert main(args) == 2
    assert "--against takes transformers, vllm" in capsys.readouterr().err
    monkeypatch.delenv("DUALPATH_PEERS_PYTHON", raising=False)
    with pytest.raises(DualPathError, match="make peers"):
        peers_python(str(tmp_path / "no-such-venv" / "bin" / "python"))


@pytest.mark.skipif(not os.access(DEFAULT_PEERS_PYTHON, os.X_OK),
                    reason="no peers' environment (make peers)")
def test_bench_engine_against_vllm_in_the_peers_environment(smollm2_dir, tmp_path):
    out = tmp_path / "vllm.json"
    args = ["bench", "engine", "--json", str(out), "--model", str(smollm2_dir), "--against",
            "vllm", "--prompt-tokens", "64", "--decode-batches", "2", "--decode-tokens", "4",
            "--repeats", "1", "--vllm-eager"]  # a start without a minute of torch.compile
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["measured"]["vllm"]["version"] and result["summary"]["prefill_ratio_vs_vllm"] > 0
    assert "engine-core" in result["cores"]["vllm"]
    assert result["setup"]["vllm_eager"] is True
    assert "Enforce eager set" in (tmp_path / "vllm.logs" / "vllm.log").read_text()
