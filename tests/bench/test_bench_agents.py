"""``dualpath bench agents`` end to end on a tiny model: every mode, online trials, the report;
and through a ``dualpath serve`` process (``--via http``)."""

from __future__ import annotations

import json

import pytest

from dualpath.bench.agents.ladder import STORAGE_BOUND
from dualpath.bench.agents.online import _next_aps, steady_stats
from dualpath.bench.agents.run import serve_overrides
from dualpath.bench.agents.turns import poisson_offsets
from dualpath.bench.report import host_cpu_shares, host_cpu_ticks
from dualpath.cli import main
from dualpath.config import ClusterConfig, StorageConfig

TINY = ["--workload", "32k", "--scale", "64", "--agents", "2", "--turns", "3",
        "--block-size", "16", "--read-cap-mb-s", "5"]


def test_every_mode_offline_and_an_online_search(tiny_llama_dir, tmp_path):
    out, work = tmp_path / "agents.json", tmp_path / "work"
    assert main(["bench", "agents", *TINY, "--model", str(tiny_llama_dir),
                 "--modes", "basic,round_robin,dualpath,oracle", "--online-modes", "dualpath",
                 "--online-trials", "2", "--json", str(out), "--dir", str(work)]) == 0
    _every_stored_block_is_its_tokens_kv(work, tiny_llama_dir)
    data = json.loads(out.read_text())
    s = data["summary"]
    assert set(s["jct_s"]) == {"basic", "round_robin", "dualpath", "oracle"}
    assert s["speedup_dualpath_vs_basic"] > 0 and s["dualpath_vs_oracle"] > 0
    for mode in ("basic", "round_robin", "dualpath"):  # the measured hit is the expected one
        assert abs(s["hit_rate"][mode] - s["expected_hit_rate"]) < 1e-9, mode
    assert s["hit_rate"]["oracle"] == s["expected_hit_rate"]  # known without I/O
    modes = data["modes"]
    assert modes["basic"]["read_paths"] == {"pe": 6}
    de_reads = [mb for n, mb in modes["basic"]["snic_read_mb"].items()
                if modes["basic"]["roles"][n] == "decode"]
    assert modes["basic"]["snic_read_mb"]["0"] > 0 and de_reads == [0, 0]  # PE node only
    assert sum(modes["oracle"]["snic_read_mb"].values()) == 0
    pe_time = s["prefill_time_s"]  # where the PE's forward time went, from its own counters
    assert pe_time["basic"]["layer_waits_s"] > 0  # basic loads every layer before computing
    assert pe_time["oracle"]["layer_waits_s"] == 0  # the oracle moves nothing
    assert all(t["forwards_s"] > 0 and t["on_cpu_s"] > 0 and t["waiting_for_core_s"] >= 0
               for t in pe_time.values())
    assert all(t["loop_preemptions"] >= 0 for t in pe_time.values())
    # moving KV hands chunks between threads (here 775-986 wakeups); the oracle moves none (80)
    wakeups = s["engine_thread_wakeups"]
    assert wakeups["basic"] > wakeups["oracle"] > 0 and wakeups["dualpath"] > wakeups["oracle"]
    assert all(0 <= v <= 1 for v in s["host_cpu_steal_frac"].values())
    assert set(s["host_cpu_steal_frac"]) == set(s["jct_s"])
    parts = modes["dualpath"]["ttft_breakdown_s"]
    assert parts["prefill_s"] > 0 and parts["read_s"] > 0
    (online,) = data["online"]
    assert all(t["aps"] > 0 for t in online["trials"]) and len(online["trials"]) == 2
    assert s["ttft_slo_s"] > 0 and "dualpath" in s["online_capacity_aps"]
    assert data["offline"][0]["config"]["mode"] == "basic"  # the resolved config is kept
    assert data["offline"][1]["config"]["policy"] == "round_robin"
    assert out.with_suffix(".png").stat().st_size > 0
    _check_regime(data, tiny_llama_dir)


