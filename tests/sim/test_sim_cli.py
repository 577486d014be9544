"""``dualpath sim`` options: the baselines' batcher and bad combinations."""

import pytest

from dualpath.cli import main, parse
from dualpath.sim.commands import SimOptions, _paper_base
from dualpath.sim.presets import DS660B, DS660B_QUOTA_ALL


def _args(**kw):
    base = {"preset": "paper-fig7", "baseline_batcher": None, "token_budget": None,
            "read_queue": None, "storage_eff": None, "basic_prefetch": False,
            "lengths": None}
    return SimOptions(**{**base, **kw})


def test_paper_base_applies_the_batcher_options():
    assert _paper_base(_args(baseline_batcher="stock")) == DS660B
    assert _paper_base(_args(baseline_batcher="quota")) == DS660B_QUOTA_ALL
    assert _paper_base(_args(token_budget=4096)).token_budget == 4096
    assert _paper_base(_args(read_queue="shared")).read_streams is None
    assert _paper_base(_args(read_queue="fifo")).read_streams == DS660B.read_streams == 1


def test_paper_base_is_none_without_paper_options():
    assert _paper_base(_args()) is None
    assert _paper_base(_args(preset="testbed")) is None


def test_paper_base_applies_the_storage_what_ifs():
    assert _paper_base(_args(storage_eff=0.6)).storage_eff == 0.6
    assert DS660B.storage_eff == 0.8 and not DS660B.basic_prefetch
    assert _paper_base(_args(basic_prefetch=True)).basic_prefetch
    assert _paper_base(_args(lengths="varied")).workload.lengths == "varied"
    assert DS660B.workload.lengths == "same"


@pytest.mark.parametrize("argv, needle", [
    (["--preset", "paper-fig7", "--token-budget", "0"], "--token-budget must be positive"),
    (["--preset", "paper-fig7", "--storage-eff", "1.5"], "--storage-eff must be in (0, 1]"),
    (["--preset", "testbed", "--testbed", "p.json", "--basic-prefetch"],
     "apply to the paper presets"),
    (["--preset", "testbed", "--testbed", "p.json", "--baseline-batcher", "quota"],
     "apply to the paper presets"),
    (["--preset", "paper-scale", "--agents", "8"], "--agents applies to"),
])
def test_bad_combinations_are_named(argv, needle, capsys):
    assert main(["sim", *argv]) == 2
    assert needle in capsys.readouterr().err


# -- what the commands print: tables, and the JSON only in --json ---------------------------

def _no_json_dump(out: str) -> bool:
    return not any(line.lstrip().startswith(("{", '"')) for line in out.splitlines())


def test_sim_prints_a_table_and_writes_nothing_without_json(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["sim", "--preset", "paper-fig7", "--agents", "4", "--workload", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "Fig. 7: offline JCT, 2P4D, tiny workload" in out and "speedup" in out
    assert _no_json_dump(out) and "max_rel_error_vs_paper" not in out
    assert list(tmp_path.iterdir()) == []


def test_sim_json_holds_the_full_result_and_the_table_its_numbers(tmp_path, capsys):
    import json

    from dualpath.sim.report import fmt_s

    path = tmp_path / "out" / "abl.json"
    argv = ["sim", "--preset", "paper-ablation", "--agents", "4", "--workload", "tiny",
            "--json", str(path)]
    assert main(argv) == 0
    data = json.loads(path.read_text())
    assert "summary" in data and "reduction_pct_mean" in data["summary"]
    assert path.with_suffix(".png").exists()
    out = capsys.readouterr().out
    assert "Ablation: offline JCT" in out and _no_json_dump(out)
    basic = next(r for r in data["rows"] if r["mode"] == "basic")
    row = next(line for line in out.splitlines() if line.strip().startswith("4 "))
    assert fmt_s(basic["jct_s"]) in row
    assert f"wrote {path}" in out.replace("\n", "")


def test_sim_testbed_prints_the_predicted_and_the_real_ratio(tmp_path, capsys):
    import json

    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({
        "model": "smol", "cost_model": {"a": 1e-6, "b": 0.5, "c": 2.0}, "machine": {"cpus": 2},
        "summary": {"prefill_tokens_per_s": 2000.0, "read_tokens_per_s": 300.0,
                    "kv_bytes_per_token": 23_040, "kv_capacity_tokens": 40_000,
                    "decode_step_ms": [20.0, 2.0]}}))
    real = tmp_path / "bench.json"
    real.write_text(json.dumps({"workload": {"agents": 4}, "summary": {
        "jct_s": {"basic": 100.0, "dualpath": 60.0}, "dualpath_vs_basic_jct_ratio": 0.6}}))
    result = run_sim_cli(["sim", "--preset", "testbed", "--testbed", str(profile),
                          "--agents", "4", "--real", str(real)])
    out = capsys.readouterr().out
    ratio = result["summary"]["dualpath_vs_basic_jct_ratio"]["4"]
    row = next(line for line in out.splitlines() if line.strip().startswith("4 "))
    assert f"{ratio:.3f}" in row and "0.600" in row
    assert "dualpath / basic" in out and _no_json_dump(out)


def run_sim_cli(argv):
    """``run_sim`` on parsed ``argv``: the result dict it returns (unchanged by printing)."""
    from dualpath.sim.commands import run_sim

    return run_sim(parse(argv)[1])


def test_plan_prints_the_candidates_and_the_range(capsys):
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    assert "P/D candidates: ds660b on hopper" in out and "DE DRAM (8)" in out
    assert "eq. 9: 1/7 ≤ P/D ≤ 7/2" in out and _no_json_dump(out)


def test_plan_table_shows_each_candidates_simulated_jct(monkeypatch, capsys):
    from dualpath.sim.plan_command import run_plan
    from dualpath.sim.report import fmt_s

    def fake_simulate(cfg, progress=None):
        return {"jct_s": 1000.0 + 100 * cfg.prefill_nodes + 10 * cfg.decode_nodes}

    monkeypatch.setattr("dualpath.sim.cluster.simulate", fake_simulate)
    result = run_plan(parse(
        ["plan", "--model", "ds27b", "--workload", "64k", "--max-nodes", "4", "--beyond"])[1])
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(result["candidates"]) >= 4
    for c in result["candidates"]:
        line = next(x for x in lines if x.split()[:3] == [str(c["P"]), str(c["D"]), c["ratio"]])
        assert fmt_s(c["jct_s"]) in line, line
    assert result["summary"]["recommended"] == "1P1D"  # least JCT x nodes: 1,110 s x 2
    assert "recommended" in next(x for x in lines if x.split()[:3] == ["1", "1", "1"])


def test_plan_with_a_real_tiny_simulation(capsys):
    assert main(["plan", "--model", "ds27b", "--workload", "tiny", "--agents", "2",
                 "--max-nodes", "3"]) == 0
    out = capsys.readouterr().out
    assert "JCT" in out and "node-s" in out and "recommended" in out and _no_json_dump(out)
