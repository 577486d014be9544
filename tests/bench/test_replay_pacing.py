"""The replay's pacing (``bench/replay.py: Pacing``): tool times, a bound on the agents at
once, sessions; and ``bench retention``'s working-set count."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import pytest

from dualpath.bench.replay import Pacing, run_turns
from dualpath.bench.sessions import (
    SessionsOptions,
    build_summary,
    rows_for,
    skip_agents,
    turn_shares,
    working_set_blocks,
)
from dualpath.workloads.turns import AgentTurn


@dataclass
class _Out:
    output_ids: list[int]
    num_hit_tokens: int = 0
    num_computed_tokens: int = 0
    read_path: str = "pe"
    num_attempts: int = 1
    timings: dict | None = None


class FakeCluster:
    """Answers each request after ``serve_s`` from a thread; records what it was sent."""

    def __init__(self, serve_s: float = 0.02) -> None:
        self.serve_s = serve_s
        self.sent: list[tuple[float, list[int], object]] = []
        self.running = 0
        self.most_running = 0
        self._lock = threading.Lock()

    def submit(self, prompt, params, mode=None, on_tokens=None, session=None):
        future: Future = Future()
        with self._lock:
            self.sent.append((time.perf_counter(), list(prompt), session))
        threading.Thread(target=self._answer, args=(future, params.max_tokens, on_tokens),
                         daemon=True).start()
        return future

    def _answer(self, future: Future, count: int, on_tokens) -> None:
        with self._lock:
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        time.sleep(self.serve_s)
        with self._lock:
            self.running -= 1
        on_tokens(tuple(range(count)))
        future.set_result(_Out(list(range(count))))

    def abort(self, future) -> None:
        future.cancel()


def agent(*thinks: float) -> list[AgentTurn]:
    return [AgentTurn([1, 2, 3], 2, think_s=t) for t in thinks]


def test_a_turn_waits_its_scaled_tool_time_capped_and_the_first_never_waits():
    cluster = FakeCluster()
    run_turns(cluster, [agent(9.0, 0.1, 9.0)], "dualpath",
              pacing=Pacing(think_factor=2.0, max_think_s=0.3))
    times = [t for t, _, _ in cluster.sent]
    assert times[1] - times[0] >= 0.02 + 0.2 - 0.01  # served, then 0.1 s x 2
    assert 0.02 + 0.3 - 0.01 <= times[2] - times[1] < 2.0  # 9 s x 2, capped at 0.3 s


def test_without_pacing_tool_times_are_not_waited():
    cluster = FakeCluster()
    began = time.perf_counter()
    run_turns(cluster, [agent(9.0, 9.0)], "dualpath")
    assert time.perf_counter() - began < 1.0
    assert all(session is None for _, _, session in cluster.sent)


def test_at_most_max_agents_run_and_every_agent_ends():
    cluster = FakeCluster(serve_s=0.05)
    row = run_turns(cluster, [agent(0, 0) for _ in range(5)], "dualpath",
                    pacing=Pacing(max_agents=2))
    assert cluster.most_running == 2 and row["turns"] == 10


def test_each_agent_names_its_session_and_ends_it_on_its_last_turn():
    cluster = FakeCluster()
    run_turns(cluster, [agent(0, 0, 0), agent(0)], "dualpath", pacing=Pacing(sessions=True))
    by_session: dict[str, list] = {}
    for _, _, session in cluster.sent:
        by_session.setdefault(session.session_id, []).append(session)
    assert sorted(map(len, by_session.values())) == [1, 3]
    for turns in by_session.values():
        ends = [s.hint is not None and s.hint.end_of_session for s in turns]
        assert ends == [False] * (len(turns) - 1) + [True]


def test_hinted_turns_say_their_tool_time_and_unended_sessions_their_return():
    """With ``hint_returns`` each turn but the last hints the tool time the replay waits
    next; without ending, agent i's last turn hints ``returns_s[i]`` (the primers)."""
    cluster = FakeCluster()
    run_turns(cluster, [agent(0, 0.05, 9.0)], "dualpath",
              pacing=Pacing(1.0, 0.1, sessions=True, hint_returns=True))
    hints = [session.hint for _, _, session in cluster.sent]
    assert [h.next_turn_in_s for h in hints[:2]] == [0.05, 0.1]  # capped like the wait
    assert hints[2].end_of_session and hints[2].next_turn_in_s is None
    cluster = FakeCluster()
    run_turns(cluster, [agent(0), agent(0), agent(0)], "dualpath",
              pacing=Pacing(sessions=True, end_sessions=False, returns_s=(10.0, 20.0)))
    by_id = {session.session_id: session.hint for _, _, session in cluster.sent}
    assert [by_id[k] and by_id[k].next_turn_in_s for k in sorted(by_id)] == [10.0, 20.0, None]
    assert not any(h and h.end_of_session for h in by_id.values())