def _check_regime(data, model_dir):
    """The regime: basic's hits; its prefill engine's compute (forwards less layer waits)
    per computed token, there being no recompute row; the cap's load time per token."""
    from dualpath.model.spec import load_spec

    s, basic = data["summary"], data["modes"]["basic"]
    got = s["regime"]
    assert (got["hit_rate_of"], got["recompute_s_of"]) == ("basic", "basic")
    assert got["hit_rate"] == pytest.approx(s["expected_hit_rate"])
    computed = basic["prompt_tokens"] - basic["hit_tokens"]
    assert got["hit_per_computed"] == pytest.approx(basic["hit_tokens"] / computed)
    pe = s["prefill_time_s"]["basic"]
    per_token_s = (pe["forwards_s"] - pe["layer_waits_s"]) / computed
    assert got["recompute_s_per_token"] == pytest.approx(per_token_s)
    dtype = data["options"]["dtype"]  # auto, resolved: bfloat16 on a CPU with AVX512_BF16
    assert dtype in ("float32", "bfloat16")
    kv_bytes = load_spec(model_dir).kv_bytes_per_token(dtype)
    load_s = kv_bytes / (s["read_cap_mb_s"] * 1e6)
    assert got["kappa"] == pytest.approx(load_s / per_token_s)
    assert got["rho"] == pytest.approx(got["hit_per_computed"] * got["kappa"])


def _every_stored_block_is_its_tokens_kv(work, model_dir):
    """``dualpath store verify --all`` on each store the run kept (``--dir``): the blocks its
    decode engines saved (the last trial's for dualpath, whose online trials empty the store
    first) and the primed first prompts hold the KV of their tokens."""
    from dualpath.storage.verify import verify_fs_root

    for store in ("basic/kv", "round_robin/kv", "dualpath/kv", "primed"):
        report = verify_fs_root(work / store, model_dir, sample=None)
        assert report.ok, (store, report.mismatched, report.token_mismatches)
        assert report.num_checked > 0 and report.num_checked == report.num_ok, store
        # a block whose parent's write had not landed when the cluster stopped: not checkable
        assert set(report.unverifiable) <= {"broken_chain"}, (store, report.unverifiable)
    assert not list((work / "oracle" / "kv").iterdir())  # the oracle stores nothing


def test_via_http_serves_the_same_workload(tiny_with_tokenizer, tmp_path):
    out = tmp_path / "agents.json"
    assert main(["bench", "agents", *TINY, "--model", str(tiny_with_tokenizer), "--via", "http",
                 "--modes", "dualpath", "--online-modes", "", "--json", str(out)]) == 0
    s = json.loads(out.read_text())["summary"]
    assert abs(s["hit_rate"]["dualpath"] - s["expected_hit_rate"]) < 1e-9


def test_serve_overrides_reproduce_the_config():
    from dualpath.config_file import load_config

    config = ClusterConfig(storage=StorageConfig(root="/tmp/x", read_cap_mb_s=7.5),
                           policy="round_robin", mode="basic", split_read=True)
    assert load_config(None, serve_overrides(config)).cluster == config


def test_online_search_brackets_then_bisects():
    assert _next_aps([{"aps": 0.1, "meets_slo": True}]) > 0.1
    assert _next_aps([{"aps": 0.1, "meets_slo": False}]) < 0.1
    both = [{"aps": 0.1, "meets_slo": True}, {"aps": 0.4, "meets_slo": False}]
    assert abs(_next_aps(both) - 0.2) < 1e-9


def test_steady_window_drops_the_first_arrivals():
    offsets = poisson_offsets(10, 0.5, seed=1)
    assert offsets[0] == 0 and offsets == sorted(offsets)
    records = [{"submitted_s": t, "ttft_s": 1.0 if t >= 0.2 * offsets[-1] else 99.0,
                "ttst_s": None, "tpot_s": None} for t in offsets]
    assert steady_stats(records, offsets)["ttft_s"] == 1.0


