"""The one Weka reader: sessions, their sub-agents as trajectories of their own, and the one
rule the simulator and the token-level workloads both apply to them."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from dualpath.workloads.agents import load_workload
from dualpath.workloads.sim_traces import load_sessions, trace_trajectories
from dualpath.workloads.turns import Request
from dualpath.workloads.weka import read_session, weka_members, weka_sessions


def _req(n_in, out, ids):
    return {"type": "n", "in": n_in, "out": out, "hash_ids": list(ids)}


SESSION = {"block_size": 64, "requests": [
    _req(640, 10, range(10)),
    {"type": "subagent", "agent_id": "agent_001", "requests": [
        _req(256, 4, range(100, 104)), _req(384, 4, range(100, 106)),
        {"type": "subagent", "requests": [_req(64, 1, [900])]}]},  # nested: skipped
    _req(1280, 10, range(20)),
    {"type": "subagent", "requests": [_req(128, 2, [200, 201])]},  # no agent_id
    _req(1920, 10, range(30)),
]}


def _archive(root: Path, sessions) -> Path:
    folder = root / "weka-agentic-dev"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "weka_traces_dev.tar.xz"
    with tarfile.open(path, "w:xz") as tar:
        for i, data in enumerate(sessions, 1):
            raw = json.dumps(data).encode()
            info = tarfile.TarInfo(f"trace_{i:04d}.json")
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    return path


def test_a_session_is_its_top_level_trajectory_and_each_sub_agent_apart():
    s = read_session("trace_0001", SESSION, "here")
    assert s.parent.name == "trace_0001" and s.parent.block == 64
    assert [r.tokens_in for r in s.parent.requests] == [640, 1280, 1920]
    assert [(a.listed_after, a.trajectory.name) for a in s.subagents] == [
        (1, "trace_0001/agent_001"), (2, "trace_0001/subagent2")]
    first = s.subagents[0].trajectory
    assert first.requests == (Request(256, 4, tuple(range(100, 104))),
                              Request(384, 4, tuple(range(100, 106))))
    # the rule: sub-agents listed before the parent's first dropped turn
    assert s.subagents_within(0) == []
    assert [t.name for t in s.subagents_within(1)] == ["trace_0001/agent_001"]
    assert len(s.subagents_within(3)) == 2


def test_the_simulator_and_the_token_workloads_apply_the_same_sub_agent_rule(tmp_path):
    _archive(tmp_path, [SESSION])
    assert len(load_sessions("weka", root=tmp_path)) == 1
    parent, sub1, sub2 = load_sessions("weka", root=tmp_path, subagents=True)
    assert [len(parent), len(sub1), len(sub2)] == [3, 2, 1]
    assert sub1[1].hit == 256  # its hits come from its own previous request
    # the parent stops before its second request: only the sub-agent listed before it stays
    sims = trace_trajectories("weka", 2, root=tmp_path, subagents=True, max_context=1000)
    assert sims == [parent[:1], sub1]
    for subagents in (False, True):
        tokens = load_workload("weka", vocab_size=1000, trace_dir=tmp_path, scale=1,
                               max_context=1000, subagents=subagents)
        expected = sims if subagents else sims[:1]
        assert tokens.sim_turns() == expected


def test_archive_members_stream_in_order_and_bad_sub_agents_are_named(tmp_path):
    bad = {"requests": [_req(64, 1, [1]), {"type": "subagent", "requests": [{"in": 5}]}]}
    path = _archive(tmp_path, [SESSION, bad])
    stream = weka_sessions(weka_members(path), str(path))
    assert next(stream).parent.name == "trace_0001"
    with pytest.raises(ValueError, match=r"trace_0002\.json: not a Weka session"):
        next(stream)
    with pytest.raises(ValueError, match=r"trace_0002\.json"):
        load_sessions("weka", root=tmp_path)
