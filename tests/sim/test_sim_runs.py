"""Small end-to-end simulator runs: the real scheduler drives placement and read paths."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from dualpath.sim.cluster import simulate
from dualpath.sim.config import SimConfig
from dualpath.sim.presets import DS660B, run_preset
from dualpath.sim.workload import WorkloadConfig

SMALL = replace(DS660B,
                workload=WorkloadConfig("64k", agents=32, turns=20))


@pytest.fixture(scope="module")
def results():
    return {m: simulate(replace(SMALL, mode=m))
            for m in ("basic", "layerwise", "dualpath", "round_robin", "oracle")}


def test_every_mode_finishes_and_oracle_is_fastest(results):
    assert all(r["jct_s"] > 0 for r in results.values())
    assert results["oracle"]["jct_s"] <= min(r["jct_s"] for r in results.values()) + 1e-9


def test_read_paths_follow_the_mode(results):
    assert results["basic"]["reads"]["de"] == 0 and results["basic"]["reads"]["pe"] > 0
    assert results["dualpath"]["reads"]["de"] > 0
    assert results["round_robin"]["reads"]["de"] > 0
    assert results["oracle"]["reads"] == {"pe": 0, "de": 0}
    assert results["basic"]["snic_util_decode"] == 0


def test_deterministic():
    a = simulate(replace(SMALL, mode="dualpath"))
    b = simulate(replace(SMALL, mode="dualpath"))
    assert a == b


def test_bad_mode():
    with pytest.raises(ValueError):
        SimConfig(mode="fast")


def test_preset_summary_keys():
    small = replace(SMALL, workload=WorkloadConfig("64k", agents=8, turns=5))
    out = run_preset("paper-ablation", agents=(8,), base=small)
    assert set(out["summary"]) >= {"max_abs_error_points"}
    out = run_preset("paper-scale", small=(2, 4, 8), large=(4, 8, 16), base=small)
    assert out["summary"]["jct_ratio_large_vs_small"] > 0


def test_plan_cli_json(tmp_path):
    path = tmp_path / "plan.json"
    subprocess.run([sys.executable, "-m", "dualpath.cli", "plan", "--json", str(path)],
                   check=True, capture_output=True)
    data = json.loads(path.read_text())
    assert data["summary"]["pd_range"] == "1/7 .. 7/2"