def test_nic_rates_are_per_interval_and_a_late_sample_makes_no_spike():
    from dualpath.bench.agents.nics import utilization

    def at(t, read):
        return (t, {0: {"role": "prefill", "snic_read_bytes": read, "cnic_bytes": 0}})

    # 16 MB/s throughout; the sample due at 2 s came late, at 2.9 s, with counters a moment
    # old (30 MB), and the next 0.1 s later (48 MB): 18 MB in 0.1 s would read as 180 MB/s
    samples = [at(0.0, 0), at(1.0, 16e6), at(2.9, 30e6), at(3.0, 48e6), at(4.0, 64e6)]
    out = utilization(samples, 16.0, None, interval_s=1.0)
    assert out["t_s"] == [1.0, 2.9, 4.0]
    assert max(out["nodes"]["0"]["snic_mb_s"]) < 32  # two NICs' worth at most, not 11
    assert abs(out["nodes"]["0"]["snic_busy"] - 1.0) < 1e-9  # bytes over the whole span


def test_split_read_applies_to_the_modes_that_choose_a_path(tmp_path):
    from dualpath.bench.agents.ladder import AgentsOptions, cluster_config

    options = AgentsOptions(split_read=True)
    assert cluster_config(options, "dualpath", tmp_path).split_read
    assert cluster_config(options, "round_robin", tmp_path).split_read
    assert not cluster_config(options, "basic", tmp_path).split_read
    assert not cluster_config(AgentsOptions(), "dualpath", tmp_path).split_read


