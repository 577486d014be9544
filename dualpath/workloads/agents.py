"""Agent workloads for ``dualpath bench agents``, as token ids, one schema with the simulator.

A :class:`Workload` is one list of :class:`~dualpath.workloads.turns.AgentTurn` per agent (keep
the first ``keep`` tokens of the context so far, None keeping all, append ``new``, generate
exactly ``gen``: :func:`~dualpath.bench.replay.run_turns`); :meth:`Workload.sim_turns` gives it
as :class:`~dualpath.workloads.turns.Turn` lists. **Hit rule** (:func:`agent_sim_turns`):
``floor(min(kept, C − 1) / block) · block``, ``C`` the previous turn's prompt + generated tokens
(first turn: 0), at most ``floor((prompt − 1) / block) · block``. **Presets** ``32k``, ``48k``,
``64k`` (PAPER Table 2): each turn keeps the whole context and appends ``append``;
:func:`preset_shape` solves a cold first context and the turn count; lengths are divided by
``scale`` (default 8). **Traces** (``weka``, ``weka-sample``, ``mooncake``; folder ``trace_dir``
or ``$DUALPATH_TRACES_DIR``): a hash block of B trace tokens becomes ``round(B / scale)`` tokens
seeded by (agent scope, hash id), a turn keeps its common prefix with the previous prompt,
``max_context`` ends a trajectory, Weka sub-agents only with ``subagents=True``
(:mod:`dualpath.workloads.trace_tokens`, :mod:`dualpath.workloads.sample`). **Primers**: each
agent has one turn stored untimed before its timed turns (:attr:`Workload.primers`): its first
turn itself, or with ``first_turn`` k > 1 (traces) the request before the window, so the first
timed turn hits what the trace says it shares with that request (:func:`primed_hit`).

Derivation (hit rule, preset shapes and hit rates, trace token ids; docs/design.md §3.6):
docs/derivations.md, 'workloads/agents.py'.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from itertools import pairwise
from pathlib import Path
from typing import Any

from dualpath.workloads.mooncake import mooncake_file
from dualpath.workloads.presets import PRESETS, TrajectoryPreset
from dualpath.workloads.sample import read_sample
from dualpath.workloads.trace_files import traces_folder
from dualpath.workloads.trace_tokens import (
    FIRST_TOKEN,
    TraceAgents,
    WorkloadOptions,
    mooncake_agents,
    weka_agents,
)
from dualpath.workloads.turns import AgentTurn, Turn
from dualpath.workloads.weka import weka_source

PRESET_NAMES = ("32k", "48k", "64k")
TRACE_NAMES = ("weka", "weka-sample", "mooncake")
NAMES = PRESET_NAMES + TRACE_NAMES
DEFAULT_SCALE: dict[str, float] = {"32k": 8, "48k": 8, "64k": 8, "weka": 32, "weka-sample": 32,
                                   "mooncake": 32}


@dataclass(frozen=True)
class Workload:
    """Agents' token-level turns, the engine block size the hits are for, and how they were
    made (``info``: source, scale, sessions used, skipped and cut, sub-agents, totals).
    ``primers``: one turn per agent, stored untimed before its turns (empty: each agent's
    first turn); each has ``keep`` 0 or None, as has each agent's first turn."""

    name: str
    agents: list[list[AgentTurn]]
    block_size: int
    info: dict[str, Any] = field(default_factory=dict)
    primers: list[AgentTurn] = field(default_factory=list)

    def primer_turns(self) -> list[AgentTurn]:
        """Each agent's primer: :attr:`primers`, or (none given) its first turn."""
        return self.primers or [turns[0] for turns in self.agents]

    def sim_turns(self, primed: bool = False) -> list[list[Turn]]:
        """Every agent's turns as simulator turns (prompt, hit, gen: the module doc's rule);
        ``primed``: with each agent's primer stored beforehand, the first turn hits what it
        shares with it (:func:`primed_hit`) rather than nothing."""
        out = [agent_sim_turns(turns, self.block_size) for turns in self.agents]
        if primed:
            for sims, primer, turns in zip(out, self.primer_turns(), self.agents, strict=True):
                if sims:
                    sims[0] = replace(sims[0], hit=primed_hit(primer, turns[0], self.block_size))
        return out

    def expected_hit_rate(self) -> float:
        """Hit tokens over prompt tokens of :meth:`sim_turns` (0 for an empty workload)."""
        turns = [t for agent in self.sim_turns() for t in agent]
        return sum(t.hit for t in turns) / max(1, sum(t.prompt for t in turns))


