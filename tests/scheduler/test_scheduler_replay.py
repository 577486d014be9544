"""Replay: a recorded sequence of views and requests yields the recorded assignments.

``data/replay_log.json`` was recorded by running this file as a script (``python
tests/scheduler/test_scheduler_replay.py``) on a small simulated cluster (2 prefill nodes, 3
decode nodes, 2 engines each, scarce decode memory so requests wait holding their PE, some
calls with only a subset of groups fetching), once per policy. The simulator reuses such logs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from dualpath.bench.scheduler import SimCluster, SimSetup, make_requests
from dualpath.scheduler import Assignment, GlobalScheduler, SchedulerParams, replay

LOG = Path(__file__).with_name("data") / "replay_log.json"
SETUP = SimSetup(prefill_nodes=2, decode_nodes=3, engines_per_node=2, requests=48,
                 min_tokens=1024, max_tokens=8192, prefill_tokens_per_s=4000,
                 read_tokens_per_s=4000, de_kv_tokens=12_000, decode_s=2.0, round_s=0.5,
                 seed=7)
PARAMS = {
    "dualpath": SchedulerParams.from_rates(4000, 4000, alpha_s=1.0, beta_s=3.0),
    "dualpath_split": SchedulerParams.from_rates(4000, 4000, alpha_s=1.0, beta_s=3.0,
                                                 split_read=True),
    "round_robin": SchedulerParams.from_rates(4000, 4000, beta_s=3.0, policy="round_robin"),
}


def record(params: SchedulerParams, steps: int = 24, per_step: int = 3) -> dict[str, Any]:
    """Run the small simulated cluster under ``params``; the scheduler's log."""
    cluster = SimCluster(SETUP)
    scheduler = GlobalScheduler(params, record=True)
    requests = make_requests(SETUP)
    for step in range(steps):
        for req in requests[step * per_step:(step + 1) * per_step]:
            scheduler.submit(req)
        fetching = ["g000", "g003", "g004"] if step % 4 == 3 else None
        for a in scheduler.schedule(cluster.view(), fetching):
            cluster.apply(a, requests[a.req_id].num_tokens)
        cluster.advance()
    assert scheduler.log is not None
    return scheduler.log


def _recorded(log: dict[str, Any]) -> list[list[Assignment]]:
    return [[Assignment.from_dict(a) for a in step["assignments"]] for step in log["steps"]]


def _stored() -> dict[str, dict[str, Any]]:
    return json.loads(LOG.read_text())["runs"]


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_stored_log_replays_to_the_recorded_assignments(name):
    log = _stored()[name]
    assert replay(log) == _recorded(log)


def test_stored_logs_exercise_the_interesting_cases():
    runs = _stored()
    for name, log in runs.items():
        steps = log["steps"]
        assert sum(len(s["assignments"]) for s in steps) >= 30, name
        assert any(s["fetching"] for s in steps), name
        submitted = sum(len(s["submit"]) for s in steps)
        assert submitted > sum(len(s["assignments"]) for s in steps), name  # some still queue
    paths = {a["read_path"] for s in runs["dualpath_split"]["steps"] for a in s["assignments"]}
    assert "split" in paths
    paths = {a["read_path"] for s in runs["dualpath"]["steps"] for a in s["assignments"]}
    assert paths == {"pe", "de"}


def test_a_fresh_recording_is_json_safe_and_replays():
    log = json.loads(json.dumps(record(PARAMS["dualpath"], steps=10)))
    assert replay(log) == _recorded(log)


def main() -> None:
    """Record the logs again (after a deliberate change of the scheduler's behaviour)."""
    runs = {name: record(params) for name, params in PARAMS.items()}
    LOG.parent.mkdir(exist_ok=True)
    LOG.write_text(json.dumps({"runs": runs}, separators=(",", ":")) + "\n")
    print(f"wrote {LOG} ({LOG.stat().st_size} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
