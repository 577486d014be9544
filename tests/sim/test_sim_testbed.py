"""The testbed beside the paper (issue 43): its regime as the demo computes it, and its own
configuration simulated with shared cores (``sim/shared_cores.py``) against a measured demo
JSON, the ratio flagged when it misses by more than 15%."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dualpath.cli import main
from dualpath.sim.demo_run import DemoRunError, generated_tokens, parse_demo_run
from dualpath.sim.regime import demo_regime
from dualpath.sim.shared_cores import (
    CPU_S_PER_GB,
    DECODE_CPU_S_PER_TOKEN,
    CoreBudget,
    core_budget,
    describe,
    predict,
)

KVB = 46_080  # SmolLM2-135M float32: 2 x 3 KV heads x 64 x 4 B x 30 layers


def _records(agents: list[list[tuple[int, int, int]]], recompute: bool) -> list[list[dict]]:
    """Turn records of ``(prompt, hit, gen)`` turns (recompute: no hit); timings give ``gen``
    (TPOT 40 ms)."""
    return [[{"prompt_tokens": p, "hit_tokens": 0 if recompute else h,
              "computed_tokens": p if recompute else p - h, "ttft_s": 0.5,
              "latency_s": 0.5 + 0.04 * (g - 1), "tpot_s": 0.04 if g > 1 else None,
              "read_path": "pe"} for p, h, g in turns] for turns in agents]


def demo_json(agents: list[list[tuple[int, int, int]]], modes: dict[str, dict[str, Any]],
              kvb: int = KVB, read_mb_s: float = 300.0, cores: int = 2) -> dict[str, Any]:
    """A ``dualpath demo`` result: 1 PE + 2 DE; ``modes``: name -> ``jct``, ``compute_s``
    (the PE's), ``reads`` (bytes per node: PE, DE, DE) and optionally ``cpu_s``."""
    rows, summaries = [], {}
    for mode, spec in modes.items():
        records = _records(agents, mode == "recompute")
        flat = [r for recs in records for r in recs]
        hit, prompt = sum(r["hit_tokens"] for r in flat), sum(r["prompt_tokens"] for r in flat)
        reads = spec.get("reads", (0, 0, 0))
        nodes = [{"node_id": i, "role": "prefill" if i == 0 else "decode", "read_bytes": b,
                  "read_deadline_misses": 0, "compute_s": spec["compute_s"] if i == 0 else 0.0,
                  "computed_tokens": prompt - hit if i == 0 else 0, "forwards": 15 * (i == 0)}
                 for i, b in enumerate(reads)]
        row = {"mode": mode, "jct_s": spec["jct"], "records": records, "nodes": nodes,
               "hit_tokens": hit, "prompt_tokens": prompt}
        if "cpu_s" in spec:
            row["cpu_s"] = spec["cpu_s"]
        rows.append(row)
        summaries[mode] = {"jct_s": spec["jct"], "hit_tokens": hit, "prompt_tokens": prompt,
                           "recompute_s_per_token": spec["compute_s"] / (prompt - hit)}
    return {"benchmark": "demo", "model": "SmolLM2-135M-Instruct",
            "machine": {"cpus": cores, "cpu_model": "AMD EPYC (2 cores)"},
            "cluster": {"prefill": 1, "decode": 2, "block_size": 16, "dtype": "float32"},
            "caps_mb_s": {"read": read_mb_s, "compute": 8 * read_mb_s},
            "modes": summaries, "rows": rows,
            "summary": {"jct_s": {m: s["jct"] for m, s in modes.items()},
                        "regime": {"kv_bytes_per_token": kvb}}}


# -- the testbed's regime, by hand -----------------------------------------------------------

def test_demo_regime_is_the_demos_arithmetic():
    # one turn: 900 of 1,000 prompt tokens hit; 1,000 B/token over 1 MB/s: 1 ms to load;
    # recompute's prefill: 4 s for 1,000 tokens, 4 ms each -> kappa 0.25, 9 hit/computed,
    # rho 2.25
    data = demo_json([[(1000, 900, 1)]], {"basic": {"jct": 2.0, "compute_s": 0.5},
                                          "recompute": {"jct": 5.0, "compute_s": 4.0}},
                     kvb=1000, read_mb_s=1.0)
    got = demo_regime(parse_demo_run(data, "hand.json"))
    assert got["hit_rate"] == pytest.approx(0.9)
    assert got["hit_per_computed"] == pytest.approx(9.0)
    assert got["load_s_per_token"] == pytest.approx(1e-3)
    assert got["recompute_s_per_token"] == pytest.approx(4e-3)
    assert got["kappa"] == pytest.approx(0.25)
    assert got["rho"] == pytest.approx(2.25)
    assert got["line"] == "h 90.0%, 9.0 hit/computed, κ 0.25, ρ 2.25"
    assert got["source"] == "hand.json"


def test_demo_regime_without_recompute_takes_the_reusing_modes_compute():
    # basic's prefill: 0.5 s for its 100 computed tokens, 5 ms each -> kappa 1 ms / 5 ms = 0.2
    data = demo_json([[(1000, 900, 1)]], {"basic": {"jct": 2.0, "compute_s": 0.5}},
                     kvb=1000, read_mb_s=1.0)
    got = demo_regime(parse_demo_run(data))
    assert got["kappa"] == pytest.approx(0.2) and got["rho"] == pytest.approx(1.8)


# -- the core budget, by hand ----------------------------------------------------------------

def test_the_cpu_floor_spreads_the_work_over_the_cores():
    budget = CoreBudget(cores=2, base_cpu_s=6.0, cpu_s_per_gb=4.0, calibration="hand")
    assert budget.cpu_s(1.5e9) == pytest.approx(12.0)  # 6 + 4 x 1.5
    assert budget.floor_s(1.5e9) == pytest.approx(6.0)
    assert budget.floor_s(0) == pytest.approx(3.0)


def test_the_budget_without_cpu_figures_uses_the_oracles_compute_and_the_defaults():
    # oracle: 2 s of prefill for 100 computed tokens; 2 turns of 5 tokens, 4 decoded each
    data = demo_json([[(1000, 950, 5), (1100, 1050, 5)]],
                     {"oracle": {"jct": 3.0, "compute_s": 2.0},
                      "basic": {"jct": 4.0, "compute_s": 3.0}})
    budget = core_budget(parse_demo_run(data))
    assert budget.base_cpu_s == pytest.approx(2.0 + 8 * DECODE_CPU_S_PER_TOKEN)
    assert budget.cpu_s_per_gb == CPU_S_PER_GB


def test_the_budget_with_cpu_figures_is_calibrated_on_them():
    hit_gb = 2000 * KVB / 1e9
    data = demo_json([[(1000, 950, 5), (1100, 1050, 5)]],
                     {"oracle": {"jct": 3.0, "compute_s": 2.0,
                                 "cpu_s": {"prefill": 2.0, "decode": 3.0}},
                      "basic": {"jct": 4.0, "compute_s": 3.0, "cpu_s": 5.0 + 4.0 * hit_gb}})
    budget = core_budget(parse_demo_run(data))
    assert budget.base_cpu_s == pytest.approx(5.0)
    assert budget.cpu_s_per_gb == pytest.approx(4.0)


def test_generated_tokens_come_from_the_records_timings():
    assert generated_tokens({"ttft_s": 0.5, "latency_s": 0.66, "tpot_s": 0.04}) == 5
    assert generated_tokens({"ttft_s": 0.5, "latency_s": 0.5, "tpot_s": None}) == 1


# -- the measured later-turn window: 2-core AMD EPYC ------------------------------------------

def window_agents() -> list[list[tuple[int, int, int]]]:
    """8 agents x 4 timed turns: 26,272 hit tokens, 459 computed, 147 generated (115 by the
    decode engines), as the demo's later-turn window at 16-token blocks."""
    agents, i = [], 0
    for a in range(8):
        turns = []
        for k in range(4):
            hit = 691 + 20 * a + 40 * k
            turns.append((hit + (15 if i < 11 else 14), hit, 5 if i < 19 else 4))
            i += 1
        agents.append(turns)
    return agents


HIT_BYTES = 26_272 * KVB  # 1.21 GB


def window_json(dualpath_jct: float = 6.1, cpu: bool = False) -> dict[str, Any]:
    """The measured run (JCTs, the PE's compute, the nodes' reads; CPU-s when ``cpu``)."""
    modes: dict[str, dict[str, Any]] = {
        "oracle": {"jct": 3.5, "compute_s": 2.8},
        "basic": {"jct": 6.3, "compute_s": 4.25, "reads": (HIT_BYTES, 0, 0)},
        "dualpath": {"jct": dualpath_jct, "compute_s": 4.6,
                     "reads": (450_000_000, 380_000_000, HIT_BYTES - 830_000_000)},
        "recompute": {"jct": 70.7, "compute_s": 56.0}}
    if cpu:
        modes["oracle"]["cpu_s"] = {"prefill": 2.25, "decode": 3.6}
        modes["basic"]["cpu_s"] = 10.8
        modes["dualpath"]["cpu_s"] = 10.7
    return demo_json(window_agents(), modes)


def test_the_window_fixture_is_the_measured_workload():
    run = parse_demo_run(window_json())
    assert run.computed_tokens == 459 and run.decode_tokens == 115
    assert run.modes["basic"].hit_tokens == 26_272
    assert run.modes["dualpath"].read_bytes == HIT_BYTES
    regime = demo_regime(run)
    assert regime["hit_rate"] == pytest.approx(26_272 / 26_731)  # 98.3%
    assert regime["hit_per_computed"] == pytest.approx(26_272 / 459)  # 57.2
    # 46,080 B over 300 MB/s / (56 s / 26,731 tokens)
    assert regime["kappa"] == pytest.approx((KVB / 300e6) / (56.0 / 26_731))


@pytest.mark.parametrize("cpu", [False, True], ids=["defaults", "cpu-figures"])
def test_the_prediction_reproduces_the_measured_ratio_within_15_percent(cpu):
    prediction = predict(parse_demo_run(window_json(cpu=cpu)))
    assert prediction.measured_ratio == pytest.approx(6.3 / 6.1)
    assert abs(prediction.miss) <= 0.15 and not prediction.flagged
    for mode in ("basic", "dualpath"):  # both CPU-bound, as measured
        p = prediction.modes[mode]
        assert p.bound == "cores" and p.jct_s == pytest.approx(p.cpu_floor_s)
        assert p.jct_s == pytest.approx(p.measured_jct_s, rel=0.15)
    # the NICs and each engine's compute alone miss the measured ratio by far more
    sim_ratio = prediction.modes["basic"].sim_s / prediction.modes["dualpath"].sim_s
    assert sim_ratio / prediction.measured_ratio - 1 > 0.15


def test_the_cpu_figures_set_the_floor():
    budget = predict(parse_demo_run(window_json(cpu=True))).budget
    assert budget.base_cpu_s == pytest.approx(5.85)
    assert budget.cpu_s_per_gb == pytest.approx((10.8 - 5.85) / (HIT_BYTES / 1e9))
    assert budget.floor_s(HIT_BYTES) == pytest.approx(10.8 / 2)


def test_a_miss_of_more_than_15_percent_is_flagged():
    prediction = predict(parse_demo_run(window_json(dualpath_jct=3.0)))  # measured 2.1x
    assert prediction.miss == pytest.approx(prediction.predicted_ratio / (6.3 / 3.0) - 1)
    assert prediction.miss < -0.15 and prediction.flagged
    lines = describe(prediction)
    assert "MISSED by more than 15%" in lines[-1] and lines[-1].startswith("  [red]")
    assert "within 15%" in describe(predict(parse_demo_run(window_json())))[-1]


@pytest.mark.parametrize(("miss", "flagged"), [(-0.14, False), (-0.16, True), (0.14, False),
                                               (0.16, True)])
def test_the_tolerance_is_15_percent_of_the_measured_ratio(miss, flagged):
    # T_sim 1 s everywhere: the CPU floor decides; basic and dualpath move the same hits, so
    # the predicted ratio is 1; measured basic 1 s and dualpath 1 + miss s make the measured
    # ratio 1 / (1 + miss), and the prediction misses it by exactly ``miss``
    data = window_json()
    data["rows"][1]["jct_s"], data["rows"][2]["jct_s"] = 1.0, 1.0 + miss
    prediction = predict(parse_demo_run(data), simulate_s=lambda cfg, agents: 1.0)
    assert prediction.predicted_ratio == pytest.approx(1.0)
    assert prediction.miss == pytest.approx(miss)
    assert prediction.flagged is flagged


def test_the_simulator_sees_the_testbeds_configuration():
    seen = []

    def spy(cfg, agents):
        seen.append((cfg, agents))
        return 1.0
    run = parse_demo_run(window_json())
    predict(run, simulate_s=spy)
    assert [str(cfg.mode) for cfg, _ in seen] == ["basic", "dualpath", "oracle"]
    cfg, agents = seen[0]
    assert (cfg.prefill_nodes, cfg.decode_nodes) == (1, 2)
    assert cfg.hw().snic_bps == pytest.approx(300e6) and cfg.hw().cnic_bps == pytest.approx(2.4e9)
    assert cfg.model_profile().kv_bytes_per_token == KVB
    assert cfg.prefill_cost().b == pytest.approx(2.8 / 459 * 1e3)  # the oracle's ms per token
    assert [[(t.prompt, t.hit, t.gen) for t in a] for a in agents] == window_agents()


def test_a_json_that_is_not_a_demo_result_is_named():
    data = window_json()
    del data["caps_mb_s"]
    with pytest.raises(DemoRunError, match=r"bad\.json: not a dualpath demo result.*caps_mb_s"):
        parse_demo_run(data, "bad.json")
    with pytest.raises(DemoRunError, match="no mode ran"):
        parse_demo_run({**window_json(), "rows": []}, "empty.json")


# -- dualpath sim ------------------------------------------------------------------------------

def test_sim_prints_the_testbed_beside_the_paper(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo.json").write_text(json.dumps(window_json()))
    assert main(["sim", "--demo", "demo.json", "--json", "out.json"]) == 0
    out = capsys.readouterr().out
    assert "regime of the paper's setting" in out
    assert "regime of the testbed (demo.json" in out and "h 98.3%, 57.2 hit/computed" in out
    assert "basic/dualpath: predicted 1.00, measured 1.03" in out and "within 15%" in out
    testbed = json.loads((tmp_path / "out.json").read_text())["regime"]["testbed"]
    assert set(testbed) >= {"hit_rate", "hit_per_computed", "kappa", "rho", "prediction"}
    assert not testbed["prediction"]["flagged"]
    assert testbed["prediction"]["modes"]["basic"]["bound"] == "cores"


def test_sim_reads_results_demo_json_by_default_and_says_when_there_is_none(
        tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["sim", "--preset", "paper-fig7", "--agents", "4", "--workload", "tiny"]) == 0
    assert "no results/demo.json here" in capsys.readouterr().out
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "demo.json").write_text(json.dumps(window_json(dualpath_jct=3.0)))
    assert main(["sim", "--preset", "paper-fig7", "--agents", "4", "--workload", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "regime of the testbed (results/demo.json" in out and "MISSED" in out


def test_a_default_demo_json_that_does_not_read_leaves_the_preset_be(
        tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "demo.json").write_text("{}")
    assert main(["sim", "--preset", "paper-fig7", "--agents", "4", "--workload", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "regime of the paper's setting" in out and "not a dualpath demo result" in out
    assert main(["sim", "--demo", "results/demo.json"]) == 2  # named: an error


@pytest.mark.parametrize(("argv", "needle"), [
    ([], "--preset is required"),
    (["--demo", "nowhere.json"], "--demo nowhere.json: no such file"),
    (["--demo", "demo.json", "--agents", "4"], "--agents: these options go with a --preset"),
])
def test_bad_demo_invocations_are_named(argv, needle, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo.json").write_text(json.dumps(window_json()))
    assert main(["sim", *argv]) == 2
    assert needle in capsys.readouterr().err

