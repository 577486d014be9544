"""PNG figures for simulator results (dualpath.sim.plots), on small hand-made result dicts."""


import pytest

from dualpath.sim.plots import (
    plot_ablation,
    plot_fig7,
    plot_online,
    plot_plan,
    plot_result,
    plot_scale,
    png_path_for,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _is_png(path):
    data = path.read_bytes()
    return len(data) > 1000 and data[:8] == PNG_MAGIC


def _fig7():
    paper = {"basic": {512: 2900, 1024: 5365}, "dualpath": {512: 2100, 1024: 2917},
             "oracle": {512: 2000}}
    sim = {"basic": 1.4, "dualpath": 1.05, "oracle": 1.0}
    rows = [{"mode": m, "agents": n, "P": 2, "D": 4, "jct_s": 2000 * f * n / 512,
             "paper_jct_s": paper[m].get(n), "rel_error": None}
            for n in (512, 1024) for m, f in sim.items()]
    return {"preset": "paper-fig7", "rows": rows,
            "summary": {"speedup": {"512": 1.33}, "paper_speedup": {"1024": 1.84}}}


def _ablation():
    rows = []
    for n in (1024, 2048):
        rows.append({"mode": "basic", "agents": n, "P": 2, "D": 4, "jct_s": 5000.0,
                     "reduction_pct": 0.0})
        for mode, red, paper in (("layerwise", -15.0, -17.21), ("round_robin", -35.0, -38.19),
                                 ("dualpath", -44.0, None)):
            rows.append({"mode": mode, "agents": n, "P": 2, "D": 4,
                         "jct_s": 5000 * (1 + red / 100), "reduction_pct": red,
                         "paper_reduction_pct": paper})
    # a row without reduction_pct: computed from Basic's JCT
    rows.append({"mode": "oracle", "agents": 1024, "P": 2, "D": 4, "jct_s": 2500.0})
    return {"preset": "paper-ablation", "rows": rows, "summary": {}}


def _scale():
    return {"preset": "paper-scale",
            "rows": [{"mode": "dualpath", "agents": 2048, "P": 2, "D": 4, "jct_s": 3100.0,
                      "paper_jct_s": 3167, "rel_error": -0.02},
                     {"mode": "dualpath", "agents": 49152, "P": 48, "D": 96, "jct_s": 3150.0,
                      "paper_jct_s": 3201, "rel_error": -0.016}],
            "summary": {"jct_ratio_large_vs_small": 3150 / 3100}}


def _online():
    rows = [{"mode": mode, "aps": aps, "ttft_s": base * aps ** 2, "tpot_s": 0.02 + 0.005 * aps,
             "ttst_s": 1.0, "jct_s": 100.0}
            for mode, base in (("basic", 0.5), ("dualpath", 0.1)) for aps in (0.5, 1, 2, 4)]
    rows.append({"mode": "dualpath", "aps": 8.0, "ttft_s": None, "tpot_s": 0.06})
    return {"preset": "paper-online", "rows": rows, "summary": {"max_aps_within_slo": 2}}


def _plan(simulated=True):
    cands = [{"P": 1, "D": 2, "ratio": "1/2"}, {"P": 1, "D": 1, "ratio": "1"},
             {"P": 2, "D": 1, "ratio": "2"}, {"P": 3, "D": 1, "ratio": "3"}]
    if simulated:
        for c, jct in zip(cands, (4000.0, 3000.0, 2800.0, 3500.0), strict=True):
            c.update(jct_s=jct, node_seconds=jct * (c["P"] + c["D"]))
    return {"summary": {"pd_min": 1 / 7, "pd_max": 3.5, "pd_range": "1/7 .. 7/2",
                        "feasible": True, "recommended": "1P1D" if simulated else None},
            "range": {"lower": {"value": 1 / 7, "fraction": "1/7"},
                      "upper": {"value": 3.5, "fraction": "7/2"}},
            "candidates": cands, "hardware": {"name": "hopper"}}


@pytest.mark.parametrize("plot, make", [(plot_fig7, _fig7), (plot_ablation, _ablation),
                                        (plot_scale, _scale), (plot_online, _online),
                                        (plot_plan, _plan)])
def test_each_plot_writes_a_png(tmp_path, plot, make):
    out = plot(make(), tmp_path / "sub" / "fig.png")
    assert out == tmp_path / "sub" / "fig.png"
    assert _is_png(out)


@pytest.mark.parametrize("make", [_fig7, _ablation, _scale, _online, _plan])
def test_plot_result_dispatches(tmp_path, make):
    assert _is_png(plot_result(make(), tmp_path / "r.png"))


def test_missing_keys_and_paper_values_are_tolerated(tmp_path):
    fig7 = _fig7()
    for row in fig7["rows"]:
        row.pop("paper_jct_s")
    fig7["rows"][0]["jct_s"] = None
    del fig7["summary"]
    assert _is_png(plot_fig7(fig7, tmp_path / "a.png"))
    assert _is_png(plot_fig7(_fig7(), tmp_path / "lin.png", log_y=False))
    scale = {"preset": "paper-scale", "rows": [{"mode": "dualpath", "jct_s": 3000.0}]}
    assert _is_png(plot_result(scale, tmp_path / "b.png"))
    assert _is_png(plot_result({"preset": "paper-online", "rows": []}, tmp_path / "c.png"))
    assert _is_png(plot_result({"preset": "paper-ablation"}, tmp_path / "d.png"))


def test_plan_without_jct_and_infeasible_range(tmp_path):
    assert _is_png(plot_plan(_plan(simulated=False), tmp_path / "a.png"))
    infeasible = {"summary": {"pd_min": 1e9, "pd_max": 0.5, "feasible": False},
                  "candidates": []}
    assert _is_png(plot_result(infeasible, tmp_path / "b.png"))
    open_upper = _plan()
    open_upper["summary"]["pd_max"] = 1e9
    open_upper["candidates"][0]["in_range"] = False
    assert _is_png(plot_plan(open_upper, tmp_path / "c.png"))


def test_unknown_preset_raises(tmp_path):
    with pytest.raises(ValueError, match="paper-nope"):
        plot_result({"preset": "paper-nope", "rows": []}, tmp_path / "x.png")
    with pytest.raises(ValueError):
        plot_result({"rows": []}, tmp_path / "y.png")
    assert not (tmp_path / "x.png").exists()


def test_png_path_for():
    assert png_path_for("out/fig7.json") == png_path_for("out/fig7.png")
    assert str(png_path_for("out/fig7.json")) == "out/fig7.png"


def test_real_plan_dict_plots(tmp_path):
    from dualpath.sim.planner import plan
    from dualpath.sim.profiles import get_hardware

    result = plan(get_hardware("hopper"), 6, lambda p, d: 1000.0 * (1 + d / p))
    assert _is_png(plot_result(result, png_path_for(tmp_path / "plan.json")))
    assert (tmp_path / "plan.png").exists()
