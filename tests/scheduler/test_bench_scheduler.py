"""``dualpath bench scheduler``: runs end to end, and schedules a whole 48P96D view.

Its speed (decisions/s) is a benchmark figure (docs/results.md: the global scheduler), not a test: a
timing floor here fails on a busy or slow CI host without anything being wrong.
"""

from __future__ import annotations

import json

from rich.progress import Progress

from dualpath.bench.scheduler import SimSetup, run_policy
from dualpath.cli import main
from dualpath.scheduler import SchedulerParams


def test_bench_scheduler_writes_summary(tmp_path):
    out = tmp_path / "scheduler.json"
    args = ["bench", "scheduler", "--json", str(out), "--prefill-nodes", "2",
            "--decode-nodes", "3", "--engines-per-node", "2", "--requests", "300"]
    assert main(args) == 0
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert summary["decisions_per_s"] > 0 and summary["policy"] == "dualpath"
    assert summary["round_robin_decisions_per_s"] > 0
    assert all(run["decisions"] == 300 for run in result["runs"])
    assert out.with_suffix(".png").is_file()


def test_bench_scheduler_rejects_an_unknown_policy(tmp_path, capsys):
    args = ["bench", "scheduler", "--json", str(tmp_path / "x.json"), "--requests", "1",
            "--policies", "random", "--no-png"]
    assert main(args) == 2
    assert "policy" in capsys.readouterr().err


def test_every_request_is_placed_on_a_48p96d_view():
    setup = SimSetup(requests=3000)  # the full 48P96D × 8 view, fewer requests
    params = SchedulerParams.from_rates(setup.read_tokens_per_s, setup.prefill_tokens_per_s)
    with Progress(disable=True) as progress:
        run = run_policy(setup, params, progress)
    assert run["decisions"] == 3000
    assert run["decisions_per_s"] > 0 and run["calls"] < 3000  # batches, not one call a request
