"""``bench agents --engine vllm``'s regime: plain vLLM on as many instances as the cluster has
engines, sessions sticky (agent i on instance i mod N, checked against fake OpenAI servers),
every instance's device KV bounded so the working set is at least 5x their total (a workload too
small for that is refused), the oracle as plain vLLM with an unbounded prefix cache, the launch
plan carrying the budget and the prefix-cache flag, and ``speedup_dualpath_vs_plain_vllm``.
No vLLM runs here."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from app_serving import serving
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from dualpath.bench.agents.kv_budget import (
    KvBudgetError,
    bounded_kv_budget,
    longest_request_tokens,
    max_model_len_for,
    sticky_instance,
    unbounded_kv_bytes,
    vllm_floor_blocks,
    working_set_tokens,
)
from dualpath.bench.agents.plain_vllm import PlainVllmFleet, replay_sticky
from dualpath.workloads.turns import AgentTurn

BS = 64
BLOCK_BYTES = 46_080 * BS  # SmolLM2 float32: 30 layers x 3 KV heads x 64 x 2 x 4 bytes a token


def fake_vllm(seen: list[tuple[int, int]]) -> FastAPI:
    """An OpenAI completions endpoint that streams ``max_tokens`` ids and notes, per request,
    the prompt's first token (the agent's mark) and its length."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def complete(body: dict) -> StreamingResponse:
        seen.append((body["prompt"][0], len(body["prompt"])))

        async def stream() -> Iterator[str]:
            ids = [7] * body["max_tokens"]
            yield f"data: {json.dumps({'choices': [{'token_ids': ids}]})}\n\n"
            usage = {"prompt_tokens": len(body["prompt"]),
                     "prompt_tokens_details": {"cached_tokens": 0}}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


def marked_agents(count: int, turns: int) -> list[list[AgentTurn]]:
    """Agent i's every prompt starts with the token 1000 + i."""
    return [[AgentTurn([1000 + i, 5, 6] if t == 0 else [9], 2) for t in range(turns)]
            for i in range(count)]


def test_sessions_are_sticky_agent_i_on_instance_i_mod_n():
    """Seven agents of three turns over three instances: each instance sees every turn of its
    own agents and no other agent's; the records name the instance."""
    assert [sticky_instance(i, 3) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    with pytest.raises(ValueError):
        sticky_instance(1, 0)
    seen: list[list[tuple[int, int]]] = [[], [], []]
    agents = marked_agents(7, 3)
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(serving(fake_vllm(s))) for s in seen]
        fleet = PlainVllmFleet.__new__(PlainVllmFleet)  # the fleet without starting vLLM
        fleet.instances, fleet.model = [SimpleNamespace(url=u) for u in urls], "fake"
        records, jct = fleet.run(agents, lambda: None, 30.0)
        by_fleet = [list(s) for s in seen]
        direct = asyncio.run(replay_sticky(urls[:2], "fake", agents[:4], lambda: None, 30.0))
    for k, requests in enumerate(by_fleet):
        mine = [i for i in range(7) if i % 3 == k]
        assert sorted({mark - 1000 for mark, _ in requests}) == mine
        assert len(requests) == 3 * len(mine)
    # two instances: agents 0 and 2 on the first, 1 and 3 on the second
    assert {m - 1000 for m, _ in seen[0][len(by_fleet[0]):]} == {0, 2}
    assert {m - 1000 for m, _ in seen[1][len(by_fleet[1]):]} == {1, 3}
    assert jct > 0 and len(records) == 21
    assert all(r["instance"] == r["agent"] % 3 and r["error"] is None for r in records)
    # turn 3's prompt: 3 + 2 generated + 1 + 2 generated + 1 tokens
    assert {r["prompt_tokens"] for r in records if r["turn"] == 2} == {9}
    assert [len(recs) for recs in direct] == [3, 3, 3, 3]