def test_without_a_cap_the_oracle_runs_first_and_sets_it(tiny_llama_dir, tmp_path):
    out = tmp_path / "agents.json"
    uncapped = [a for a in TINY if a not in ("--read-cap-mb-s", "5")]
    assert main(["bench", "agents", *uncapped, "--model", str(tiny_llama_dir),
                 "--modes", "basic,oracle", "--online-modes", "", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    s, cal = data["summary"], data["summary"]["read_cap_calibration"]
    assert [row["mode"] for row in data["offline"]] == ["oracle", "basic"]
    assert cal["oracle_jct_s"] == s["jct_s"]["oracle"]
    one_node_s = cal["hit_mb"] / s["read_cap_mb_s"]  # the hits through the PE node's NIC alone
    assert abs(one_node_s - STORAGE_BOUND * s["jct_s"]["oracle"]) < 1e-6
    assert data["offline"][1]["config"]["storage"]["read_cap_mb_s"] == s["read_cap_mb_s"]
    assert abs(sum(data["modes"]["basic"]["snic_read_mb"].values()) - cal["hit_mb"]) < 1.0


def test_a_calibrated_cap_needs_the_oracle():
    from dualpath.bench.agents.ladder import AgentsOptions, calibrated_cap_mb_s

    with pytest.raises(ValueError, match="oracle"):
        AgentsOptions(modes=("basic", "dualpath"))
    AgentsOptions(modes=("basic", "dualpath"), read_cap_mb_s=16.0)  # a given cap needs none
    assert calibrated_cap_mb_s(64_000_000, 16.0) == pytest.approx(64 / (STORAGE_BOUND * 16))
    with pytest.raises(ValueError, match="JCT"):
        calibrated_cap_mb_s(1, 0.0)


def test_aps_ratio_is_a_lower_bound_when_basic_never_met_the_slo():
    from dualpath.bench.agents.report import aps_ratio

    def online(mode, capacity, trials):
        return {"mode": mode, "capacity_aps": capacity,
                "trials": [{"aps": aps, "meets_slo": met} for aps, met in trials]}

    dualpath = online("dualpath", 0.4, [(0.25, True), (0.4, True)])
    basic = online("basic", 0.1, [(0.125, False), (0.08, True)])
    assert aps_ratio([basic, dualpath]) == {"aps_ratio_dualpath_vs_basic": 4.0}
    missed = online("basic", None, [(0.125, False), (0.08, False)])
    assert aps_ratio([missed, dualpath]) == {"aps_ratio_dualpath_vs_basic_at_least": 5.0}
    assert aps_ratio([dualpath]) == {}


def test_host_cpu_shares_count_busy_and_stolen_ticks(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 10 0 0 40 0 0\ncpu0 1 2 3\n")
    before = host_cpu_ticks(str(stat))
    assert before["steal"] == 40 and before["idle"] == 800
    stat.write_text("cpu  160 0 70 900 10 0 0 110 0 0\n")  # +60 user +20 sys +100 idle +70 steal
    shares = host_cpu_shares(before, host_cpu_ticks(str(stat)))
    assert shares == pytest.approx({"busy_frac": 80 / 250, "steal_frac": 70 / 250})
    assert host_cpu_ticks(str(tmp_path / "missing")) == {}
    assert host_cpu_shares({}, before) is None  # no first reading: no figure


def test_vllm_engines_run_their_rungs_and_the_oracle_offline(tmp_path):
    """``--engine vllm``: recompute, basic, layerwise, dualpath and the oracle (plain vLLM
    with an unbounded prefix cache) by default, on a workload of its own (28 agents x 2 turns,
    / 32: vLLM's floor needs more sessions for the 5x regime); round robin needs our engines;
    no online search; the instances keep vLLM's prefix cache on under the budget the run
    resolved, but recompute's, which reuse no KV at all."""
    from dataclasses import replace

    from dualpath.bench.agents.command import AgentsCommandOptions, options_from
    from dualpath.bench.agents.ladder import VLLM_RUNGS, AgentsOptions, cluster_config
    from dualpath.vocab import EngineKind, Rung

    options = options_from(AgentsCommandOptions(engine="vllm"))
    assert options.modes == VLLM_RUNGS and Rung.ORACLE in options.modes
    assert options.online_modes == ()
    assert options.block_size % 32 == 0  # vLLM's CPU attention takes multiples of 32 only
    assert options.host_pool_blocks * options.block_size == (
        options_from(AgentsCommandOptions()).host_pool_blocks * 16)  # the same bytes
    assert options.read_cap_mb_s is None  # calibrated on the oracle (else plain vLLM)
    config = cluster_config(options, "dualpath", tmp_path)
    assert config.engine_kind == EngineKind.VLLM and config.vllm.prefix_caching
    assert not cluster_config(options, "recompute", tmp_path).vllm.prefix_caching
    assert Rung.RECOMPUTE in options.modes
    assert (options.agents, options.turns, options.scale) == (28, 2, 32)
    native = options_from(AgentsCommandOptions())
    assert (native.agents, native.turns, native.scale) == (8, 4, 64)
    assert options_from(AgentsCommandOptions(engine="vllm", agents=5)).agents == 5
    assert config.vllm.max_model_len == options.max_context  # until run_bench bounds it
    bounded = cluster_config(replace(options, vllm_kv_cache_bytes=17_694_720,
                                     vllm_max_model_len=320), "basic", tmp_path)
    assert bounded.vllm.kv_cache_memory_bytes == 17_694_720
    assert bounded.vllm.max_model_len == 320
    assert cluster_config(AgentsOptions(), "dualpath", tmp_path).engine_kind == \
        EngineKind.DUALPATH
    AgentsOptions(engine="vllm", modes=("oracle",), online_modes=())  # the oracle runs
    for bad in ({"modes": ("round_robin",)}, {"online_modes": ("basic",)}):
        with pytest.raises(ValueError, match="vLLM engines"):
            AgentsOptions(engine="vllm", **{"modes": VLLM_RUNGS, "online_modes": (), **bad})
    with pytest.raises(ValueError, match="min-working-set-over-budget"):
        AgentsOptions(engine="vllm", modes=VLLM_RUNGS, online_modes=(),
                      min_working_set_over_budget=0)
    assert options_from(AgentsCommandOptions()).modes == AgentsOptions().modes
