"""``run_agents_http``: multi-turn agents through the OpenAI API of a real tiny cluster.

The app (``build_app``) runs in this process over a ``LocalCluster`` of a tiny random Llama
(1 PE + 1 DE, 16-token blocks), served by uvicorn on a loopback port. Two agents replay three
turns each: every turn's ids are the cluster's own greedy output for that prompt, turns 2 and 3
hit the store, and the records' sizes and timings are consistent. A turn the server refuses is
recorded with its status and message, and its agent stops.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from app_serving import serving

from dualpath.bench.agents.http import HttpTurnRecord, run_agents_http
from dualpath.config import ClusterConfig, EngineConfig, StorageConfig
from dualpath.config_file import ServeConfig
from dualpath.model.spec import load_spec
from dualpath.request import SamplingParams
from dualpath.server.api.app import ModelInfo, build_app
from dualpath.server.launch import LocalCluster
from dualpath.server.metrics import ServeMetrics
from dualpath.workloads.turns import AgentTurn

MODEL = "tiny"
BLOCK_TOKENS = 16
FIRST, APPEND, GEN = 70, 20, 6


def _tiny_model(model_dir: Path) -> ModelInfo:
    """The tiny model as the API sees it (no tokenizer: bytes stand in for text)."""
    def decode(ids: list[int]) -> str:
        return bytes(t % 256 for t in ids).decode("utf-8", "replace")

    def encode(text: str) -> list[int]:
        return list(text.encode("utf-8"))

    return ModelInfo(MODEL, load_spec(model_dir).vocab_size, 1024, encode, decode,
                     lambda messages: encode("".join(m["content"] for m in messages)))


@pytest.fixture(scope="module")
def served(tiny_chaotic_dir, tmp_path_factory) -> Iterator[tuple[str, LocalCluster]]:
    tmp = tmp_path_factory.mktemp("agents-http")
    config = ClusterConfig(engine=EngineConfig(dtype="float32", block_size=BLOCK_TOKENS,
                                               num_kv_blocks=256),
                           storage=StorageConfig(root=str(tmp / "kv")), host_pool_blocks=96,
                           num_decode=1)
    with LocalCluster(tiny_chaotic_dir, config, log_dir=tmp / "logs") as cluster:
        router = cluster.router
        app = build_app(router, _tiny_model(tiny_chaotic_dir), ServeConfig(),
                        ServeMetrics(router))
        with serving(app) as url:
            yield url, cluster


def _random_ids(generator: torch.Generator, n: int) -> list[int]:
    return torch.randint(3, 298, (n,), generator=generator).tolist()


def _agents(count: int, turns: int, seed: int) -> list[list[AgentTurn]]:
    g = torch.Generator().manual_seed(seed)
    return [[AgentTurn(_random_ids(g, FIRST if t == 0 else APPEND), GEN) for t in range(turns)]
            for _ in range(count)]


def _prompts(turns: list[AgentTurn], records: list[HttpTurnRecord]) -> list[list[int]]:
    """Every turn's prompt, rebuilt from the turns and the ids the server returned."""
    prompts, context = [], []
    for turn, record in zip(turns, records, strict=True):
        prompts.append(context + turn.new)
        context = prompts[-1] + list(record.output_ids)
    return prompts


def test_two_agents_three_turns_match_the_cluster_and_hit_from_turn_two(served):
    url, cluster = served
    agents = _agents(2, 3, seed=11)
    seen: list[HttpTurnRecord] = []
    start = time.monotonic()
    results = asyncio.run(run_agents_http(url, agents, model=MODEL, start_offsets_s=[0.0, 0.3],
                                          progress=seen.append, timeout_s=120,
                                          extra={"dualpath": {"mode": "dualpath"}}))
    assert [len(r) for r in results] == [3, 3] and len(seen) == 6
    assert min(r.submitted_s for r in results[1]) >= start + 0.3
    for agent, (turns, records) in enumerate(zip(agents, results, strict=True)):
        prompts = _prompts(turns, records)
        expected = cluster.generate(prompts, SamplingParams(max_tokens=GEN, ignore_eos=True),
                                    timeout_s=60)
        for index, (record, prompt, out) in enumerate(zip(records, prompts, expected,
                                                          strict=True)):
            assert record.ok and record.status == 200, record
            assert (record.agent, record.turn) == (agent, index)
            assert list(record.output_ids) == list(out.output_ids), (agent, index)
            assert record.prompt_tokens == len(prompt) == FIRST + index * (GEN + APPEND)
            assert record.generated_tokens == GEN and record.finish_reason == "length"
            assert 0 < record.ttft_s <= record.time_to_second_token_s <= record.latency_s
            assert 0 <= record.tpot_s < record.latency_s
            assert record.cached_tokens is not None and record.cached_tokens % BLOCK_TOKENS == 0
            if index > 0:  # the previous turn's full blocks are in the store (they are
                # saved as they fill, so the last may still be on its way: at least one block)
                previous = FIRST + (index - 1) * (GEN + APPEND) + GEN
                full = previous // BLOCK_TOKENS * BLOCK_TOKENS
                assert 0 < record.cached_tokens <= full, (agent, index, record.cached_tokens)
        assert records[0].cached_tokens == 0


def test_a_refused_turn_is_recorded_and_its_agent_stops(served):
    url, _ = served
    agents = _agents(2, 3, seed=12)
    too_long = AgentTurn(agents[0][1].new, 5000)  # over the 1,024-token context
    agents[0] = [agents[0][0], too_long, agents[0][2]]
    results = asyncio.run(run_agents_http(url, agents, model=MODEL, timeout_s=120))
    failed = results[0]
    assert len(failed) == 2 and failed[0].ok and not failed[1].ok
    assert failed[1].status == 400 and "maximum context length" in failed[1].error
    assert failed[1].generated_tokens == 0 and failed[1].ttft_s is None
    assert [r.ok for r in results[1]] == [True, True, True]


