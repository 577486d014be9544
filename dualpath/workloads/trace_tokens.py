"""Trace workloads for :mod:`dualpath.workloads.agents`: recorded sessions (read by
:mod:`dualpath.workloads.weka` and :mod:`dualpath.workloads.mooncake`) as token-level agent
turns (the rules are that module's doc).

Each trajectory (a Weka session's top-level requests, one sub-agent's, or a Mooncake
conversation) has a token scope; its hash ids, relabelled 0, 1, … by first appearance in it,
become ``round(B / scale)`` seeded tokens each, drawn from (seed, scope, id).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dualpath.workloads.mooncake import MOONCAKE_BLOCK, mooncake_conversations
from dualpath.workloads.sim_traces import chain_turns
from dualpath.workloads.turns import AgentTurn, Session, Trajectory
from dualpath.workloads.weka import WEKA_BLOCK, weka_sessions

FIRST_TOKEN = 3  # lowest token id drawn (ids below are special tokens in common vocabularies)
LISTED_MAX = 20  # names listed per info entry (skipped, cut); the counts are complete
SUBAGENTS_SKIPPED = "skipped (the default of dualpath.workloads.weka's rule)"
SUBAGENTS_AGENTS = ("agents of their own, right after their parent, each with its own token "
                    "scope; only those listed before the parent's first dropped turn")


@dataclass(frozen=True)
class WorkloadOptions:
    """The knobs of :func:`dualpath.workloads.agents.load_workload`, validated."""

    vocab_size: int
    block_size: int
    scale: float
    agents: int | None
    turns: int | None
    max_context: int
    seed: int
    subagents: bool

    def __post_init__(self) -> None:
        for name, low in (("vocab_size", FIRST_TOKEN + 2), ("block_size", 1), ("scale", 1),
                          ("max_context", 2)):
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")
        for name in ("agents", "turns"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {getattr(self, name)}")


# -- traces: requests to turns ------------------------------------------------------------------


@dataclass(frozen=True)
class _Agent:
    """A recorded trajectory and the scope that keys its token ids."""

    trajectory: Trajectory
    scope: str


@dataclass(frozen=True)
class _Session:
    """A recorded session and its token scopes: the top-level trajectory's ``scope``, a
    sub-agent's its name, each with a copy's ``suffix``."""

    session: Session
    scope: str
    suffix: str = ""

    @property
    def parent(self) -> _Agent:
        """The top-level trajectory."""
        return _Agent(self.session.parent, self.scope + self.suffix)

    def subagents_within(self, parent_turns: int) -> list[_Agent]:
        """The sub-agents listed before top-level turn ``parent_turns`` (the reader's rule)."""
        return [_Agent(t, t.name + self.suffix)
                for t in self.session.subagents_within(parent_turns)]

    def copy(self, k: int) -> _Session:
        """The ``k``-th copy of the session and its sub-agents: same lengths, own tokens."""
        return replace(self, suffix=f"#copy{k}")


class _Tokens:
    """Seeded token ids per (scope, key): hash blocks and unique request tails."""

    def __init__(self, seed: int, vocab_size: int) -> None:
        self.seed, self.span = seed, vocab_size - 1 - FIRST_TOKEN

    def draw(self, key: str, count: int) -> list[int]:
        """``count`` token ids derived from ``key`` alone."""
        out: list[int] = []
        chunk = 0
        while len(out) < count:
            digest = hashlib.blake2b(f"{self.seed}/{key}/{chunk}".encode()).digest()
            out += [FIRST_TOKEN + int.from_bytes(digest[i:i + 4], "little") % self.span
                    for i in range(0, len(digest), 4)]
            chunk += 1
        return out[:count]


def _common_blocks(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two id lists."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _request_tokens(tokens: _Tokens, scope: str, index: int, ids: Sequence[int],
                    per_block: int, length: int, start: int) -> list[int]:
    """Tokens ``[start, length)`` of request ``index``: its hash blocks' tokens, then its own
    unique tail past them (a partial last block is a prefix of that block's tokens)."""
    covered = min(length, len(ids) * per_block)
    first = start // per_block
    head: list[int] = []
    for h in ids[first:-(-covered // per_block)]:
        head += tokens.draw(f"{scope}/{h}", per_block)
    head = head[start - first * per_block:covered - first * per_block]
    tail = tokens.draw(f"{scope}/tail{index}", length - covered) if length > covered else []
    return head + tail[max(0, start - covered):]


def _trace_agent(agent: _Agent, o: WorkloadOptions,
                 tokens: _Tokens) -> tuple[list[AgentTurn], str | None]:
    """A trajectory's turns (module doc) and why it was cut short (None: not cut)."""
    traj = agent.trajectory
    per_block = round(traj.block / o.scale)
    if per_block < 1:
        raise ValueError(f"scale {o.scale} leaves no token per {traj.block}-token hash "
                         f"block (at most {2 * traj.block - 1})")
    labels: dict[int, int] = {}
    out: list[AgentTurn] = []
    prev: tuple[Sequence[int], int] = ((), 0)  # previous ids and prompt length
    requests = traj.requests[:o.turns]
    for index, r in enumerate(requests):
        ids = [labels.setdefault(h, len(labels)) for h in r.ids]
        length = max(1, round(r.tokens_in * per_block / traj.block))
        gen = max(1, round(r.tokens_out / o.scale))
        if length + gen > o.max_context:
            return out, (f"kept {index} of {len(requests)} turns: turn {index} needs "
                         f"{length + gen} tokens")
        keep = min(_common_blocks(ids, prev[0]) * per_block, prev[1], length - 1)
        new = _request_tokens(tokens, agent.scope, index, ids, per_block, length, keep)
        out.append(AgentTurn(new=new, gen=gen, keep=keep))
        prev = (ids, length)
    return out, None


@dataclass
class _Report:
    """What happened to the sessions, for ``info``."""

    subagents: bool
    sessions: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    cut: dict[str, str] = field(default_factory=dict)
    skipped_count: int = 0
    cut_count: int = 0
    subagent_entries: int = 0  # listed before the parent's first dropped turn
    subagent_agents: int = 0
    copies: int = 0
    hash_hits: int = 0  # the trace's own hit rule (dualpath.workloads.sim_traces), unscaled
    hash_prompts: int = 0

    def note(self, traj: Trajectory, turns: list[AgentTurn], cut: str | None,
             o: WorkloadOptions) -> None:
        """Record one trajectory's outcome (skipped when it has no turn, cut when short)."""
        if not turns:
            self.skipped_count += 1
            if len(self.skipped) < LISTED_MAX:
                self.skipped[traj.name] = f"first turn exceeds max_context {o.max_context}"
            return
        if cut is not None:
            self.cut_count += 1
            if len(self.cut) < LISTED_MAX:
                self.cut[traj.name] = cut
        sims = chain_turns(traj.requests[:len(turns)], traj.block)
        self.hash_hits += sum(t.hit for t in sims)
        self.hash_prompts += sum(t.prompt for t in sims)

    def info(self, source: str, o: WorkloadOptions) -> dict[str, Any]:
        """The report as ``info`` fields."""
        subs = (f"{SUBAGENTS_AGENTS}: {self.subagent_agents} agents of "
                f"{self.subagent_entries} entries" if self.subagents else
                f"{SUBAGENTS_SKIPPED}: {self.subagent_entries} entries listed before the "
                "kept sessions' first dropped turns")
        return {"source": source, "scale": o.scale, "max_context": o.max_context,
                "turns_limit": o.turns, "sessions": self.sessions, "copies": self.copies,
                "skipped": self.skipped, "skipped_count": self.skipped_count,
                "cut": self.cut, "cut_count": self.cut_count, "subagents": subs,
                "hash_hit_rate": self.hash_hits / max(1, self.hash_prompts)}


def _session_agents(session: _Session, o: WorkloadOptions, tokens: _Tokens,
                    report: _Report) -> list[list[AgentTurn]]:
    """The agents of one session: its top-level trajectory, then (``o.subagents``) each
    sub-agent listed before the first dropped top-level turn. Empty when it is skipped."""
    parent, cut = _trace_agent(session.parent, o, tokens)
    report.note(session.parent.trajectory, parent, cut, o)
    if not parent:
        return []
    agents = [parent]
    for sub in session.subagents_within(len(parent)):
        report.subagent_entries += 1
        if o.subagents:
            turns, sub_cut = _trace_agent(sub, o, tokens)
            report.note(sub.trajectory, turns, sub_cut, o)
            if turns:
                agents.append(turns)
                report.subagent_agents += 1
    return agents


def _collect(sessions: Iterable[_Session], o: WorkloadOptions, source: str,
             what: str) -> tuple[list[list[AgentTurn]], dict[str, Any]]:
    """Agents of the first ``o.agents`` sessions that fit, then copies of those if too few."""
    tokens, report = _Tokens(o.seed, o.vocab_size), _Report(o.subagents)
    used: list[_Session] = []
    agents: list[list[AgentTurn]] = []
    for session in sessions:
        if o.agents is not None and len(used) == o.agents:
            break
        made = _session_agents(session, o, tokens, report)
        if made:
            used.append(session)
            report.sessions.append(session.session.parent.name)
            agents += made
    if not used:
        raise ValueError(f"no {what} of {source} has a first turn within max_context "
                         f"{o.max_context} at scale {o.scale}")
    for k in range((o.agents or len(used)) - len(used)):
        agents += _session_agents(used[k % len(used)].copy(k // len(used) + 1), o, tokens,
                                  _Report(o.subagents))
        report.copies += 1
    return agents, report.info(source, o)


def weka_agents(members: Iterable[tuple[str, Any]], source: str,
                o: WorkloadOptions) -> tuple[list[list[AgentTurn]], dict[str, Any]]:
    """Agents and ``info`` of Weka sessions (``(member name, parsed session)`` pairs, in
    order, read by :func:`dualpath.workloads.weka.weka_sessions`; an archive stream is closed
    once enough are read).

    Raises ``ValueError`` for a malformed session or when none fits ``o.max_context``.
    """
    stream = weka_sessions(members, source)
    try:
        agents, info = _collect((_Session(s, s.parent.name) for s in stream), o, source,
                                "session")
    finally:
        stream.close()  # stop reading an archive early
    info["trace_block"] = WEKA_BLOCK
    return agents, info


def mooncake_agents(path: Path,
                    o: WorkloadOptions) -> tuple[list[list[AgentTurn]], dict[str, Any]]:
    """Agents and ``info`` of the conversations of a Mooncake JSONL file (grouped by
    :mod:`dualpath.workloads.mooncake`), each conversation its own token scope.

    Raises ``ValueError`` for a malformed line or when none fits ``o.max_context``.
    """
    sessions = (_Session(c, f"mooncake/{i}") for i, c in enumerate(mooncake_conversations(path)))
    agents, info = _collect(sessions, o, str(path), "conversation")
    info["trace_block"] = MOONCAKE_BLOCK
    info["subagents"] = "none in this format"
    return agents, info
