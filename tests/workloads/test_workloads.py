"""Bench workloads: presets, Weka (sample, archive, folders), Mooncake, the hit rule, errors."""

from __future__ import annotations

import io
import json
import re
import tarfile
from pathlib import Path

import pytest

from dualpath.workloads.agents import (
    NAMES,
    Workload,
    agent_sim_turns,
    load_workload,
    preset_shape,
)
from dualpath.workloads.presets import PRESETS
from dualpath.workloads.sample import read_sample, write_sample
from dualpath.workloads.sim_traces import chain_turns
from dualpath.workloads.trace_files import ENV_DIR, trace_dir
from dualpath.workloads.turns import AgentTurn, Request, Turn

VOCAB = 49_152
SHARED = trace_dir()  # tests/conftest.py points it at ../shared/traces
HAVE_WEKA = (SHARED / "weka-agentic-dev" / "weka_traces_dev.tar.xz").is_file()
HAVE_MOONCAKE = (SHARED / "mooncake-synthetic" / "synthetic_trace.jsonl").is_file()


def _req(n_in, out, ids, kind="n"):
    return {"type": kind, "in": n_in, "out": out, "hash_ids": list(ids)}


# per_block = 2 at scale 32: 64 trace tokens -> 2 tokens
SESSION_A = {"block_size": 64, "requests": [
    _req(680, 64, range(1, 11)),  # 10 blocks + 40 tokens -> 20 block tokens + 1 of its own
    _req(1000, 50, range(1, 16)),  # extends: shares 10 blocks -> keep 20; gen round(1.56)
    {"type": "subagent", "agent_id": "agent_001", "requests": [
        _req(640, 32, range(500, 510)), _req(700, 32, range(500, 511))]},
    {"type": "subagent", "agent_id": "agent_002", "requests": [_req(640, 32, range(500, 510))]},
    _req(300, 32, [1, 2, 3, 99]),  # compaction: 3 shared blocks -> keep 6
    _req(256, 32, [1, 2, 3, 99]),  # the same 4 blocks: keep stops one token short
    {"type": "subagent", "agent_id": "agent_003", "requests": [_req(640, 32, range(700, 710))]},
]}
SESSION_B = {"block_size": 64, "requests": [_req(6400, 64, range(100)),
                                            _req(64_000, 64, range(1000))]}  # 2000 tokens
SESSION_C = {"block_size": 64, "requests": [_req(1280, 320, range(20))]}  # 40 + 10 tokens
SESSION_D = {"block_size": 64, "requests": [_req(680, 32, range(10)), _req(680, 32, range(10))]}


def _write_json_folder(folder: Path, sessions) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i, s in enumerate(sessions, 1):
        (folder / f"trace_{i:04d}.json").write_text(json.dumps(s))
    return folder


def _write_archive(path: Path, sessions) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:xz") as tar:
        for i, s in enumerate(sessions, 1):
            data = json.dumps(s).encode()
            info = tarfile.TarInfo(f"traces/trace_{i:04d}.json")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _prompts(agent: list[AgentTurn]) -> list[list[int]]:
    """Each turn's prompt, replayed with placeholder generated tokens (negative ids)."""
    context: list[int] = []
    out = []
    for i, t in enumerate(agent):
        prompt = t.prompt(context)
        out.append(prompt)
        context = prompt + [-(1000 * i + j + 1) for j in range(t.gen)]
    return out


