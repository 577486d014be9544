"""Trace loaders: hit rule, grouping, copies, truncation, errors; real traces when present."""

import io
import json
import re
import tarfile
from itertools import pairwise
from pathlib import Path

import pytest

from dualpath.workloads.sim_traces import load_sessions, trace_summary, trace_trajectories
from dualpath.workloads.trace_files import ENV_DIR, TRACES, trace_dir
from dualpath.workloads.turns import Turn

HAVE_TRACES = all((trace_dir() / sub).is_dir()
                  for sub in ("weka-agentic-dev", "mooncake-synthetic"))
real = pytest.mark.skipif(not HAVE_TRACES, reason=f"no traces under {trace_dir()}")


def _req(n_in, out, ids, kind="n"):
    return {"t": 0.0, "type": kind, "in": n_in, "out": out, "hash_ids": ids}


SESSION_A = {"id": "a", "block_size": 64, "requests": [
    _req(640, 50, list(range(1, 11))),
    _req(1000, 0, list(range(1, 16)), kind="s"),
    {"t": 5.0, "type": "subagent", "requests": [_req(9000, 9, list(range(500, 640)))]},
    _req(300, 7, [1, 2, 3, 99]),  # compaction: the context shrinks to 3 shared blocks
    _req(256, 7, [1, 2, 3, 99]),  # same 4 full blocks: one token must still be computed
]}
SESSION_B = {"id": "b", "block_size": 64, "requests": [_req(5000, 20, list(range(78)))]}


def _write_weka(root: Path, sessions) -> None:
    folder = root / "weka-agentic-dev"
    folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(folder / "weka_traces_dev.tar.xz", "w:xz") as tar:
        for i, data in enumerate(sessions, 1):
            raw = json.dumps(data).encode()
            info = tarfile.TarInfo(f"trace_{i:04d}.json")
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))


def _write_mooncake(root: Path, rows) -> None:
    folder = root / "mooncake-synthetic"
    folder.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"timestamp": i, "input_length": n, "output_length": out,
                         "hash_ids": ids}) for i, (n, out, ids) in enumerate(rows)]
    (folder / "synthetic_trace.jsonl").write_text("\n".join(lines) + "\n")


@pytest.fixture
def root(tmp_path):
    _write_weka(tmp_path, [SESSION_A, SESSION_B])
    _write_mooncake(tmp_path, [(1500, 10, [1, 2, 3]), (1000, 0, [7, 8]),
                               (2000, 5, [1, 2, 3, 4]), (1300, 5, [1, 2, 9])])
    return tmp_path


def test_weka_hits_follow_the_previous_request(root):
    a, b = load_sessions("weka", root=root)
    assert a == [Turn(640, 0, 50), Turn(1000, 640, 1), Turn(300, 192, 7), Turn(256, 192, 7)]
    assert b == [Turn(5000, 0, 20)]


def test_weka_subagents_are_trajectories_of_their_own_when_asked(root):
    a, sub, b = load_sessions("weka", root=root, subagents=True)
    assert a == load_sessions("weka", root=root)[0]
    assert sub == [Turn(9000, 0, 9)] and b == [Turn(5000, 0, 20)]
    trajs = trace_trajectories("weka", 3, root=root, subagents=True, max_context=10_000)
    assert trajs == [a, sub, b]


def test_weka_limit_stops_early_then_reads_all(root):
    assert len(load_sessions("weka", limit=1, root=root)) == 1
    assert len(load_sessions("weka", root=root)) == 2
    assert load_sessions("weka", limit=0, root=root) == []


def test_mooncake_groups_by_longest_shared_prefix(root):
    convs = load_sessions("mooncake", root=root)
    assert convs == [[Turn(1500, 0, 10), Turn(2000, 1536, 5), Turn(1300, 1024, 5)],
                     [Turn(1000, 0, 1)]]


