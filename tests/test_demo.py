"""``dualpath demo``: the shipped Weka excerpt and a small run on a tiny model."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from dualpath.bench.demo import DemoOptions, run_demo
from dualpath.bench.demo_report import render_table
from dualpath.workloads.demo import (
    DATA_FILE,
    LICENSE_FILE,
    DemoTurn,
    license_text,
    load_demo_trace,
    scale_session,
    select_sessions,
)
from dualpath.workloads.turns import Turn


def test_excerpt_ships_in_the_package_with_its_license():
    data = resources.files("dualpath.workloads.data")
    assert data.joinpath(DATA_FILE).is_file() and data.joinpath(LICENSE_FILE).is_file()
    text = license_text()
    assert "Apache License" in text and "Version 2.0" in text
    words = " ".join(text.split())
    assert "callanjfox/kv-cache-tester" in words and "divided by 96" in words
    assert "from its request 21 on" in words
    sessions, header = load_demo_trace()
    assert header["scale"] == 96 and header["first_turn"] == 21
    assert "Apache-2.0" in header["license"]
    assert len(sessions) == 8 and all(len(s.turns) == 5 for s in sessions)
    for s in sessions:
        assert s.trace in text  # every session is named in the NOTICE
        context = 0  # prompt + generated tokens of the turn before
        for t in s.turns:
            assert 0 <= t.keep <= context and t.prompt > t.keep and t.gen >= 1
            assert t.prompt + t.gen <= header["max_context"]
            context = t.prompt + t.gen


def test_excerpt_is_malformed_loudly(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"sessions": [{"trace": "t", "turns": [
        {"prompt": 10, "keep": 0, "gen": 1}, {"prompt": 20, "keep": 12, "gen": 1}]}]}))
    with pytest.raises(ValueError, match="inconsistent"):  # keeps more than the 11-token context
        load_demo_trace(bad)
    bad.write_text("{}")
    with pytest.raises(ValueError, match="malformed"):
        load_demo_trace(bad)


def test_scaling_keeps_extensions_and_compactions():
    turns = [Turn(prompt=6400, hit=0, gen=320),
             Turn(prompt=7000, hit=6400, gen=64),  # extends: every full block of the last input
             Turn(prompt=3300, hit=3200, gen=1)]  # compaction: only 3,200 tokens survive
    assert scale_session(turns, scale=32) == [
        DemoTurn(prompt=200, keep=0, gen=10),
        DemoTurn(prompt=219, keep=210, gen=2),  # keeps prompt + generated of turn 1
        DemoTurn(prompt=103, keep=100, gen=1)]


def test_selection_skips_resumed_short_and_too_long_sessions():
    fresh = [Turn(prompt=16_000, hit=0, gen=100), Turn(prompt=17_000, hit=15_936, gen=100)]
    resumed = [Turn(prompt=71_000, hit=0, gen=100), Turn(prompt=72_000, hit=70_976, gen=100)]
    huge = [Turn(prompt=16_000, hit=0, gen=100), Turn(prompt=200_000, hit=15_936, gen=100)]
    picked = select_sessions([("a/resumed.json", resumed), ("a/short.json", fresh[:1]),
                              ("a/huge.json", huge), ("a/fresh.json", fresh),
                              ("a/never-read.json", fresh)], count=1, turns=2, scale=32)
    assert [s.trace for s in picked] == ["fresh"]


def test_a_window_of_later_turns_starts_cold_and_keeps_the_sessions_start_rule():
    """Turns 2-3 of a session that began at the system prompt: turn 2 is the window's cold
    first turn (keeps nothing), turn 3 keeps it; a resumed session is still skipped."""
    session = [Turn(prompt=16_000, hit=0, gen=100), Turn(prompt=17_000, hit=15_936, gen=100),
               Turn(prompt=17_600, hit=17_088, gen=64)]
    resumed = [Turn(prompt=71_000, hit=0, gen=100), *session[1:]]
    (picked,) = select_sessions([("a/resumed.json", resumed), ("a/s.json", session)],
                                count=2, turns=2, first_turn=2, scale=32)
    assert picked.trace == "s" and picked.turns == (
        DemoTurn(prompt=531, keep=0, gen=3), DemoTurn(prompt=550, keep=534, gen=2))
    assert select_sessions([("a/s.json", session)], turns=3, first_turn=2) == []  # too short
    with pytest.raises(ValueError, match="first_turn"):
        select_sessions([("a/s.json", session)], first_turn=0)


def test_demo_runs_its_modes_and_reports_the_table_and_the_regime(tiny_chaotic_dir, tmp_path):
    out = tmp_path / "demo.json"
    result = run_demo(DemoOptions(model=str(tiny_chaotic_dir), sessions=2, turns=2,
                                  block_size=16, read_cap_mb_s=50.0, json_path=str(out),
                                  modes=("basic", "dualpath", "recompute", "oracle")))
    data = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert set(data["modes"]) == {"basic", "dualpath", "recompute", "oracle"}
    _check_regime(data, result, tiny_chaotic_dir)
    modes_before = dict(data["modes"])
    oracle = data["modes"].pop("oracle")  # its hits are its own record: it ran turn 1 too
    basic = data["modes"]["basic"]  # (without turn 1 of its own, the oracle hit nothing)
    one_block = 16 / basic["prompt_tokens"]  # the oracle's record ends a block early at times
    assert abs(oracle["hit_rate"] - basic["hit_rate"]) <= 2 * one_block  # one per session
    assert oracle["pe_read_bytes"] == [0] and oracle["de_read_bytes"] == [0, 0]
    del data["modes"]["recompute"]
    for mode, s in data["modes"].items():
        assert s["jct_s"] > 0 and 0 < s["mean_ttft_s"] <= s["mean_turn_latency_s"], mode
        assert len(s["pe_read_bytes"]) == 1 and len(s["de_read_bytes"]) == 2
        assert s["read_deadline_misses"] == 0 and s["retried_turns"] == 0
    for row in data["rows"]:  # the engines worked in every timed part that lasted a few 10 ms
        # clock ticks (a tiny model's part can be shorter than one tick of one role's process,
        # and the oracle's, which reads nothing, than one of both: only the sum is > 0)
        assert set(row["cpu_s"]) == {"prefill", "decode"} and min(row["cpu_s"].values()) >= 0
        s = modes_before[row["mode"]]
        assert sum(row["cpu_s"].values()) > 0 or s["jct_s"] < 0.05, row["mode"]
        cores = data["machine"]["cpus"]
        assert s["cores_busy"] == pytest.approx(sum(row["cpu_s"].values()) / cores / s["jct_s"])
    dual, basic = data["modes"]["dualpath"], data["modes"]["basic"]
    assert dual["hit_rate"] > 0 and dual["hit_rate"] == basic["hit_rate"]  # turn 2 reloads
    assert sum(basic["de_read_bytes"]) == 0 and basic["pe_read_bytes"][0] > 0
    assert data["summary"]["dualpath_speedup"] == pytest.approx(basic["jct_s"] / dual["jct_s"])
    assert data["machine"]["cpu_model"] and data["summary"]["jct_s"]["basic"] > 0
    assert all(r["turns"] == 2 for r in data["rows"])  # 2 sessions x turn 2 (turn 1 untimed)
    assert render_table(result).row_count == 4


def _check_regime(data: dict, result: dict, model_dir) -> None:
    """The regime rests on basic's hits and recompute's seconds per computed token; kappa is
    loading a token's KV over the 50 MB/s NIC against that; rho = hit/computed x kappa."""
    from dualpath.model.spec import load_spec

    summary, modes = data["summary"], data["modes"]
    got = summary["regime"]
    basic, recompute = modes["basic"], modes["recompute"]
    assert recompute["hit_rate"] == 0 and recompute["recompute_s_per_token"] > 0
    assert (got["hit_rate_of"], got["recompute_s_of"]) == ("basic", "recompute")
    assert got["hit_rate"] == pytest.approx(basic["hit_rate"]) and got["hit_rate"] > 0
    computed = basic["prompt_tokens"] - basic["hit_tokens"]
    assert got["hit_per_computed"] == pytest.approx(basic["hit_tokens"] / computed)
    dtype = data["cluster"]["dtype"]  # auto, resolved: bfloat16 on a CPU with AVX512_BF16
    assert dtype in ("float32", "bfloat16")
    kv_bytes = load_spec(model_dir).kv_bytes_per_token(dtype)
    assert got["kv_bytes_per_token"] == kv_bytes
    assert got["kappa"] == pytest.approx(kv_bytes / 50e6 / recompute["recompute_s_per_token"])
    assert got["rho"] == pytest.approx(got["hit_per_computed"] * got["kappa"])
    assert summary["recompute_vs_basic"] == pytest.approx(recompute["jct_s"] / basic["jct_s"])
    assert got["line"] in render_table(result).title


def test_an_oracle_first_leaves_the_next_mode_its_first_turns(tiny_chaotic_dir, tmp_path):
    """The oracle stores nothing: a mode after it runs the first turns itself and still hits."""
    result = run_demo(DemoOptions(model=str(tiny_chaotic_dir), sessions=2, turns=2,
                                  block_size=16, read_cap_mb_s=50.0, json_path=None,
                                  modes=("oracle", "dualpath")))
    oracle, dual = result["modes"]["oracle"], result["modes"]["dualpath"]
    assert dual["hit_rate"] > 0.5 and sum(dual["pe_read_bytes"] + dual["de_read_bytes"]) > 0
    assert abs(oracle["hit_rate"] - dual["hit_rate"]) <= 2 * 16 / dual["prompt_tokens"]