def _store_hits(agent: list[AgentTurn], block: int, every_turn: bool = True) -> list[int]:
    """What an engine measures: the leading full blocks of each prompt found in a store that
    holds every full block of each earlier turn's computed KV (prompt + gen but the last); of
    the previous turn's only when ``every_turn`` is False."""
    store: set[int] = set()
    context: list[int] = []
    hits = []
    for i, t in enumerate(agent):
        prompt = t.prompt(context)
        h, k = None, 0
        while k < (len(prompt) - 1) // block:
            nxt = hash((h, tuple(prompt[k * block:(k + 1) * block])))
            if nxt not in store:
                break
            h, k = nxt, k + 1
        hits.append(k * block)
        context = prompt + [-(1000 * i + j + 1) for j in range(t.gen)]
        if not every_turn:
            store = set()
        h = None
        for k in range((len(context) - 1) // block):
            h = hash((h, tuple(context[k * block:(k + 1) * block])))
            store.add(h)
    return hits


# -- the hit rule ------------------------------------------------------------------------------


def test_sim_turns_credit_the_kept_context_but_its_last_token():
    turns = [AgentTurn(list(range(6)), 2), AgentTurn([7, 8, 9], 3),  # context 8: 7 with KV
             AgentTurn([1], 1, keep=5), AgentTurn([2, 3], 1, keep=6)]
    assert agent_sim_turns(turns, 4) == [Turn(6, 0, 2), Turn(11, 4, 3), Turn(6, 4, 1),
                                         Turn(8, 4, 1)]
    assert agent_sim_turns([AgentTurn([1] * 8, 1), AgentTurn([2], 1)], 4) == [
        Turn(8, 0, 1), Turn(10, 8, 1)]
    # a prompt of stored blocks only still computes its last token
    assert agent_sim_turns([AgentTurn([1] * 8, 1), AgentTurn([], 1, keep=8)], 4)[1] == Turn(8, 4, 1)
    w = Workload("x", [turns], 4)
    assert w.sim_turns() == [agent_sim_turns(turns, 4)]
    assert w.expected_hit_rate() == pytest.approx(12 / 31)
    with pytest.raises(ValueError, match="keeps 9 tokens of a 8-token context"):
        agent_sim_turns([AgentTurn([1] * 6, 2), AgentTurn([1], 1, keep=9)], 4)


@pytest.mark.parametrize(("name", "kwargs"), [("64k", {"turns": 12, "agents": 2}),
                                              ("weka-sample", {}),
                                              ("weka-sample", {"subagents": True})])
@pytest.mark.parametrize("block", [16, 64])
def test_sim_turns_are_what_a_store_of_every_earlier_turn_serves(name, kwargs, block):
    """The rule credits what the previous turn's context holds, exactly. A store of every
    earlier turn serves that and, rarely, more: an agent whose prompt returns to an older
    context than the previous one (one turn of the 32-session sample, turn 27 of its 25th
    session, 284 tokens kept of the previous context but 512 stored from an older one). The
    rule never credits more than a store serves."""
    w = load_workload(name, vocab_size=VOCAB, block_size=block, **kwargs)
    turns = older = 0
    for agent, sims in zip(w.agents, w.sim_turns(), strict=True):
        hits, stored = [t.hit for t in sims], _store_hits(agent, block)
        assert hits == _store_hits(agent, block, every_turn=False)
        assert all(h <= s for h, s in zip(hits, stored, strict=True))
        turns += len(hits)
        older += sum(h < s for h, s in zip(hits, stored, strict=True))
        assert [t.prompt for t in sims] == [len(p) for p in _prompts(agent)]
        assert all(t.hit % block == 0 and t.miss >= 1 for t in sims)
    assert older <= 0.01 * turns, f"{older} of {turns} turns hit an older context"


# -- presets -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["32k", "48k", "64k"])
def test_presets_scaled_keep_hit_rate_and_append_share(name):
    p = PRESETS[name]
    first, turns = preset_shape(p)
    growth = p.append + p.gen
    assert first + (turns - 1) * growth / 2 == pytest.approx(p.mean_context)
    assert first + turns * growth == pytest.approx(p.total_tokens, abs=growth / 2)
    full = load_workload(name, vocab_size=VOCAB, scale=1, max_context=10**6)
    scaled = load_workload(name, vocab_size=VOCAB, block_size=8)  # 8 x 8 = the 64 above
    assert full.expected_hit_rate() > (0.94 if name == "32k" else 0.96)
    assert abs(scaled.expected_hit_rate() - full.expected_hit_rate()) < 0.01
    default = load_workload(name, vocab_size=VOCAB)
    coarse = load_workload(name, vocab_size=VOCAB, scale=1, max_context=10**6, block_size=512)
    assert abs(default.expected_hit_rate() - coarse.expected_hit_rate()) < 0.01
    table_share = p.append / growth
    for w in (full, scaled):
        sims = w.sim_turns()[0]
        appended = sum(len(t.new) for t in w.agents[0][1:])
        generated = sum(t.gen for t in w.agents[0][1:])
        assert abs(appended / (appended + generated) - table_share) < 0.01
        assert len(sims) == turns and all(t.keep is None for t in w.agents[0])
    # per-turn lengths by cumulative rounding: the scaled means are exact
    first_context = default.info["first_context"]
    assert sum(len(t.new) for t in default.agents[0]) - first_context == round(
        turns * p.append / 8)
    assert sum(t.gen for t in default.agents[0]) == round(turns * p.gen / 8)
    assert default.info["turns"] == turns and default.info["cut"] == {}
    assert sum(len(t.new) + t.gen for t in default.agents[0]) <= 8192


def test_preset_copies_have_their_own_tokens_and_are_deterministic():
    w = load_workload("64k", vocab_size=300, agents=3, turns=4)
    assert len(w.agents) == 3 and all(len(a) == 4 for a in w.agents)
    firsts = [tuple(a[0].new[:8]) for a in w.agents]
    assert len(set(firsts)) == 3
    first_append = len(w.agents[0][0].new) - w.info["first_context"]
    assert w.info["first_context"] == 1254 and first_append == round(PRESETS["64k"].append / 8)
    assert all(3 <= tok < 299 for a in w.agents for t in a for tok in t.new)
    assert load_workload("64k", vocab_size=300, agents=3, turns=4).agents == w.agents
    other = load_workload("64k", vocab_size=300, agents=3, turns=4, seed=1)
    assert other.agents != w.agents and other.sim_turns() == w.sim_turns()


def test_preset_max_context_cuts_and_reports():
    w = load_workload("64k", vocab_size=VOCAB, max_context=2000)
    sims = w.sim_turns()[0]
    assert max(t.prompt + t.gen for t in sims) <= 2000
    assert len(sims) < w.info["turns_full"] and "64k" in w.info["cut"]
    with pytest.raises(ValueError, match="max_context 1000"):
        load_workload("64k", vocab_size=VOCAB, max_context=1000)


# -- Weka --------------------------------------------------------------------------------------


def test_weka_sample_loads_without_any_traces_folder(monkeypatch):
    monkeypatch.delenv(ENV_DIR, raising=False)
    w = load_workload("weka-sample", vocab_size=VOCAB)
    assert len(w.agents) == 29 and w.info["copies"] == 0 and w.info["first_turn"] == 1
    assert w.info["sessions"][0] == "trace_0001"  # three start past 8K tokens x 32
    too_long = "first turn exceeds max_context 8192"
    assert w.info["skipped"] == {name: too_long
                                 for name in ("trace_0033", "trace_0045", "trace_0065")}
    sessions, header = read_sample()
    assert header["sessions_kept"] == 32 and len(sessions) == 32
    assert header["first_turn"] == 21 and header["turns_per_session"] == 8
    by_name = dict(sessions)
    reqs = [[Request(r["in"], r["out"], tuple(r["hash_ids"])) for r in by_name[name]["requests"]
             if r["type"] != "subagent"][:len(turns)]  # a session cut at 8K keeps fewer
            for name, turns in zip(w.info["sessions"], w.agents, strict=True)]
    sims = [t for r in reqs for t in chain_turns(r, 64)]
    hash_rate = sum(t.hit for t in sims) / sum(t.prompt for t in sims)
    assert w.info["hash_hit_rate"] == pytest.approx(hash_rate)
    assert 0.8 < hash_rate < 0.95
    assert abs(w.expected_hit_rate() - hash_rate) < 0.025
    fine = load_workload("weka-sample", vocab_size=VOCAB, block_size=16)
    assert abs(fine.expected_hit_rate() - hash_rate) < 0.005


def test_shared_hash_prefix_gives_identical_tokens_and_compaction_a_shorter_keep(tmp_path):
    folder = _write_json_folder(tmp_path / "weka", [SESSION_A])
    w = load_workload("weka", vocab_size=VOCAB, trace_dir=folder)
    (agent,) = w.agents
    assert [t.keep for t in agent] == [0, 20, 6, 7]
    assert [t.gen for t in agent] == [2, 2, 1, 1]
    p = _prompts(agent)
    assert [len(x) for x in p] == [21, 31, 9, 8]
    assert p[1][:20] == p[0][:20] and p[1][20] != p[0][20]  # block 11 vs turn 0's own tail
    assert p[2][:6] == p[1][:6] and p[2][6:8] != p[1][6:8]  # block 99 differs from block 4
    assert p[3] == p[2][:8]  # same 4 blocks; the tail of turn 2 was its own
    assert load_workload("weka", vocab_size=VOCAB, trace_dir=folder).agents == w.agents
    retry = _prompts(load_workload("weka", vocab_size=VOCAB, trace_dir=_write_json_folder(
        tmp_path / "retry", [SESSION_D])).agents[0])
    assert retry[1][:20] == retry[0][:20] and retry[1][20] != retry[0][20]  # tails: their own
    reseeded = load_workload("weka", vocab_size=VOCAB, trace_dir=folder, seed=5)
    assert reseeded.agents != w.agents and reseeded.sim_turns() == w.sim_turns()


def test_subagents_are_skipped_or_agents_of_their_own(tmp_path):
    folder = _write_json_folder(tmp_path / "weka", [SESSION_A])
    skipped = load_workload("weka", vocab_size=VOCAB, trace_dir=folder)
    assert len(skipped.agents) == 1 and skipped.info["subagents"].startswith("skipped")
    assert "3 entries" in skipped.info["subagents"]
    own = load_workload("weka", vocab_size=VOCAB, trace_dir=folder, subagents=True)
    assert own.agents[0] == skipped.agents[0] and len(own.agents) == 4
    assert [len(a) for a in own.agents[1:]] == [2, 1, 1]
    assert [t.keep for t in own.agents[1]] == [0, 20]
    # agent_001 and agent_002 share hash ids in the trace, not tokens: own scopes
    assert own.agents[1][0].new != own.agents[2][0].new
    # turns=1 keeps the parent's first turn: sub-agents listed after the second are dropped
    cut = load_workload("weka", vocab_size=VOCAB, trace_dir=folder, subagents=True, turns=1)
    assert [len(a) for a in cut.agents] == [1]
    cut2 = load_workload("weka", vocab_size=VOCAB, trace_dir=folder, subagents=True, turns=2)
    assert [len(a) for a in cut2.agents] == [2, 2, 1]


def test_a_window_primes_with_the_request_before_it(tmp_path):
    folder = _write_json_folder(tmp_path / "weka", [SESSION_A, SESSION_D])
    whole = load_workload("weka", vocab_size=VOCAB, trace_dir=folder, block_size=4)
    w = load_workload("weka", vocab_size=VOCAB, trace_dir=folder, block_size=4, first_turn=2)
    chain = _prompts(whole.agents[0])
    primer = w.primers[0]
    assert primer.prompt([]) == chain[0] and primer.gen == 1  # stored untimed, its prompt only
    assert _prompts(w.agents[0]) == chain[1:]  # the same tokens, the first turn carries them all
    assert w.agents[0][0].keep == 0 and w.agents[0][1:] == whole.agents[0][2:]
    assert _prompts(w.agents[1]) == _prompts(whole.agents[1])[1:]
    for turns, primer, sims in zip(w.agents, w.primers, w.sim_turns(primed=True), strict=True):
        assert [t.hit for t in sims] == _store_hits([primer, *turns], 4)[1:]
    assert w.sim_turns()[0][0].hit == 0 and w.sim_turns(primed=True)[0][0].hit == 20
    requests = [Request(r["in"], r["out"], tuple(r["hash_ids"])) for r in SESSION_A["requests"]
                if r["type"] != "subagent"]
    trace = chain_turns(requests, 64)[1:] + chain_turns([Request(680, 32, tuple(range(10)))] * 2,
                                                        64)[1:]
    assert w.info["hash_hit_rate"] == pytest.approx(sum(t.hit for t in trace)
                                                    / sum(t.prompt for t in trace))
    # sub-agents listed before the primer ran before the window: dropped
    late = load_workload("weka", vocab_size=VOCAB, trace_dir=folder, first_turn=4,
                         subagents=True, agents=1)
    assert len(late.agents) == 2 and late.primers[1] == late.agents[1][0]  # agent_003: itself
    short = load_workload("weka", vocab_size=VOCAB, trace_dir=folder, first_turn=3)
    assert short.info["skipped"] == {"trace_0002": "2 requests, none from request 3 on"}
    with pytest.raises(ValueError, match="from request 5 on"):
        load_workload("weka", vocab_size=VOCAB, trace_dir=folder, first_turn=5)
    with pytest.raises(ValueError, match="first_turn applies to traces"):
        load_workload("64k", vocab_size=VOCAB, first_turn=2)


def test_max_context_cuts_skips_and_copies_are_reported(tmp_path):
    archive = _write_archive(tmp_path / "weka_traces_dev.tar.xz",
                             [SESSION_B, SESSION_C, SESSION_A])
    w = load_workload("weka", vocab_size=VOCAB, trace_dir=tmp_path, max_context=1000,
                      agents=3)
    assert w.info["sessions"] == ["trace_0001", "trace_0002", "trace_0003"]
    assert w.info["cut"] == {"trace_0001": "kept 1 of 2 turns: turn 1 needs 2002 tokens"}
    assert [len(a) for a in w.agents] == [1, 1, 4]
    small = load_workload("weka", vocab_size=VOCAB, trace_dir=archive, max_context=100,
                          agents=3)
    assert small.info["skipped"] == {"trace_0001": "first turn exceeds max_context 100"}
    assert small.info["skipped_count"] == 1 and small.info["copies"] == 1
    assert small.info["sessions"] == ["trace_0002", "trace_0003"]
    copy, original = small.agents[2], small.agents[0]
    assert [t.keep for t in copy] == [t.keep for t in original] and copy != original
    with pytest.raises(ValueError, match=r"no session .* max_context 10 "):
        load_workload("weka", vocab_size=VOCAB, trace_dir=archive, max_context=10)
    only_c = _write_json_folder(tmp_path / "c", [SESSION_C])
    assert load_workload("weka", vocab_size=VOCAB, trace_dir=only_c, max_context=50).agents
    with pytest.raises(ValueError, match="max_context 49"):  # prompt + gen must fit
        load_workload("weka", vocab_size=VOCAB, trace_dir=only_c, max_context=49)


@pytest.mark.skipif(not HAVE_WEKA, reason=f"no Weka archive under {SHARED}")
def test_weka_sample_is_the_archive_s_window(tmp_path):
    window = {"first_turn": 21, "turns": 8, "scale": 64, "subagents": True}
    sample = load_workload("weka-sample", vocab_size=VOCAB, **window)
    full = load_workload("weka", vocab_size=VOCAB, trace_dir=SHARED, agents=len(sample.agents),
                         **window)
    assert full.agents == sample.agents and full.primers == sample.primers
    assert full.info["sessions"] == sample.info["sessions"]
    assert sample.info["hash_hit_rate"] == full.info["hash_hit_rate"]
    out = write_sample(tmp_path / "weka_sample.json", SHARED)
    shipped = Path(__file__).parents[2] / "dualpath" / "workloads" / "data"
    assert out.read_text() == (shipped / "weka_sample.json").read_text()
    notice = (shipped / "LICENSE-weka").read_text()
    assert "NOTICE for dualpath/workloads/data/weka_demo.json" in notice
    assert "NOTICE for dualpath/workloads/data/weka_sample.json" in notice
    assert (shipped / "weka_sample.json").stat().st_size < 300_000


# -- Mooncake ----------------------------------------------------------------------------------


def test_mooncake_groups_conversations_from_a_given_file(tmp_path):
    path = tmp_path / "trace.jsonl"
    rows = [(1500, 320, [1, 2, 3]), (1000, 32, [7, 8]), (2016, 64, [1, 2, 3, 4])]
    path.write_text("".join(json.dumps({"timestamp": 0, "input_length": a, "output_length": b,
                                        "hash_ids": c}) + "\n" for a, b, c in rows))
    w = load_workload("mooncake", vocab_size=VOCAB, trace_dir=path)
    assert [len(a) for a in w.agents] == [2, 1]  # (1500, 2000) share block 1
    first, second = _prompts(w.agents[0])
    # 16 tokens per 512-token block; the first request's partial block 3 is a prefix of the
    # second's full one, so the whole first prompt is kept
    assert len(first) == 47 and len(second) == 63 and w.agents[0][1].keep == 47
    assert second[:47] == first and w.info["trace_block"] == 512
    assert w.agents[1][0].new[:16] != first[:16]  # another conversation: other tokens


@pytest.mark.skipif(not HAVE_MOONCAKE, reason=f"no Mooncake trace under {SHARED}")
def test_mooncake_loads_from_the_shared_folder():
    w = load_workload("mooncake", vocab_size=VOCAB, trace_dir=SHARED, agents=300)
    assert len(w.agents) == 300 and w.info["copies"] == 0
    assert max(len(a) for a in w.agents) > 1
    assert 0.3 < w.expected_hit_rate() < w.info["hash_hit_rate"] + 0.01 < 0.91


# -- errors ------------------------------------------------------------------------------------


def test_errors_name_the_problem(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match=re.escape(f"known: {', '.join(NAMES)}")):
        load_workload("azure", vocab_size=VOCAB)
    monkeypatch.delenv(ENV_DIR, raising=False)
    for name in ("weka", "mooncake"):
        with pytest.raises(ValueError, match=f"--trace-dir or set {ENV_DIR}"):
            load_workload(name, vocab_size=VOCAB)
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError, match=f"{re.escape(str(missing))}.*--trace-dir.*{ENV_DIR}"):
        load_workload("weka", vocab_size=VOCAB, trace_dir=missing)
    monkeypatch.setenv(ENV_DIR, str(missing))
    with pytest.raises(ValueError, match="does not exist"):
        load_workload("mooncake", vocab_size=VOCAB)
    with pytest.raises(ValueError, match="no Weka traces"):
        load_workload("weka", vocab_size=VOCAB, trace_dir=tmp_path)
    for bad in ({"scale": 0.5}, {"block_size": 0}, {"agents": 0}, {"turns": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            load_workload("64k", vocab_size=VOCAB, **bad)
    with pytest.raises(ValueError, match="no token per 64-token hash block"):
        load_workload("weka-sample", vocab_size=VOCAB, scale=200)
