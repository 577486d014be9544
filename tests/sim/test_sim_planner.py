"""Eq. (9) of the paper and the planner around it."""

from fractions import Fraction

from dualpath.sim.planner import candidates, pd_ratio_range, plan, range_for
from dualpath.sim.profiles import get_hardware


def test_paper_range_is_one_seventh_to_seven_halves():
    r = pd_ratio_range(g=8, s=1, B=50, M=500)
    assert r["lower"] == Fraction(1, 7)
    assert r["upper"] == Fraction(7, 2)
    assert r["feasible"]
    assert r["binding_upper"] == ["de_cnic_write_upper (7)", "de_dram_upper (8)"]
    assert r["terms"]["de_cnic_read_upper (5)"] == 6


def test_hopper_profile_gives_the_same_range():
    r = range_for(get_hardware("hopper"))
    assert (r["lower"], r["upper"]) == (Fraction(1, 7), Fraction(7, 2))


def test_slow_dram_binds():
    r = pd_ratio_range(g=8, s=1, B=50, M=250)
    assert r["upper"] == 1 and r["binding_upper"] == ["de_dram_upper (8)"]


def test_candidates_inside_range_and_plan_recommends():
    cands = candidates(Fraction(1, 7), Fraction(7, 2), max_nodes=6)
    assert (2, 4) not in cands and (1, 2) in cands and (5, 1) not in cands
    out = plan(get_hardware("hopper"), 4, simulate=lambda p, d: 100.0 / (p + 0.5 * d))
    assert out["summary"]["pd_range"] == "1/7 .. 7/2"
    assert out["summary"]["recommended"] == "3P1D"


def test_candidates_skip_pairs_the_model_does_not_fit_and_plan_skips_failed_runs():
    from fractions import Fraction

    from dualpath.sim.planner import candidates, plan
    from dualpath.sim.profiles import get_hardware

    fits = lambda p, d: p >= 2 and d >= 2  # noqa: E731
    pairs = candidates(Fraction(1, 7), Fraction(7, 2), 8, fits)
    assert (2, 4) in pairs and all(p >= 2 and d >= 2 for p, d in pairs)
    assert (1, 2) not in pairs  # ratio 1/2 is represented by 2P4D
    out = plan(get_hardware("hopper"), 8, lambda p, d: None if p == 2 else 100.0 * p, fits)
    assert out["summary"]["recommended"] is not None
    assert not out["summary"]["recommended"].startswith("2P")


def test_plan_beyond_the_range_marks_and_recommends_separately():
    hw = get_hardware("hopper")
    # a simulator that prefers ever more prefill: the best ratio lies past 7/2
    out = plan(hw, 6, simulate=lambda p, d: 100.0 / (p + 0.1 * d), beyond=True)
    rows = {(c["P"], c["D"]): c for c in out["candidates"]}
    assert rows[(5, 1)]["in_range"] is False and rows[(1, 2)]["in_range"] is True
    assert out["summary"]["recommended"] == "5P1D"
    assert out["summary"]["recommended_in_range"] == "3P1D"
    inside = plan(hw, 6, simulate=lambda p, d: 100.0 / (p + 0.1 * d))
    assert all(c["in_range"] for c in inside["candidates"])
    assert "recommended_in_range" not in inside["summary"]


def test_plan_cli_what_if_bandwidths(tmp_path, capsys):
    import json

    from dualpath.cli import main

    path = tmp_path / "plan.json"
    assert main(["plan", "--dram-gbps", "200", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["summary"]["pd_range"] == "1/7 .. 1/2"  # eq. (8) binds
    assert data["hardware"]["dram_bps"] == 200e9 and data["hardware"]["name"] == "hopper*"
    assert main(["plan", "--cnic-gbps", "0"]) == 2
    assert "--cnic-gbps must be positive" in capsys.readouterr().err
