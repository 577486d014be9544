"""Tables of ``dualpath sim`` / ``dualpath plan`` results (dualpath.sim.report), on hand-made
result dicts shaped as the presets and the planner return them; the planner's per-candidate
eq. 9 loads they show."""

import io
import subprocess
import sys
from fractions import Fraction

import pytest
from rich.console import Console

from dualpath.sim.planner import binding, eq9_loads, plan
from dualpath.sim.profiles import get_hardware
from dualpath.sim.report import (
    fmt_pct,
    fmt_s,
    plan_range_line,
    plan_table,
    resource,
    sim_tables,
    summary_table,
)


def text(*renderables) -> str:
    """What a 200-column console prints for ``renderables``."""
    out = io.StringIO()
    console = Console(file=out, width=200)
    for r in renderables:
        console.print(r)
    return out.getvalue()


def _row(mode, agents, jct, **kw):
    return {"mode": mode, "agents": agents, "P": 2, "D": 4, "jct_s": jct, **kw}


def _fig7():
    paper = {("basic", 1024): 5365, ("dualpath", 1024): 2917, ("oracle", 512): 2000}
    sim = {("basic", 512): 3420.0, ("dualpath", 512): 2016.0, ("oracle", 512): 2006.0,
           ("basic", 1024): 5132.0, ("dualpath", 1024): 2895.0, ("oracle", 1024): 2863.0}
    rows = []
    for (mode, n), jct in sim.items():
        p = paper.get((mode, n))
        rows.append(_row(mode, n, jct, paper_jct_s=p, rel_error=None if p is None else jct / p - 1))
    return {"preset": "paper-fig7", "workload": "64k", "rows": rows,
            "summary": {"max_rel_error_vs_paper": 0.0434, "speedup": {"512": 1.70, "1024": 1.77},
                        "paper_speedup": {"1024": 1.84}}}


def test_fig7_table_puts_the_papers_readings_beside():
    out = text(*sim_tables(_fig7()))
    assert "Fig. 7: offline JCT, 2P4D, 64k workload" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("1,024"))
    # basic 5,132 s against the paper's 5,365 (-4.3%); the speedup 5132/2895 beside 1.84
    for cell in ("5,132 (-4.3%)", "5,365", "2,895 (-0.8%)", "2,917", "2,863", "1.77x", "1.84x"):
        assert cell in row, cell
    assert "-4.3%" in out and "basic" in out and "oracle" in out


def test_ablation_table_has_a_mean_row_against_the_paper():
    rows = []
    for n, jcts, fig in ((1024, (5000.0, 3500.0, 2800.0), (5400, 4250, 3000)),
                         (2048, (10000.0, 7000.0, 5500.0), (10100, 8750, 5450))):
        for mode, jct, paper in zip(("basic", "layerwise", "dualpath"), jcts, fig, strict=True):
            rows.append(_row(mode, n, jct, reduction_pct=100 * (jct / jcts[0] - 1),
                             paper_fig_jct_s=paper,
                             paper_fig_reduction_pct=100 * (paper / fig[0] - 1)))
    result = {"preset": "paper-ablation", "workload": "64k", "rows": rows,
              "summary": {"reduction_pct_mean": {"layerwise": -30.0, "dualpath": -44.5},
                          "paper_reduction_pct": {"layerwise": -17.21, "dualpath": -45.62}}}
    out = text(*sim_tables(result))
    assert "Ablation: offline JCT" in out
    assert "3,500 (-30.0%)" in out and "4,250 (-21.3%)" in out
    mean = next(line for line in out.splitlines() if line.strip().startswith("mean"))
    assert "-30.0%" in mean and "-17.2%" in mean and "-45.6%" in mean