def test_the_budget_is_the_largest_whole_block_one_at_5x_the_total():
    """Working set >= 5 x instances x budget, and one block more each would break it."""
    ws = 6_400 * 46_080
    budget = bounded_kv_budget(ws, 3, BLOCK_BYTES, 320, BS)
    assert budget.kv_budget_bytes_each % BLOCK_BYTES == 0
    assert budget.working_set_over_budget >= 5.0
    assert ws < 5.0 * 3 * (budget.kv_budget_bytes_each + BLOCK_BYTES)
    assert budget.total_budget_bytes == 3 * budget.kv_budget_bytes_each
    summary = budget.summary()
    assert summary["instances"] == 3 and summary["working_set_bytes"] == ws
    assert summary["kv_budget_bytes_each"] == budget.kv_budget_bytes_each
    assert summary["working_set_over_budget"] == pytest.approx(ws / (3 * 6 * BLOCK_BYTES))
    # a lower ratio, more room each
    assert bounded_kv_budget(ws, 3, BLOCK_BYTES, 320, BS, 2.0).kv_budget_bytes_each > \
        budget.kv_budget_bytes_each


def test_a_workload_too_small_for_5x_is_refused():
    """vLLM starts an instance with no fewer blocks than one max_model_len request and its
    null block: a budget that would have to be smaller is a KvBudgetError, not a lower
    ratio."""
    assert vllm_floor_blocks(320, BS) == 6 and vllm_floor_blocks(321, BS) == 7
    assert max_model_len_for(257, BS) == 320 and max_model_len_for(320, BS) == 320
    ws = 5_760 * 46_080  # exactly 6 blocks each at 5x over 3: the floor for 320 tokens
    assert bounded_kv_budget(ws, 3, BLOCK_BYTES, 320, BS).working_set_over_budget == 5.0
    with pytest.raises(KvBudgetError, match="5x"):
        bounded_kv_budget(ws, 3, BLOCK_BYTES, 384, BS)
    with pytest.raises(KvBudgetError):
        bounded_kv_budget(ws - 1, 3, BLOCK_BYTES, 320, BS)
    assert bounded_kv_budget(ws, 3, BLOCK_BYTES, 384, BS, 4.0).kv_budget_bytes_each == \
        7 * BLOCK_BYTES


def test_working_set_and_the_longest_request_of_agents():
    """Final contexts (last prompt + generated) summed; the longest turn; compactions."""
    keep_all = [AgentTurn([3] * 100, 10), AgentTurn([4] * 50, 20)]  # 110 + 50 + 20 = 180
    compacted = [AgentTurn([3] * 200, 10), AgentTurn([4] * 30, 5, keep=40)]  # 40 + 30 + 5
    assert working_set_tokens([keep_all, compacted], BS) == 180 + 75
    assert longest_request_tokens([keep_all, compacted], BS) == 210
    # every block each turn can write: keep_all 2 + 3, compacted 4 + 2; warm-up 1 + 1
    warmup = [[AgentTurn([5] * 10, 2), AgentTurn([6] * 5, 2)]]
    oracle = unbounded_kv_bytes([keep_all, compacted], warmup, 2, BS, BLOCK_BYTES, 256)
    assert oracle == (6 + 2 + vllm_floor_blocks(256, BS)) * BLOCK_BYTES  # instance 1 busiest
    primed = unbounded_kv_bytes([keep_all, compacted], warmup, 2, BS, BLOCK_BYTES, 256,
                                [AgentTurn([1] * 300, 1), AgentTurn([2] * 10, 1)])
    assert primed == (5 + 5 + 2 + vllm_floor_blocks(256, BS)) * BLOCK_BYTES  # now instance 0


def test_the_suggested_workload_passes_and_the_weka_sample_is_refused():
    """What the refusal suggests meets 5x on SmolLM2; the 16-session Weka sample, the default
    workload, cannot (its longest request alone needs more than a fifteenth of the working set
    on every instance)."""
    from dualpath.workloads.agents import load_workload

    def budget(name: str, **kwargs: float) -> object:
        agents = load_workload(name, vocab_size=49_152, block_size=BS, **kwargs).agents
        longest = max_model_len_for(longest_request_tokens(agents, BS), BS)
        return bounded_kv_budget(working_set_tokens(agents, BS) * 46_080, 3, BLOCK_BYTES,
                                 longest, BS)

    assert budget("48k", agents=20, turns=3, scale=32).working_set_over_budget >= 5
    with pytest.raises(KvBudgetError, match="cannot be 5x"):
        budget("weka-sample", agents=16, turns=4, scale=64)


