"""Small end-to-end simulator runs: the real scheduler drives placement and read paths."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from dualpath.sim.cluster import simulate
from dualpath.sim.config import SimConfig
from dualpath.sim.presets import (
    ABLATION,
    ABLATION_FIG,
    DS660B,
    DS660B_QUOTA_ALL,
    marginal_jct,
    run_preset,
)
from dualpath.workloads.presets import WorkloadConfig

SMALL = replace(DS660B,
                workload=WorkloadConfig("64k", agents=32, turns=20))


@pytest.fixture(scope="module")
def results():
    return {m: simulate(replace(SMALL, mode=m))
            for m in ("basic", "layerwise", "dualpath", "round_robin", "oracle")}


def test_every_mode_finishes_and_oracle_is_fastest(results):
    assert all(r["jct_s"] > 0 for r in results.values())
    # this run is decode-bound: the stock batcher of round robin may tie the Oracle (0.1%)
    assert results["oracle"]["jct_s"] <= min(r["jct_s"] for r in results.values()) * 1.001
    assert results["oracle"]["jct_s"] < results["basic"]["jct_s"]


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
    with pytest.raises(ValueError, match="reuse KV, not recompute"):  # not modelled: refused
        SimConfig(mode="recompute")


def test_preset_summary_keys():
    small = replace(SMALL, workload=WorkloadConfig("64k", agents=8, turns=5))
    out = run_preset("paper-ablation", agents=(8,), base=small)
    assert set(out["summary"]) >= {"max_abs_error_points"}
    out = run_preset("paper-scale", small=(2, 4, 8), large=(4, 8, 16), base=small)
    assert out["summary"]["jct_ratio_large_vs_small"] > 0


def test_ablation_compares_the_mean_over_agent_counts_with_the_paper():
    small = replace(SMALL, workload=WorkloadConfig("64k", agents=8, turns=5))
    out = run_preset("paper-ablation", agents=(8, 16), base=small)
    summary = out["summary"]
    for mode, paper in ABLATION.items():
        per_point = [r["reduction_pct"] for r in out["rows"] if r["mode"] == mode]
        assert len(per_point) == 2
        assert summary["reduction_pct_mean"][mode] == pytest.approx(sum(per_point) / 2)
        assert summary["error_points"][mode] == pytest.approx(sum(per_point) / 2 - paper)
    assert summary["max_abs_error_points"] == max(map(abs, summary["error_points"].values()))
    assert summary["max_abs_error_points_vs_figure"] is None  # no figure readings at 8/16
    assert set(summary["marginal_jct_s_per_1024_agents"]) == {"basic", *ABLATION}


def test_paper_batching_only_dualpath_and_oracle_use_the_quota():
    assert set(DS660B.quota_modes) == {"dualpath", "oracle"}
    tight = replace(SMALL, token_budget=512)
    for mode, changes in (("basic", True), ("round_robin", True), ("dualpath", False)):
        a = simulate(replace(SMALL, mode=mode))["jct_s"]
        b = simulate(replace(tight, mode=mode))["jct_s"]
        assert (a != b) is changes, mode


def test_plan_cli_json(tmp_path):
    path = tmp_path / "plan.json"
    subprocess.run([sys.executable, "-m", "dualpath.cli", "plan", "--json", str(path)],
                   check=True, capture_output=True)
    data = json.loads(path.read_text())
    assert data["summary"]["pd_range"] == "1/7 .. 7/2"


def test_every_mode_runs_lock_step_rounds(results):
    assert all(r["rounds"] > 0 for r in results.values())


def test_basic_prefetch_overlaps_reads_and_serialized_basic_does_not():
    heavy = replace(SMALL, workload=WorkloadConfig("64k", agents=1024, turns=20,
                                                   context_step=1600.0),
                    quota_modes=DS660B_QUOTA_ALL.quota_modes)  # one batcher: overlap only
    serial = simulate(replace(heavy, mode="basic"))
    ahead = simulate(replace(heavy, mode="basic", basic_prefetch=True))
    layer = simulate(replace(heavy, mode="layerwise"))
    assert serial["jct_s"] > 1.05 * ahead["jct_s"] and serial["jct_s"] > 1.05 * layer["jct_s"]
    assert ahead["jct_s"] >= 0.999 * layer["jct_s"]


def test_decode_step_is_a_roofline():
    cfg = replace(DS660B, decode_eff=0.5)
    m, hw = cfg.model_profile(), cfg.hw()
    weights = m.weight_bytes / (cfg.ep_group_nodes()[1] * hw.gpus_per_node)
    assert cfg.decode_step_s(0) == pytest.approx(weights / hw.hbm_bps / 0.5)
    steps = [cfg.decode_step_s(b) for b in (1, 8, 32, 128)]
    assert steps == sorted(steps)
    # memory-bound at small batch: weights dominate, so 8 requests cost < 2x one
    assert steps[1] < 2 * steps[0]


def test_calibrate_fits_decode_eff_to_one_oracle_point():
    from dualpath.sim.presets import calibrate

    seen = []

    def runner(cfg):  # a decode-bound point: JCT ~ 1/eff^0.8 (+ a constant)
        seen.append(cfg.mode)
        return 300 + 100 / cfg.decode_eff ** 0.8

    out = calibrate(DS660B, point=(512, 2000.0), runner=runner)
    assert abs(out["error"]) <= 0.005 and set(seen) == {"oracle"}
    assert 300 + 100 / out["fitted"]["decode_eff"] ** 0.8 == pytest.approx(2000, rel=0.005)


def test_without_lock_step_every_pe_runs_its_own_rounds():
    lock = simulate(replace(SMALL, mode="basic"))
    free = simulate(replace(SMALL, mode="basic", ep_lockstep=False))
    assert free["rounds"] > lock["rounds"] and free["reads"]["pe"] > 0
    # without the EP barrier one PE's reads overlap another's compute
    assert free["jct_s"] < lock["jct_s"]


def test_ep_groups_must_divide_the_sides():
    with pytest.raises(ValueError, match="ep_nodes"):
        replace(SMALL, ep_nodes=(3, 4))
    cfg = replace(SMALL, prefill_nodes=4, decode_nodes=8, ep_nodes=(2, 4))
    assert cfg.ep_group_nodes() == (2, 4)
    # weights per GPU (and so KV capacity) follow the EP group, not the side
    assert cfg.kv_capacity_tokens(4) == SMALL.kv_capacity_tokens(SMALL.decode_nodes)


def test_replicated_units_scale_linearly():
    small = simulate(replace(SMALL, mode="dualpath", ep_nodes=(2, 4)))
    big = simulate(replace(SMALL, mode="dualpath", prefill_nodes=4, decode_nodes=8,
                           ep_nodes=(2, 4), workload=replace(SMALL.workload, agents=64)))
    assert big["jct_s"] == pytest.approx(small["jct_s"], rel=0.1)


def test_online_run_reports_latencies():
    cfg = replace(SMALL, mode="dualpath",
                  workload=WorkloadConfig("64k", agents=16, turns=10, aps=0.5))
    r = simulate(cfg)
    assert r["requests"] > 0
    assert 0 < r["ttft_s"] < r["ttst_s"]
    assert r["tpot_s"] >= cfg.decode_step_s(1, 0) * 0.999


def test_trace_workload_runs():
    from dualpath.workloads.trace_files import trace_dir

    if not (trace_dir() / "weka-agentic-dev").exists():
        pytest.skip("traces not present")
    cfg = replace(SMALL, mode="dualpath", workload=WorkloadConfig(
        "weka", agents=6, max_context=65_536))
    r = simulate(cfg)
    assert r["agents"] == 6 and r["jct_s"] > 0 and r["reads"]["de"] + r["reads"]["pe"] > 0


def test_a_small_dram_staging_buffer_throttles_layerwise_reads():
    heavy = replace(SMALL, mode="layerwise", workload=WorkloadConfig(
        "64k", agents=512, turns=20, context_step=1600.0))
    roomy = simulate(replace(heavy, dram_buffer_gb=None))
    tight = simulate(replace(heavy, dram_buffer_gb=2.0))  # ~1.3 requests of 30K tokens per node
    assert tight["jct_s"] > 1.02 * roomy["jct_s"]
    assert tight["reads"] == roomy["reads"]


def test_dualpath_balances_storage_nics_better_than_round_robin():
    # docs/paper.md §7.9: storage-NIC max/avg 1.53 under round robin, 1.18 under DualPath
    cfg = replace(SMALL, workload=WorkloadConfig("64k", agents=256, turns=20,
                                                 context_step=1600.0))
    ratio = {m: simulate(replace(cfg, mode=m))["snic_max_over_avg"]
             for m in ("round_robin", "dualpath", "basic")}
    assert ratio["dualpath"] < 1.4 and ratio["dualpath"] + 0.25 < ratio["round_robin"]
    assert ratio["basic"] > 3  # only the 2 prefill nodes of 6 read


@pytest.mark.parametrize("streams, expect", [(1, "fifo"), (None, "shared")])
def test_read_streams_serve_a_node_in_fifo_order_or_share_it(streams, expect):
    from dualpath.sim.cluster import Simulator

    cfg = replace(DS660B, read_streams=streams,
                  workload=WorkloadConfig("64k", agents=1, turns=1))
    sim = Simulator(cfg)
    done: list[tuple[str, float]] = []
    tokens = 100_000
    for name in ("first", "second"):
        sim.storage.staged(0, tokens, lambda n=name: done.append((n, sim.loop.now)))
    sim.loop.run()
    one = tokens * sim.kvb / sim.snic[0].bandwidth
    times = dict(done)
    assert times["second"] == pytest.approx(2 * one)
    assert times["first"] == pytest.approx(one if expect == "fifo" else 2 * one)
    assert sim.storage.queued[0] == 0 and sim.storage.active[0] == 0


def test_marginal_jct_is_the_slope_between_the_extreme_agent_counts():
    jct = {("basic", 1024): 5400.0, ("basic", 2048): 10100.0, ("basic", 4096): 19000.0,
           ("oracle", 512): 2000.0}
    slopes = marginal_jct(jct)
    assert slopes == {"basic": pytest.approx((19000 - 5400) / 3)}  # one count: no slope
    paper = marginal_jct({(m, n): v for n, fig in ABLATION_FIG.items() for m, v in fig.items()})
    # the paper's Basic and +layerwise add about the same JCT per 1,024 agents (docs/paper.md §7.8)
    assert paper["basic"] == pytest.approx(4700) and paper["layerwise"] == pytest.approx(4500)


def test_varied_lengths_run_and_the_longest_agent_sets_the_oracle_jct():
    varied = replace(SMALL, mode="oracle",
                     workload=replace(SMALL.workload, lengths="varied", turns=None, agents=16))
    same = replace(varied, workload=replace(varied.workload, lengths="same"))
    a, b = simulate(varied), simulate(same)
    assert a["jct_s"] > 0 and a["agents"] == 16
    # the longest varied trajectory has 185 turns against the same trajectory's 157
    assert a["jct_s"] > b["jct_s"]