def test_a_turn_still_running_at_the_deadline_is_cut_off(served):
    url, cluster = served
    # the whole context's worth of tokens against a deadline a fast CI host cannot beat (900
    # tokens once finished in 0.44 s, under the 0.5 s deadline this test had)
    long_turn = [AgentTurn(_random_ids(torch.Generator().manual_seed(13), FIRST), 1024 - FIRST)]
    start = time.monotonic()
    [[record]] = asyncio.run(run_agents_http(url, [long_turn], model=MODEL, timeout_s=0.25))
    assert time.monotonic() - start < 5
    assert not record.ok and record.cut_off and record.status is None
    assert "deadline" in record.error
    deadline = time.monotonic() + 10  # the closed stream aborts the request on the engines
    while cluster.router.counters()["requests"]:
        assert time.monotonic() < deadline, cluster.router.counters()
        time.sleep(0.05)


def _cut_agents() -> tuple[list[list[AgentTurn]], list[float]]:
    """A short turn at once, and an agent whose one long turn starts after the cut (0.3 s)."""
    g = torch.Generator().manual_seed(14)
    short = [AgentTurn(_random_ids(g, FIRST), GEN)]
    long_turn = [AgentTurn(_random_ids(g, FIRST), 1024 - FIRST)]
    return [short, long_turn], [0.0, 0.4]


def _drained(cluster: LocalCluster) -> None:
    deadline = time.monotonic() + 10  # the cut turn is aborted on the engines
    while cluster.router.counters()["requests"]:
        assert time.monotonic() < deadline, cluster.router.counters()
        time.sleep(0.05)


def test_a_cut_replay_keeps_the_turns_sent_by_the_cut_and_cancels_the_rest(served):
    url, cluster = served
    agents, offsets = _cut_agents()
    results = asyncio.run(run_agents_http(url, agents, model=MODEL, start_offsets_s=offsets,
                                          timeout_s=120, cut_after_s=0.3))
    [kept], cut = results
    assert kept.ok and kept.generated_tokens == GEN
    assert cut == []  # sent at 0.4 s, in flight when the last turn sent by 0.3 s returned
    _drained(cluster)


def test_a_cut_run_of_the_python_api_ends_once_the_measured_turns_returned(served):
    from dualpath.bench.replay import run_turns

    _, cluster = served
    agents, offsets = _cut_agents()
    row = run_turns(cluster, agents, "dualpath", timeout_s=120, start_offsets_s=offsets,
                    cut_after_s=0.3)
    [kept], cut = row["records"]
    assert kept.submitted_s <= 0.3 and kept.latency_s > 0
    assert cut == [] and row["turns"] == 1
    assert 0.4 <= row["jct_s"] < 5  # the cut came when the late agent's turn was sent
    _drained(cluster)


def test_paced_agents_name_their_sessions_wait_their_tool_times_and_take_turns(served):
    from dualpath.bench.agents.http import HttpSession
    from dualpath.bench.replay import Pacing

    url, cluster = served
    agents = [[AgentTurn(t.new, t.gen, think_s=0.4 if i else 0.0) for i, t in enumerate(turns)]
              for turns in _agents(2, 2, seed=5)]
    pacing = Pacing(think_factor=1.0, max_think_s=1.0, max_agents=1, sessions=True)
    local_before = cluster.router.counters()["local_prefills"]
    results = asyncio.run(run_agents_http(url, agents, model=MODEL, timeout_s=120,
                                          pacing=pacing))
    first, second = results
    assert all(r.ok for recs in results for r in recs)
    assert first[1].submitted_s - first[0].finished_s >= 0.4  # its tool time
    assert second[0].submitted_s >= first[1].finished_s  # one agent at a time
    # the second turn of each session (a few new tokens) was prefilled on the decode engine
    # that served the first, where the session is warm
    assert cluster.router.counters()["local_prefills"] == local_before + 2
    assert HttpSession("a", pacing).fields(None, last=True) == (
        {"agent_hint": {"end_of_session": True}}, {"X-Session-ID": "a"})
    assert HttpSession("a", pacing, hints=False).fields({"x": 1}, last=True) == (
        {"x": 1}, {"X-Session-ID": "a"})


def test_an_http_runs_router_counters_come_from_the_servers_metrics(tmp_path):
    from dualpath.bench.agents.run import HttpRun
    from dualpath.config import ClusterConfig, StorageConfig

    run = HttpRun(tmp_path, ClusterConfig(storage=StorageConfig(root=str(tmp_path))), tmp_path)
    run._metrics = lambda: (  # what the server's /metrics page carries (not started here)
        "# HELP dualpath:router_local_prefills_total Agent turns\n"
        "# TYPE dualpath:router_local_prefills_total counter\n"
        "dualpath:router_local_prefills_total 3.0\n"
        "# HELP dualpath:router_moved_streams_total Streams moved\n"
        "# TYPE dualpath:router_moved_streams_total counter\n"
        "dualpath:router_moved_streams_total 1.0\n"
        "# HELP dualpath:router_fenced_buffers Fenced\n"
        "# TYPE dualpath:router_fenced_buffers gauge\n"
        "dualpath:router_fenced_buffers 2.0\n")
    assert run.counters() == {"local_prefills": 3.0, "moved": 1.0}