def test_online_tables_show_latencies_and_the_capacity():
    rows = [{"mode": m, "agents": 960, "P": 2, "D": 4, "aps": 0.4, "jct_s": 3000.0,
             "ttft_s": t, "ttft_p90_s": 2 * t, "ttst_s": 0.3, "tpot_s": 0.039,
             "tpot_p90_s": 0.06} for m, t in (("basic", 9.0), ("dualpath", 1.5))]
    result = {"preset": "paper-online", "workload": "64k", "rows": rows, "summary": {
        "aps_capacity": {"basic": 0.23, "dualpath": 0.68}, "capacity_ratio": 2.99,
        "aps_capacity_with_tpot_slo": {"basic": None, "dualpath": 0.3},
        "paper_aps_capacity": {"basic": 0.2, "dualpath": 0.45}, "paper_capacity_ratio": 2.25,
        "dualpath_at_0.4_aps": {"ttft_s": 1.5, "ttst_s": 0.3, "tpot_s": 0.039},
        "paper_at_0.4_aps": {"ttft_s": 1.739, "ttst_s": 0.228, "tpot_s": 0.039},
        "ttft_slo_s": 4.0, "tpot_slo_s": 0.05}}
    tables = sim_tables(result)
    assert len(tables) == 2
    out = text(*tables)
    assert "Online serving" in out and "TPOT" in out and "39.0" in out
    lines = out.splitlines()
    assert " no" in next(line for line in lines if line.strip().startswith("basic"))
    assert "yes" in next(line for line in lines if line.strip().startswith("dualpath"))
    assert "APS capacity" in out and "0.68" in out and "2.99x" in out and "2.25x" in out
    assert "TTFT 1.50 s (paper 1.74 s)" in out


def test_scale_table():
    rows = [_row("dualpath", 2048, 5261.0, paper_jct_s=3167, rel_error=5261 / 3167 - 1),
            {**_row("dualpath", 49152, 5455.0, paper_jct_s=3201, rel_error=5455 / 3201 - 1),
             "P": 48, "D": 96}]
    result = {"preset": "paper-scale", "rows": rows,
              "summary": {"jct_ratio_large_vs_small": 5455 / 5261, "paper_ratio": 3201 / 3167}}
    out = text(*sim_tables(result))
    assert "48P96D" in out and "49,152" in out and "5,455" in out and "1.037" in out


def _testbed(real: bool):
    rows = [{"mode": m, "agents": n, "P": 1, "D": 2, "jct_s": jct}
            for n, jcts in ((4, (155.3, 83.2, 80.0)), (8, (300.0, 160.0, 150.0)))
            for m, jct in zip(("basic", "dualpath", "oracle"), jcts, strict=True)]
    summary = {"dualpath_vs_basic_jct_ratio": {"4": 83.2 / 155.3, "8": 160 / 300},
               "real_benchmark_ratio": None}
    if real:
        summary.update(real_benchmark_ratio=0.566, real_benchmark="bench.json",
                       ratio_rel_error=(83.2 / 155.3) / 0.566 - 1,
                       real_jct_s={"basic": 149.1, "dualpath": 84.4},
                       sim_jct_s={"basic": 155.3, "dualpath": 83.2})
    return {"preset": "testbed", "workload": "tiny", "profile": "p.json", "rows": rows,
            "summary": summary}


def test_testbed_table_shows_the_real_ratio_beside_the_predicted_one():
    out = text(*sim_tables(_testbed(real=False)))
    assert "Testbed (p.json), 1P2D" in out and "0.536" in out and "real" not in out
    out = text(*sim_tables(_testbed(real=True)))
    row4 = next(line for line in out.splitlines() if line.strip().startswith("4 "))
    assert "0.536" in row4 and "0.566" in row4 and "-5.3%" in row4
    row8 = next(line for line in out.splitlines() if line.strip().startswith("8 "))
    assert "0.566" not in row8
    assert "basic 149.1 s" in out