def test_a_queued_agent_hints_a_slot_per_round_ahead_of_it():
    from dualpath.bench.sessions import queue_returns

    assert queue_returns(5, 2, 10.0) == (10.0, 10.0, 20.0, 20.0, 30.0)
    assert queue_returns(2, 0, 1.0) == (1.0, 2.0)
    with pytest.raises(ValueError, match="queue-slot-s"):
        SessionsOptions(queue_slot_s=0)


def test_a_restored_copy_of_the_primers_looks_just_stored(tmp_path):
    """Every retention row starts from the same stored primers, moved to now: block files'
    recency and the marks' times shift alike; a row without hints forgets the returns."""
    import os

    from dualpath.bench.sessions import PRIMED_AT, restore_primed
    from dualpath.kv.retention import NS_PER_S, SessionMark

    kept = tmp_path / "kept"
    (kept / "m" / "aa").mkdir(parents=True)
    (kept / ".sessions").mkdir()
    block = kept / "m" / "aa" / "aa01.kvb"
    block.write_bytes(b"x")
    made_ns = 1_000 * NS_PER_S
    os.utime(block, ns=(made_ns - 5 * NS_PER_S,) * 2)
    mark = SessionMark(b"\xaa", made_ns - NS_PER_S, made_ns + 300 * NS_PER_S,
                       return_ns=made_ns + 20 * NS_PER_S)
    (kept / ".sessions" / "s.mark").write_bytes(mark.to_json())
    (kept / PRIMED_AT).write_text(str(made_ns))
    for hints in (True, False):
        store = tmp_path / f"store-{hints}"
        before = time.time_ns()
        restore_primed(kept, store, hints)
        shift = (store / "m" / "aa" / "aa01.kvb").stat().st_mtime_ns + 5 * NS_PER_S - made_ns
        assert before - made_ns <= shift <= time.time_ns() - made_ns
        moved = SessionMark.from_json((store / ".sessions" / "s.mark").read_bytes())
        assert moved.seen_ns == mark.seen_ns + shift
        assert moved.live_until_ns == mark.live_until_ns + shift
        assert moved.return_ns == (mark.return_ns + shift if hints else 0)


def test_the_working_set_counts_shared_prefixes_once_and_outputs_as_stored():
    primer = AgentTurn(list(range(8)), 1, keep=0)  # 2 blocks of 4
    turns = [AgentTurn([*range(8), 50, 51], 3, keep=0),  # 10 + 3 - 1 = 12: 3 blocks
             AgentTurn([60, 61, 62], 2)]  # 13 + 3 + 2 - 1 = 17 (keeps all): 4 blocks
    assert working_set_blocks([turns], [primer], 4) == 4
    other = [AgentTurn(list(range(8)), 1, keep=0)]  # another agent on the same prefix
    assert working_set_blocks([turns, other], [primer, AgentTurn(list(range(8)), 1)], 4) == 4
    compacted = [*turns, AgentTurn([70, 71, 72, 73], 1, keep=4)]  # forks after one block
    assert working_set_blocks([compacted], [primer], 4) == 5