def agent_sim_turns(turns: Sequence[AgentTurn], block_size: int) -> list[Turn]:
    """One agent's turns as simulator turns: the hit of the module doc's rule.

    Raises ``ValueError`` for a turn that keeps more than the context, has no prompt token or
    generates none.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    out: list[Turn] = []
    context = 0  # previous prompt + generated tokens
    for i, t in enumerate(turns):
        kept = context if t.keep is None else t.keep
        if not 0 <= kept <= context:
            raise ValueError(f"turn {i} keeps {kept} tokens of a {context}-token context")
        prompt = kept + len(t.new)
        if prompt < 1 or t.gen < 1:
            raise ValueError(f"turn {i} has {prompt} prompt and {t.gen} generated tokens "
                             "(need at least 1 of each)")
        served = min(kept, context - 1) if context else 0  # last generated token: no KV
        hit = min(served // block_size, (prompt - 1) // block_size) * block_size
        out.append(Turn(prompt=prompt, hit=hit, gen=t.gen))
        context = prompt + t.gen
    return out


def primed_hit(primer: AgentTurn, first: AgentTurn, block_size: int) -> int:
    """The hit of an agent's first turn once its primer ran: the leading full blocks the two
    prompts share, within the primer's stored KV (prompt + generated tokens but the last),
    leaving at least one prompt token to compute. Both turns must start afresh (``keep`` 0 or
    None).

    Raises ``ValueError`` for a turn that keeps a context or a block size below 1.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if primer.keep or first.keep:
        raise ValueError("a primer and a first turn keep no context "
                         f"(keep {primer.keep} and {first.keep})")
    stored, prompt = primer.new, first.new
    shared = next((i for i, (a, b) in enumerate(zip(stored, prompt, strict=False)) if a != b),
                  min(len(stored), len(prompt)))
    served = min(shared, len(stored) + primer.gen - 1)
    return min(served // block_size, (len(prompt) - 1) // block_size) * block_size


def load_workload(name: str, *, vocab_size: int, block_size: int = 64,
                  scale: float | None = None, agents: int | None = None,
                  turns: int | None = None, max_context: int = 8192,
                  trace_dir: Path | str | None = None, seed: int = 0,
                  subagents: bool = False, first_turn: int = 1) -> Workload:
    """Workload ``name`` (:data:`NAMES`) with token ids in ``[3, vocab_size − 1)``.

    ``scale`` divides every length (default :data:`DEFAULT_SCALE`); ``agents`` is the copies of
    a preset (default 1) or the sessions of a trace (default all); ``turns`` keeps each agent's
    first turns; ``max_context`` cuts a trajectory before a turn whose prompt + gen exceeds it;
    ``trace_dir`` (default ``$DUALPATH_TRACES_DIR``) is needed by ``weka`` and ``mooncake``;
    ``subagents`` makes Weka sub-agents agents of their own; ``first_turn`` (traces: the
    top-level request a window of ``turns`` starts at, 1-based) makes the request before it
    each agent's primer (module doc).

    Raises ``ValueError`` for an unknown name, a bad option, a missing traces folder or file,
    malformed trace data, or when no trajectory fits ``max_context``.
    """
    if name not in NAMES:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(NAMES)}")
    o = WorkloadOptions(vocab_size, block_size, DEFAULT_SCALE[name] if scale is None else scale,
                        agents, turns, max_context, seed, subagents, first_turn)
    if name in PRESET_NAMES:
        if first_turn != 1:
            raise ValueError(f"first_turn applies to traces, not preset {name!r} "
                             f"(got {first_turn})")
        agent_turns, info = _preset(name, o)
        made = TraceAgents(agent_turns, [], info)
    elif name == "weka-sample":
        sessions, header = read_sample()
        made = weka_agents(sessions, "dualpath/workloads/data/weka_sample.json", o)
        made.info["sample"] = header
    elif name == "weka":
        source, sessions = weka_source(traces_folder(name, trace_dir))
        made = weka_agents(sessions, source, o)
    else:
        made = mooncake_agents(mooncake_file(traces_folder(name, trace_dir)), o)
    workload = Workload(name, made.agents, block_size, {"workload": name, **made.info},
                        made.primers)
    workload.info.update(_totals(workload))
    return workload