def test_any_other_summary_gets_a_flat_key_value_table():
    result = {"preset": "paper-new", "rows": [],
              "summary": {"ratio": 1.23456, "nested": {"a": {"b": None}, "c": [1, 2]}}}
    out = text(*sim_tables(result))
    assert "paper-new summary" in out
    assert "ratio" in out and "1.235" in out and "nested.a.b" in out and "nested.c" in out
    # a known preset whose rows are not shaped as expected falls back instead of crashing
    broken = {"preset": "paper-fig7", "rows": [{"mode": "basic"}], "summary": {"x": 1}}
    out = text(*sim_tables(broken))
    assert "paper-fig7 summary" in out and "Fig. 7" not in out
    assert "x" in text(summary_table({"x": {}}))


def test_formats():
    assert fmt_s(2016.4) == "2,016" and fmt_s(15.11) == "15.1" and fmt_s(1.234) == "1.23"
    assert fmt_s(None) == "–" and fmt_pct(-0.0434) == "-4.3%" and fmt_pct(12.0, 1) == "+12.0%"
    assert resource("de_cnic_write (7)") == "DE CNIC write (7)"


# -- the planner's per-candidate loads --------------------------------------------------------

def test_eq9_loads_reach_one_exactly_at_the_bounds():
    assert eq9_loads(Fraction(1, 7))["pe_cnic_write (3)"] == 1
    assert eq9_loads(Fraction(6))["de_cnic_read (5)"] == 1
    at_upper = eq9_loads(Fraction(7, 2))
    assert at_upper["de_cnic_write (7)"] == at_upper["de_dram (8)"] == 1
    assert binding(at_upper) == ["de_cnic_write (7)", "de_dram (8)"]
    assert binding(eq9_loads(Fraction(1, 7))) == ["pe_cnic_write (3)"]
    assert eq9_loads(Fraction(1, 2), M=250)["de_dram (8)"] == Fraction(4, 5)
    with pytest.raises(ValueError):
        eq9_loads(Fraction(0))


def test_plan_candidates_carry_the_binding_resource():
    out = plan(get_hardware("hopper"), 6, beyond=True)
    rows = {(c["P"], c["D"]): c for c in out["candidates"]}
    assert rows[(1, 5)]["binding"] == ["pe_cnic_write (3)"]  # 1/5: PE CNIC write 0.75
    assert rows[(1, 5)]["binding_load"] == pytest.approx(0.75)
    assert rows[(1, 2)]["binding"] == ["de_dram (8)"] and rows[(1, 2)]["binding_load"] == 0.4
    assert rows[(4, 1)]["binding_load"] > 1 and not rows[(4, 1)]["in_range"]
    assert all(c["binding_load"] <= 1 for c in out["candidates"] if c["in_range"])


def test_plan_table_marks_the_recommendation_and_shows_each_jct():
    result = plan(get_hardware("hopper"), 4, simulate=lambda p, d: 1000.0 + 100 * p + 10 * d)
    result["model"] = "ds660b"
    out = text(plan_table(result))
    assert "P/D candidates: ds660b on hopper" in out and "binding" in out
    lines = out.splitlines()
    for c in result["candidates"]:
        line = next(x for x in lines if x.split()[:3] == [str(c["P"]), str(c["D"]), c["ratio"]])
        assert fmt_s(c["jct_s"]) in line and "inside" in line
        assert ("recommended" in line) == (f"{c['P']}P{c['D']}D" == result["summary"]
                                           ["recommended"])
    assert plan_range_line(result).startswith("eq. 9: 1/7 ≤ P/D ≤ 7/2")
    assert "DE DRAM (8)" in plan_range_line(result)


def test_plan_table_without_simulation_has_no_jct_column():
    out = text(plan_table({**plan(get_hardware("hopper"), 4), "model": "ds27b"}))
    assert "JCT" not in out and "DE DRAM (8)" in out and "recommended" not in out


def test_report_imports_no_engine_code():
    code = ("import sys, dualpath.sim.report\n"
            "bad = [m for m in sys.modules if m.split('.')[0] == 'torch'"
            " or m.startswith(('dualpath.engine', 'dualpath.model', 'matplotlib'))]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)