def test_run_bench_bounds_every_instance_and_the_launch_plan_carries_it(tiny_llama_dir,
                                                                       tmp_path, monkeypatch):
    """The resolved options give the ladder's instances (with the connector) and the plain
    ones the same byte-exact budget and prefix caching on; the oracle gets an unbounded one."""
    from dualpath.bench.agents import ladder, plain_vllm
    from dualpath.bench.report import kv_bytes_per_token
    from dualpath.integrations.vllm.engines.instance import launch_plan
    from dualpath.vocab import Role

    agents = [[AgentTurn(list(range(10 + i, 300 + i)), 4), AgentTurn([9] * 40, 4)]
              for i in range(40)]
    warmup = [[AgentTurn([5] * 20, 2)]]
    options = ladder.AgentsOptions(engine="vllm", modes=ladder.VLLM_RUNGS, online_modes=(),
                                   block_size=16)
    resolved, budget = ladder._vllm_budget(options, agents, warmup, tiny_llama_dir)
    block_bytes = kv_bytes_per_token(tiny_llama_dir, "float32") * 16
    assert budget.instances == 3 and budget.working_set_over_budget >= 5
    assert budget.working_set_bytes == 40 * 338 * block_bytes // 16  # 290 + 4 + 40 + 4 each
    assert resolved.vllm_kv_cache_bytes == budget.kv_budget_bytes_each
    assert resolved.vllm_max_model_len == 352  # 338 tokens in 16-token blocks
    primed = ladder._vllm_budget(options, agents, warmup, tiny_llama_dir,
                                 [AgentTurn([3] * 500, 4)])[1]  # a primer longer than a turn
    assert primed.max_model_len == 512 and primed.working_set_bytes == budget.working_set_bytes
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    for mode in ("basic", "dualpath"):
        config = ladder.cluster_config(resolved, mode, tmp_path / "kv")
        cmd = list(launch_plan(tiny_llama_dir, config, Role.PREFILL, "127.0.0.1", port=1,
                               environ={"DUALPATH_VLLM_PYTHON": str(python)}).command)
        assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(budget.kv_budget_bytes_each)
        assert cmd[cmd.index("--max-model-len") + 1] == "352"
        assert "--enable-prefix-caching" in cmd and "--kv-transfer-config" in cmd
    calls = []
    monkeypatch.setattr(plain_vllm, "plain_row", lambda *a: calls.append(a) or {"mode": a[-1]})
    assert ladder._plain_vllm(resolved, tiny_llama_dir, agents, warmup, tmp_path, None) == \
        {"mode": "vllm"}
    row, online = ladder.run_mode(resolved, tiny_llama_dir, "oracle", agents, warmup, tmp_path,
                                  None)
    assert row == {"mode": "oracle"} and online is None
    (plain, oracle) = calls
    assert plain[8:] == (3, budget.kv_budget_bytes_each, "vllm")
    assert plain[4] == [a[0] for a in agents]  # primed with the first turns by default
    # instance 0's 14 sessions: 19 + 22 blocks each and their primers' 19 (the first turns);
    # the warm-up's 2; the floor's 23
    assert oracle[8:10] == (3, (14 * (19 + 22 + 19) + 2 + 23) * block_bytes)
    assert oracle[9] > 14 * 338 * block_bytes // 16  # its sessions' final contexts, and more
    assert plain[0].vllm.max_model_len == 352


def test_the_summary_has_the_speedup_over_plain_vllm_and_the_table_says_the_budget():
    from dualpath.bench.agents.report import _plain_vllm_line, _ratios

    ratios = _ratios({"vllm": 30.0, "basic": 60.0, "dualpath": 15.0})
    assert ratios["speedup_dualpath_vs_plain_vllm"] == 2.0
    assert "speedup_dualpath_vs_plain_vllm" not in _ratios({"basic": 60.0, "dualpath": 15.0})
    budget = bounded_kv_budget(6_400 * 46_080, 3, BLOCK_BYTES, 320, BS)
    line = _plain_vllm_line({"summary": {"plain_vllm": budget.summary()}})
    assert "3 x 17.7 MB" in line and "6 blocks" in line and "5.6x" in line
    assert _plain_vllm_line({"summary": {}}) == ""