def _totals(workload: Workload) -> dict[str, Any]:
    """Counts of a workload: agents, turns, prompt, new, generated and hit tokens, hit rate
    (the first turns cold), and the hit rate with the primers stored first."""
    sims = [t for agent in workload.sim_turns() for t in agent]
    primed = [t for agent in workload.sim_turns(primed=True) for t in agent]
    prompt = sum(t.prompt for t in sims)
    hit = sum(t.hit for t in sims)
    return {"block_size": workload.block_size, "agents": len(workload.agents),
            "turns": len(sims), "prompt_tokens": prompt, "hit_tokens": hit,
            "new_tokens": sum(len(t.new) for a in workload.agents for t in a),
            "gen_tokens": sum(t.gen for t in sims), "expected_hit_rate": hit / max(1, prompt),
            "primed_hit_rate": sum(t.hit for t in primed) / max(1, prompt)}


# -- presets ------------------------------------------------------------------------------------


def preset_shape(preset: TrajectoryPreset) -> tuple[float, int]:
    """(first context, turns) of a trajectory that grows by ``append + gen`` per turn and
    matches the row's mean context and mean total length (last prompt + gen), unscaled."""
    growth = preset.append + preset.gen
    turns = max(1, round(2 * (preset.total_tokens - preset.mean_context) / growth - 1))
    return max(0.0, preset.mean_context - (turns - 1) * growth / 2), turns


def _spread(per_turn: float, turns: int, least: int) -> list[int]:
    """``turns`` integers whose running sums are ``round(k · per_turn)``, each >= ``least``."""
    marks = [round(k * per_turn) for k in range(turns + 1)]
    return [max(least, b - a) for a, b in pairwise(marks)]


def _fitting_turns(prompts_new: Sequence[int], gens: Sequence[int], max_context: int) -> int:
    """How many leading keep-all turns stay within ``max_context`` (prompt + gen)."""
    context = 0
    for i, (new, gen) in enumerate(zip(prompts_new, gens, strict=True)):
        if context + new + gen > max_context:
            return i
        context += new + gen
    return len(gens)


def _preset(name: str, o: WorkloadOptions) -> tuple[list[list[AgentTurn]], dict[str, Any]]:
    """A Table 2 preset scaled by ``o.scale`` (module doc), ``o.agents`` copies (default 1)."""
    p = PRESETS[name]
    first, full = preset_shape(p)
    count = full if o.turns is None else min(o.turns, full)
    appends = _spread(p.append / o.scale, count, least=1)
    gens = _spread(p.gen / o.scale, count, least=1)
    appends[0] += round(first / o.scale)
    fit = _fitting_turns(appends, gens, o.max_context)
    if fit == 0:
        raise ValueError(f"workload {name!r}: the first turn needs {appends[0] + gens[0]} "
                         f"tokens > max_context {o.max_context} (raise scale or max_context)")
    agents = [_random_agent(f"{name}/{o.seed}/{a}", appends[:fit], gens[:fit], o.vocab_size)
              for a in range(o.agents or 1)]
    info = {"source": f"PAPER Table 2, row {name} (dualpath.workloads.presets.PRESETS)",
            "rule": "each prompt = whole previous context (prompt + generated) + append new "
                    "random tokens; first turn = first context + append, cold",
            "scale": o.scale, "first_context": round(first / o.scale), "turns_full": full,
            "table_turns": p.turns, "append_mean": sum(appends[1:fit]) / max(1, fit - 1),
            "gen_mean": sum(gens[:fit]) / fit, "max_context": o.max_context,
            "cut": {} if fit == count else {name: _cut_note(fit, count, appends, gens)}}
    return agents, info


def _cut_note(fit: int, count: int, appends: Sequence[int], gens: Sequence[int]) -> str:
    """Why a keep-all trajectory stopped at turn ``fit``."""
    need = sum(appends[:fit + 1]) + sum(gens[:fit + 1])
    return f"kept {fit} of {count} turns: turn {fit} needs {need} tokens"


def _random_agent(key: str, news: Sequence[int], gens: Sequence[int],
                  vocab_size: int) -> list[AgentTurn]:
    """Keep-all turns of seeded random tokens (``key`` seeds them: copies share nothing)."""
    rng = random.Random(f"dualpath-workload/{key}")
    return [AgentTurn([rng.randrange(FIRST_TOKEN, vocab_size - 1) for _ in range(n)], g)
            for n, g in zip(news, gens, strict=True)]

