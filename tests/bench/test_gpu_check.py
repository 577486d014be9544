"""``make gpu-check``'s CPU-side parts: the ratios and floors it reports, the tests it collects,
and what it writes on a machine without CUDA."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dualpath.bench import gpu_check
from dualpath.bench.gpu_check import (
    FLOORS,
    CheckOptions,
    GpuCheck,
    StepResult,
    agents_ratios,
    engine_ratios,
    gpu_test_files,
    render_table,
    verdicts,
)

ROOT = Path(__file__).resolve().parents[2]


def test_agents_ratios_are_against_basic_and_the_oracle():
    summary = {"jct_s": {"oracle": 2.0, "basic": 6.0, "layerwise": 5.0, "dualpath": 2.5}}
    got = agents_ratios(summary)
    assert got == pytest.approx({"layerwise_vs_basic": 1.2, "dualpath_vs_basic": 2.4,
                                 "oracle_vs_basic": 3.0, "dualpath_of_oracle": 0.8})
    ok = verdicts(got)
    assert ok == {"layerwise_vs_basic": True, "dualpath_vs_basic": True,
                  "dualpath_of_oracle": False}
    assert agents_ratios({"jct_s": {"basic": 1.0}}) == {}


def test_engine_ratios_include_the_roofline_fraction():
    result = {"summary": {"prefill_ratio_vs_transformers": 1.3,
                          "decode_ratio_vs_transformers_b1": 0.9, "cores_busy_dualpath": 1.0},
              "measured": {"dualpath": {"weights_mb": 15000.0,
                                        "decode_tok_s": {"1": {"median": 200.0}}}}}
    got = engine_ratios(result, hbm_bytes_s=4.5e12)
    weight_bytes_s = 15000 * 2**20 * 200
    assert got["decode_b1_weight_bytes_s"] == pytest.approx(weight_bytes_s)
    assert got["decode_b1_of_roofline"] == pytest.approx(weight_bytes_s / 4.5e12)
    assert "cores_busy_dualpath" not in got
    assert verdicts(got) == {"prefill_ratio_vs_transformers": True,
                             "decode_ratio_vs_transformers_b1": False,
                             "decode_b1_of_roofline": True}
    assert "decode_b1_of_roofline" not in engine_ratios(result, hbm_bytes_s=None)


def test_the_gpu_tests_are_collected_by_their_marker():
    files = gpu_test_files(ROOT)
    assert "tests/engine/test_cuda_hook_order.py" in files
    assert "tests/engine/test_cuda.py" in files
    assert "tests/bench/test_gpu_check.py" not in files  # no gpu-marked test here


def test_without_cuda_it_says_so_and_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "gpu_check.json"
    code = gpu_check.main(["--json", str(out), "--dir", str(tmp_path / "work")])
    assert code == 1
    result = json.loads(out.read_text())
    assert result["summary"]["skipped"] == {"all": "no CUDA device: nothing to check"}
    assert result["summary"]["floors"] == FLOORS


def test_a_step_that_does_not_fit_is_skipped_with_the_reason(tmp_path, monkeypatch):
    check = GpuCheck(CheckOptions(budget_s=5, json_path=str(tmp_path / "r.json"),
                                  work_dir=str(tmp_path / "w")), ROOT)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "hbm_bandwidth",
                        lambda: {"device": "fake", "hbm_bytes_s": 1e12})
    result = check.run()
    skipped = result["summary"]["skipped"]
    assert set(skipped) == {"tests", "engine", "agents-smollm2", "agents-llama3"}
    assert all("left of the budget" in why for why in skipped.values())


def test_the_table_marks_figures_below_their_floor():
    step = StepResult("agents-smollm2", "below floor", 1.0,
                      {"dualpath_vs_basic": 1.2, "jct_s": {"basic": 3.0}})
    table = render_table([step, StepResult("tests", reason="no CUDA device")])
    cells = [list(col.cells) for col in table.columns]
    assert cells[1][0] == "dualpath_vs_basic" and cells[4][0] == "NO"
    assert cells[0][1] == "tests"
