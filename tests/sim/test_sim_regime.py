"""The regime of a simulated configuration (``sim/regime.py``): the paper's setting is
storage-bound with a small kappa, and ``dualpath sim`` prints it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dualpath.cli import main
from dualpath.sim.presets import DS660B
from dualpath.sim.regime import sim_regime
from dualpath.workloads.presets import summary, trajectory


def test_the_papers_setting_loads_a_token_for_a_few_percent_of_recomputing_it():
    got = sim_regime(DS660B)
    turns = trajectory(DS660B.workload)
    assert got["hit_rate"] == pytest.approx(summary(turns, 1)["hit_rate"])
    assert got["hit_rate"] > 0.98 and got["hit_per_computed"] > 50
    # 48,068 B over 80% of 50 GB/s; ~30K tokens/s of prefill per 8-GPU node
    assert got["load_s_per_token"] == pytest.approx(48_068 / (0.8 * 50e9))
    assert 1 / 60_000 < got["recompute_s_per_token"] < 1 / 15_000
    assert got["kappa"] == pytest.approx(got["load_s_per_token"] / got["recompute_s_per_token"])
    assert 0.02 < got["kappa"] < 0.1  # the issue's ~1/30
    assert got["rho"] == pytest.approx(got["hit_per_computed"] * got["kappa"]) and got["rho"] > 1


def test_slower_storage_raises_rho_and_slower_compute_lowers_kappa():
    base = sim_regime(DS660B)
    assert sim_regime(replace(DS660B, storage_eff=0.4))["rho"] == pytest.approx(2 * base["rho"])
    slower = sim_regime(replace(DS660B, prefill_eff=DS660B.prefill_eff / 2))
    assert slower["kappa"] == pytest.approx(base["kappa"] / 2)


def test_sim_prints_the_papers_regime(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["sim", "--preset", "paper-fig7", "--agents", "4", "--workload", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "regime of the paper's setting" in out and sim_regime(DS660B)["line"] in out