def test_copies_get_a_synthetic_first_turn_and_follow_the_seed(root):
    sessions = load_sessions("weka", root=root)
    trajs = trace_trajectories("weka", 12, seed=3, block_size=32, root=root)
    assert trajs[:2] == sessions
    for copy in trajs[2:]:
        assert copy[0] == Turn(32, 0, 1) and copy[1:] in sessions
    assert trace_trajectories("weka", 12, seed=3, block_size=32, root=root) == trajs
    others = [trace_trajectories("weka", 12, seed=s, block_size=32, root=root)
              for s in range(4, 8)]
    assert any(o != trajs for o in others)
    assert trace_trajectories("weka", 1, root=root) == sessions[:1]
    assert trace_trajectories("weka", 0, root=root) == []


def test_max_context_truncates_and_drops_empty_sessions(root):
    trajs = trace_trajectories("weka", 3, max_context=1000, root=root)
    assert trajs[0] == [Turn(640, 0, 50)]  # the next turn needs 1000 + 1 tokens
    # session b (5020 tokens) cannot fit: the third agent copies session a, truncated
    assert trajs[1] == [Turn(64, 0, 1), *trajs[0]] == trajs[2]
    with pytest.raises(ValueError, match="max_context"):
        trace_trajectories("weka", 2, max_context=500, root=root)
    with pytest.raises(ValueError, match="block_size"):
        trace_trajectories("weka", 2, max_context=64, root=root)


def test_summary():
    s = trace_summary([[Turn(100, 0, 10), Turn(200, 100, 20)], [Turn(100, 50, 30)]])
    assert s["agents"] == 2 and s["turns"] == 3 and s["turns_max"] == 2
    assert s["turns_mean"] == 1.5 and s["gen_mean"] == 20
    assert s["prompt_mean"] == pytest.approx(400 / 3) and s["hit_rate"] == pytest.approx(0.375)
    assert trace_summary([])["hit_rate"] == 0


def test_errors_name_the_problem(root, tmp_path):
    with pytest.raises(ValueError, match="unknown trace 'azure'"):
        load_sessions("azure", root=root)
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError, match=re.escape(str(missing))):
        load_sessions("weka", root=missing)
    with pytest.raises(ValueError, match=r"synthetic_trace\.jsonl"):
        load_sessions("mooncake", root=tmp_path / "weka-agentic-dev")
    with pytest.raises(ValueError, match="agents"):
        trace_trajectories("weka", -1, root=root)


def test_bad_data_is_a_value_error(tmp_path):
    _write_weka(tmp_path, [{"id": "x", "requests": [{"type": "n", "in": 5}]}])
    with pytest.raises(ValueError, match=r"trace_0001\.json"):
        load_sessions("weka", root=tmp_path)


def test_trace_dir_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    assert trace_dir() == tmp_path
    monkeypatch.delenv(ENV_DIR)
    with pytest.raises(ValueError, match=f"--trace-dir.*{ENV_DIR}"):
        trace_dir()  # no folder outside the repository is guessed


def _valid(trajs):
    return all(t.prompt > t.hit >= 0 and t.gen >= 1 for traj in trajs for t in traj)


@real
def test_real_weka_sessions():
    sessions = load_sessions("weka", limit=5)
    assert len(sessions) == 5 and all(sessions) and _valid(sessions)
    assert all(t.hit % 64 == 0 for s in sessions for t in s)
    assert all(s[0].hit == 0 for s in sessions)
    assert trace_summary(sessions)["hit_rate"] > 0.8
    # a compaction: the context shrinks and only the shared system/tool prefix hits
    assert any(b.prompt < a.prompt and b.hit < b.prompt / 2
               for s in sessions for a, b in pairwise(s))


@real
def test_real_mooncake_conversations():
    convs = load_sessions("mooncake")
    assert sum(len(c) for c in convs) == 3993 and _valid(convs)
    assert all(t.hit % 512 == 0 for c in convs for t in c)
    assert max(len(c) for c in convs) > 1
    assert 0.3 < trace_summary(convs)["hit_rate"] < 0.9


@real
def test_real_trajectories_are_deterministic():
    for name in TRACES:
        a = trace_trajectories(name, 5, seed=1, max_context=131_072)
        assert len(a) == 5 and _valid(a)
        assert all(t.prompt + t.gen <= 131_072 for traj in a for t in traj)
        assert a == trace_trajectories(name, 5, seed=1, max_context=131_072)