def test_the_summary_compares_warm_with_cold_and_sessions_with_recency():
    rows = {p: {"hit_rate": h, "jct_s": j, "ttft_p50_s": t, "ttft_p90_s": 2 * t,
                "warm_hit_share": w, "evicted": {"live_evicted_before_ended": n},
                **turn_shares([{}] * 10, 4, 1)}
            for p, h, j, t, w, n in (("cold", 0.9, 30.0, 2.0, 0.0, 0),
                                     ("warm", 0.9, 20.0, 0.5, 0.8, 0),
                                     ("recency", 0.5, 20.0, 1.0, 0.0, 40),
                                     ("sessions", 0.7, 10.0, 1.0, 0.0, 0),
                                     ("hints", 0.8, 8.0, 1.0, 0.0, 0))}
    summary = build_summary(rows)
    assert summary["hit_rate_gain_points_hints"] == pytest.approx(30.0)
    assert summary["jct_speedup_hints"] == 2.5
    assert summary["ttft_p50_reduction"] == pytest.approx(0.75)
    assert summary["jct_speedup_warm"] == 1.5 and summary["warm_hit_share"] == 0.8
    assert summary["prefetch_turn_share"] == 0.1 and "local_share" not in summary
    online = {"cold-online": {"capacity_aps": 0.2, "ttft_slo_s": 1.0},
              "local-online": {"capacity_aps": 0.3, "ttft_slo_s": 1.0}}
    assert build_summary(online)["aps_speedup_local"] == pytest.approx(1.5)
    online["cold-online"]["capacity_aps"] = None  # even the lowest APS missed the SLO
    assert build_summary(online)["aps_speedup_local"] is None
    rows["local"] = {**rows["warm"], "ttft_p50_s": 0.4}
    summary = build_summary(rows)
    assert summary["ttft_p50_reduction_local"] == pytest.approx(0.8)
    assert summary["local_share"] == 0.4
    assert summary["hit_rate_gain_points"] == pytest.approx(20.0)
    assert summary["jct_speedup_sessions"] == 2.0
    assert summary["live_evicted_before_ended_recency"] == 40
    assert "hit_rate_gain_points" not in build_summary({k: rows[k] for k in ("cold", "warm")})


def test_unseen_sessions_are_the_workloads_later_agents_with_their_primers():
    from dualpath.workloads.agents import Workload

    agents = [agent(i, 2) for i in range(4)]
    primers = [AgentTurn([i], 1, keep=0) for i in range(4)]
    workload = Workload("w", agents, 4, {}, primers)
    later = skip_agents(workload, 3)
    assert later.agents == agents[3:] and later.primers == primers[3:]
    assert skip_agents(workload, 0) is workload
    with pytest.raises(ValueError, match="leaves none"):
        skip_agents(workload, 4)


def test_the_rows_differ_only_in_what_each_experiment_compares():
    rows = rows_for(SessionsOptions(store_fraction=0.4, warm_session_mb=64))
    assert [(r.name, r.store_fraction, r.session_retention, r.warm_session_mb, r.prefetch,
             r.local_prefill_tokens, r.hints) for r in rows] == [
        ("cold", None, True, 0.0, False, 0, False), ("warm", None, True, 64, True, 0, False),
        ("local", None, True, 64, True, 512, False),
        ("dualpath-api", None, True, 64, False, 0, False),
        ("vllm-api", None, True, 0.0, False, 0, False),
        ("recency", 0.4, False, 0.0, False, 0, False),
        ("sessions", 0.4, True, 0.0, False, 0, False),
        ("hints", 0.4, True, 0.0, False, 0, True),
        ("cold-online", None, True, 0.0, False, 0, False),
        ("local-online", None, True, 64, True, 512, False)]


def test_an_online_search_paces_its_agents_and_starts_where_it_is_told():
    """Each trial's agents arrive by their Poisson offsets and run with the pacing given
    (their tool times and sessions); the first trial is at ``first_aps``, the next one up
    while the SLO holds; a run without pacing is called as before."""
    from types import SimpleNamespace

    from dualpath.bench.agents.online import STEP, search_capacity
    from dualpath.bench.replay import Pacing

    class Run:
        def __init__(self):
            self.calls = []

        def empty(self):
            pass

        def run(self, agents, offsets, progress, timeout_s, cut_after_s=None, **kw):
            self.calls.append(kw)
            return [{"submitted_s": o, "ttft_s": 0.5, "ttst_s": 0.6, "tpot_s": 0.1}
                    for o in offsets], 10.0

    bar = SimpleNamespace(add_task=lambda *a, **k: 0, update=lambda *a, **k: None,
                          advance=lambda *a, **k: None)
    options = SimpleNamespace(ttft_slo_s=1.0, online_trials=2, prime_first_turns=False,
                              seed=0, timeout_s=60.0)
    pacing = Pacing(1.0, 4.0, None, True)
    run = Run()
    got = search_capacity(run, "local", [agent(0, 1)] * 3, options, None, bar, pacing=pacing,
                          first_aps=0.25)
    assert [t["aps"] for t in got["trials"]] == [0.25, 0.25 * STEP]
    assert run.calls == [{"pacing": pacing}] * 2 and got["capacity_aps"] == 0.25 * STEP
    plain = Run()
    search_capacity(plain, "basic", [agent(0, 1)] * 3, options, {"jct_s": 30.0}, bar)
    assert plain.calls == [{}, {}]


