"""The default ``bench agents`` workload keeps the traces' hit rate (issue 43, the regime).

The hit rate the bench's engines measure (``summary.regime.hit_rate``: hit tokens / prompt
tokens of the timed turns) is computed here from the token ids the bench replays, by a store of
prefix-hashed blocks: the primers' blocks are stored first (``prime``), then each timed prompt
hits its leading stored blocks and stores its own. The trace's side is what the trace records
for the same requests: each one's common prefix of 64-token hash blocks with the request before
it (``chain_turns``), the first timed one's with its primer. Pure Python, no engines.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from dualpath.bench.agents.ladder import VLLM_RUNGS, AgentsOptions
from dualpath.bench.agents.turns import expected_hit_rate, load_bench_workload
from dualpath.workloads.agents import Workload
from dualpath.workloads.sample import read_sample
from dualpath.workloads.sim_traces import chain_turns
from dualpath.workloads.turns import AgentTurn, Request

VOCAB = 49_152  # SmolLM2's; the hits do not depend on it
TOLERANCE = 0.01  # the workload's hit rate within 1 percentage point of the trace's


@dataclass(frozen=True)
class Hits:
    """Hit and prompt tokens of the timed turns."""

    hit_tokens: int
    prompt_tokens: int

    @property
    def rate(self) -> float:
        """Hit tokens / prompt tokens."""
        return self.hit_tokens / self.prompt_tokens


class BlockStore:
    """What an engine's store holds: full blocks keyed by their whole prefix."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.keys: set[int] = set()

    def _chain(self, tokens: list[int], blocks: int) -> list[int]:
        keys, key = [], None
        for k in range(blocks):
            key = hash((key, tuple(tokens[k * self.block_size:(k + 1) * self.block_size])))
            keys.append(key)
        return keys

    def hit_tokens(self, prompt: list[int]) -> int:
        """Leading stored blocks of ``prompt``, leaving at least one token to compute."""
        hit = 0
        for key in self._chain(prompt, (len(prompt) - 1) // self.block_size):
            if key not in self.keys:
                break
            hit += 1
        return hit * self.block_size

    def store(self, computed: list[int]) -> None:
        """Every full block of a turn's computed KV (its prompt and generated tokens but the
        last generated one, whose KV is never computed)."""
        self.keys.update(self._chain(computed, (len(computed) - 1) // self.block_size))


def replayed_hits(workload: Workload, block_size: int) -> Hits:
    """The timed turns' hits as the bench replays them: the primers stored first, then each
    agent's turns in order, generated tokens standing in as ids no prompt contains."""
    store = BlockStore(block_size)
    fresh = iter(range(-1, -10**9, -1))
    for primer in workload.primer_turns():
        store.store(primer.prompt([]) + [next(fresh) for _ in range(primer.gen)])
    hit = prompt_tokens = 0
    for turns in workload.agents:
        context: list[int] = []
        for turn in turns:
            prompt = turn.prompt(context)
            hit += store.hit_tokens(prompt)
            prompt_tokens += len(prompt)
            context = prompt + [next(fresh) for _ in range(turn.gen)]
            store.store(context)
    return Hits(hit, prompt_tokens)


def trace_hits(workload: Workload, first_turn: int) -> Hits:
    """What the shipped sample records for the same requests: each timed request's common
    prefix of hash blocks with the request before it (the first timed one's with the request
    before the window; none for a trajectory's first request), in trace tokens."""
    sessions = dict(read_sample()[0])
    hit = prompt_tokens = 0
    names = workload.info["sessions"]
    assert len(names) == len(workload.agents), "one agent per session: no sub-agents"
    for name, turns in zip(names, workload.agents, strict=True):
        requests = [Request(r["in"], r["out"], tuple(r["hash_ids"]))
                    for r in sessions[name]["requests"] if r["type"] != "subagent"]
        start = first_turn - 1
        lead = 1 if start else 0
        chained = chain_turns(requests[start - lead:start + len(turns)], 64)[lead:]
        hit += sum(t.hit for t in chained)
        prompt_tokens += sum(t.prompt for t in chained)
    return Hits(hit, prompt_tokens)


def _bench(options: AgentsOptions) -> tuple[Workload, Hits, Hits]:
    workload = load_bench_workload(options, VOCAB)
    return (workload, replayed_hits(workload, options.block_size),
            trace_hits(workload, options.window_first_turn))


@pytest.mark.parametrize("engine", ["dualpath", "vllm"])
def test_the_default_workload_hits_what_the_trace_records(engine):
    """Both engine kinds' defaults: ours (8 sessions, 16-token blocks) and vLLM's (28
    sessions, 32-token blocks)."""
    options = AgentsOptions(engine=engine, modes=VLLM_RUNGS, online_modes=()) if (
        engine == "vllm") else AgentsOptions()
    workload, bench, trace = _bench(options)
    assert options.workload == "weka-sample" and options.prime_first_turns
    assert bench.rate >= 0.95, f"h {bench.rate:.2%}"
    assert abs(bench.rate - trace.rate) <= TOLERANCE, (bench.rate, trace.rate)
    # the report's expectation (the hit rule of workloads/agents.py) is the replayed one
    assert expected_hit_rate(workload, options) == pytest.approx(bench.rate, abs=1e-12)


def test_first_turns_and_64_token_blocks_miss_the_trace_by_far():
    """The comparison can fail: the old default (each agent's first turns, its first prompt
    stored as itself, 64-token blocks) measures 87% against the trace's 70% for the same
    requests (on the old sample, 81% against 68%: its first request hits nothing in the trace,
    all its own blocks once primed); the window at 64-token blocks loses 1.7 points."""
    old = replace(AgentsOptions(), first_turn=1, block_size=64, agents=16)
    _, bench, trace = _bench(old)
    assert abs(bench.rate - trace.rate) > 5 * TOLERANCE, (bench.rate, trace.rate)
    coarse = replace(AgentsOptions(), block_size=64)  # the window, but the block loss
    _, bench, trace = _bench(coarse)
    assert trace.rate - bench.rate > TOLERANCE, (bench.rate, trace.rate)


def test_a_primer_is_the_request_before_the_window():
    options = replace(AgentsOptions(), agents=2)
    workload = load_bench_workload(options, VOCAB)
    full = load_bench_workload(replace(options, first_turn=1, turns=options.window_first_turn
                                       - 1 + options.turns), VOCAB)
    for primer, turns, whole in zip(workload.primers, workload.agents, full.agents, strict=True):
        prompts = _prompts(whole)
        start = options.window_first_turn - 1
        assert primer.prompt([]) == prompts[start - 1] and primer.gen == 1
        assert _prompts(turns) == prompts[start:start + len(turns)]  # the same token ids
        assert turns[0].keep == 0  # the first timed turn carries its whole prompt


def _prompts(turns: list[AgentTurn]) -> list[list[int]]:
    context: list[int] = []
    out = []
    for i, turn in enumerate(turns):
        prompt = turn.prompt(context)
        out.append(prompt)
        context = prompt + [-(1000 * i + j + 1) for j in range(turn.gen)]
    return out