@pytest.mark.parametrize("bad", [{"store_fraction": 0}, {"store_fraction": 1.5},
                                 {"max_agents": 0}, {"experiments": ("warm", "nope")},
                                 {"online_trials": 0}, {"first_aps": 0}, {"ttft_slo_s": -1},
                                 {"skip_agents": -1},
                                 {"experiments": ()}])
def test_bad_options_are_refused(bad):
    with pytest.raises(ValueError):
        SessionsOptions(**bad)


def test_a_primer_opens_each_trajectory_and_only_the_timed_turns_are_counted():
    from types import SimpleNamespace

    from dualpath.bench.sessions import timed_only, with_primers

    primer = AgentTurn([1, 2], 1, keep=0)
    workload = SimpleNamespace(agents=[agent(0, 1)], primer_turns=lambda: [primer])
    assert with_primers(workload) == [[primer, *workload.agents[0]]]
    records = [{"agent": 0, "turn": t} for t in range(3)]
    assert timed_only(records) == [{"agent": 0, "turn": 0}, {"agent": 0, "turn": 1}]


def test_the_report_prints_each_experiment_and_writes_json_and_a_png(tmp_path):
    import json

    from rich.console import Console

    from dualpath.bench.sessions_report import print_report, write_report

    evicted = {"blocks_evicted": 3, "live_blocks_evicted": 0, "ended_blocks_evicted": 3,
               "live_evicted_before_ended": 0}
    rows = {name: {"row": name, "experiment": exp, "hit_rate": 0.9, "warm_hit_share": 0.5,
                   "jct_s": 10.0, "ttft_p50_s": 0.3, "ttft_p90_s": 0.6, "evicted": evicted,
                   **turn_shares([{}] * 4, 3, 1)}
            for name, exp in (("cold", "warm"), ("warm", "warm"), ("recency", "retention"),
                              ("sessions", "retention"), ("hints", "retention"),
                              ("cold-online", "online"),
                              ("local-online", "online"))}
    for name, aps in (("cold-online", None), ("local-online", 0.31)):
        rows[name].update(capacity_aps=aps, ttft_slo_s=1.0,
                          trials=[{"aps": 0.2, "meets_slo": aps is not None}])
    result = {"summary": {**build_summary(rows), "regime": {"store_fraction": 0.5}},
              "rows": rows}
    console = Console(record=True, width=140)
    print_report(result, console)
    text = console.export_text()
    assert "DRAM copies and prefetch" in text and "50% of the working set" in text
    assert "sessions vs recency: hit rate +0.0 points" in text
    assert "sessions with hinted returns vs recency: hit rate +0.0 points" in text
    assert "on its DE" in text and "75%" in text and "prefetched" in text
    assert "0.310" in text and "below the lowest" in text and "0.20+" in text
    write_report(result, tmp_path / "s.json", console)
    assert json.loads((tmp_path / "s.json").read_text())["summary"]["jct_speedup_warm"] == 1.0
    assert (tmp_path / "s.png").stat().st_size > 1000


def test_the_regime_comes_from_the_unbounded_cold_row():
    from dualpath.bench.sessions import prefill_compute_s, session_regime

    before = {"pe0": {"busy_s": 1.0, "layer_wait_s_total": 0.5}, "de1": {"busy_s": 9.0}}
    after = {"pe0": {"busy_s": 5.0, "layer_wait_s_total": 1.5}, "de1": {"busy_s": 99.0}}
    roles = {"pe0": {"role": "prefill"}, "de1": {"role": "decode"}}
    assert prefill_compute_s(before, after, roles) == 3.0  # the decode engine's time left out
    rows = {"cold": {"hit_tokens": 980, "prompt_tokens": 1000, "recompute_s_per_token": 0.01},
            "recency": {"hit_tokens": 500, "prompt_tokens": 1000, "recompute_s_per_token": 1.0}}
    got = session_regime(rows, kv_bytes_per_token=1000, read_cap_mb_s=1.0)  # 1 ms a token
    assert got["of_row"] == "cold" and got["hit_rate"] == 0.98
    assert got["hit_per_computed"] == 49.0 and abs(got["kappa"] - 0.1) < 1e-12
