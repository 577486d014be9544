"""Trace workloads for :mod:`dualpath.workloads.agents`: recorded sessions (read by
:mod:`dualpath.workloads.weka` and :mod:`dualpath.workloads.mooncake`) as token-level agent
turns (the rules are that module's doc).

Each trajectory (a Weka session's top-level requests, one sub-agent's, or a Mooncake
conversation) has a token scope; its hash ids, relabelled 0, 1, … by first appearance in it,
become ``round(B / scale)`` seeded tokens each, drawn from (seed, scope, id).

**A window of turns** (``first_turn`` k > 1, top-level trajectories): the timed turns are
requests k, k + 1, …; request k − 1 is the agent's primer, stored untimed before them (the turn
an agent in its stride has just run), so request k hits what the trace says it shares with
k − 1. A request's tokens do not depend on the window (ids are labelled from the trajectory's
first request, tails keyed by the request's own index), and the first timed turn carries its
whole prompt (``keep`` 0, the primer's shared prefix in ``new``), so the timed turns replay
without the primer's context. With k = 1, and for sub-agents, an agent's primer is its first
turn itself (its system and tool prompt, which deployments keep cached).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dualpath.workloads.mooncake import MOONCAKE_BLOCK, mooncake_conversations
from dualpath.workloads.sim_traces import chain_turns
from dualpath.workloads.turns import AgentTurn, Request, Session, Trajectory
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
    first_turn: int = 1  # the top-level request (1-based) the timed window starts at

    def __post_init__(self) -> None:
        for name, low in (("vocab_size", FIRST_TOKEN + 2), ("block_size", 1), ("scale", 1),
                          ("max_context", 2), ("first_turn", 1)):
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

    def subagents_within(self, parent_turns: int, first_listed: int = 0) -> list[_Agent]:
        """The sub-agents listed before top-level turn ``parent_turns`` (the reader's rule) and
        after the first ``first_listed`` top-level requests (those before a window's primer)."""
        return [_Agent(t, t.name + self.suffix)
                for t in self.session.subagents_within(parent_turns, first_listed)]

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


@dataclass(frozen=True)
class TraceAgents:
    """What a trace gives :func:`dualpath.workloads.agents.load_workload`: each agent's timed
    turns, each agent's primer (stored untimed before them: module doc) and ``info``."""

    agents: list[list[AgentTurn]]
    primers: list[AgentTurn]
    info: dict[str, Any]


@dataclass(frozen=True)
class _Made:
    """One trajectory's timed turns, its primer, the recorded requests replayed (the primer's
    first when it is another request: ``lead`` 1) and why it was cut short (None: not)."""

    turns: list[AgentTurn]
    primer: AgentTurn | None
    requests: tuple[Request, ...]
    lead: int
    cut: str | None = None


def _labels(requests: Iterable[Request]) -> dict[int, int]:
    """Hash ids relabelled 0, 1, … by first appearance in ``requests``."""
    labels: dict[int, int] = {}
    for r in requests:
        for h in r.ids:
            labels.setdefault(h, len(labels))
    return labels


def _trace_agent(agent: _Agent, o: WorkloadOptions, tokens: _Tokens,
                 first_turn: int = 1) -> _Made:
    """A trajectory's timed turns from request ``first_turn`` (1-based) on and its primer
    (module doc), and why it was cut short. No turns when the trajectory is too short for the
    window or its first turn (or its primer) exceeds ``o.max_context``."""
    traj = agent.trajectory
    per_block = round(traj.block / o.scale)
    if per_block < 1:
        raise ValueError(f"scale {o.scale} leaves no token per {traj.block}-token hash "
                         f"block (at most {2 * traj.block - 1})")
    start = first_turn - 1
    lead = 1 if start else 0
    end = len(traj.requests) if o.turns is None else min(len(traj.requests), start + o.turns)
    if end <= start:
        return _Made([], None, (), lead, f"{len(traj.requests)} requests, none from request "
                     f"{first_turn} on")
    labels = _labels(traj.requests[:start - lead])
    chain: list[AgentTurn] = []
    cut = None
    prev: tuple[Sequence[int], int] = ((), 0)  # previous ids and prompt length
    for index in range(start - lead, end):
        r = traj.requests[index]
        ids = [labels.setdefault(h, len(labels)) for h in r.ids]
        length = max(1, round(r.tokens_in * per_block / traj.block))
        gen = max(1, round(r.tokens_out / o.scale))
        if length + gen > o.max_context:
            cut = (f"kept {max(0, len(chain) - lead)} of {end - start} turns: turn {index} "
                   f"needs {length + gen} tokens")
            break
        keep = min(_common_blocks(ids, prev[0]) * per_block, prev[1], length - 1)
        new = _request_tokens(tokens, agent.scope, index, ids, per_block, length, keep)
        chain.append(AgentTurn(new=new, gen=gen, keep=keep, think_s=r.think_s / o.scale))
        prev = (ids, length)
    replayed = traj.requests[start - lead:start - lead + len(chain)]
    if len(chain) <= lead:
        what = "first turn" if chain or not lead else f"primer (request {start})"
        return _Made([], None, replayed, lead, f"{what} exceeds max_context {o.max_context}")
    if not lead:
        return _Made(chain, chain[0], replayed, lead, cut)
    primer, first = chain[0], chain[1]
    whole_first = AgentTurn(primer.new[:first.keep] + first.new, first.gen, keep=0,
                            think_s=first.think_s)
    # untimed: what it stores is its prompt (its generated tokens never recur in a trace)
    return _Made([whole_first, *chain[2:]], AgentTurn(primer.new, 1, keep=0), replayed, lead,
                 cut)


@dataclass
class _Report:
    """What happened to the sessions, for ``info``."""

    subagents: bool
    sessions: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    cut: dict[str, str] = field(default_factory=dict)
    skipped_count: int = 0
    cut_count: int = 0
    subagent_entries: int = 0  # listed between the parent's primer and first dropped turn
    subagent_agents: int = 0
    copies: int = 0
    hash_hits: int = 0  # the trace's own hit rule (dualpath.workloads.sim_traces), unscaled
    hash_prompts: int = 0

    def note(self, traj: Trajectory, made: _Made, o: WorkloadOptions) -> None:
        """Record one trajectory's outcome (skipped when it has no turn, cut when short) and
        the trace's own hits of its timed requests (each against the request before it, the
        first against the primer; 0 when the primer is the request itself)."""
        if not made.turns:
            self.skipped_count += 1
            if len(self.skipped) < LISTED_MAX:
                self.skipped[traj.name] = made.cut or "no turn"
            return
        if made.cut is not None:
            self.cut_count += 1
            if len(self.cut) < LISTED_MAX:
                self.cut[traj.name] = made.cut
        sims = chain_turns(made.requests, traj.block)[made.lead:]
        self.hash_hits += sum(t.hit for t in sims)
        self.hash_prompts += sum(t.prompt for t in sims)

    def info(self, source: str, o: WorkloadOptions) -> dict[str, Any]:
        """The report as ``info`` fields."""
        subs = (f"{SUBAGENTS_AGENTS}: {self.subagent_agents} agents of "
                f"{self.subagent_entries} entries" if self.subagents else
                f"{SUBAGENTS_SKIPPED}: {self.subagent_entries} entries listed before the "
                "kept sessions' first dropped turns")
        return {"source": source, "scale": o.scale, "max_context": o.max_context,
                "turns_limit": o.turns, "first_turn": o.first_turn, "sessions": self.sessions,
                "copies": self.copies, "skipped": self.skipped,
                "skipped_count": self.skipped_count, "cut": self.cut,
                "cut_count": self.cut_count, "subagents": subs,
                "hash_hit_rate": self.hash_hits / max(1, self.hash_prompts)}


def _session_agents(session: _Session, o: WorkloadOptions, tokens: _Tokens,
                    report: _Report) -> list[tuple[list[AgentTurn], AgentTurn]]:
    """The agents of one session, each with its primer: its top-level trajectory's window,
    then (``o.subagents``) each sub-agent listed between the parent's primer and its first
    dropped turn. Empty when it is skipped."""
    parent = _trace_agent(session.parent, o, tokens, o.first_turn)
    report.note(session.parent.trajectory, parent, o)
    if not parent.turns or parent.primer is None:
        return []
    agents = [(parent.turns, parent.primer)]
    start = o.first_turn - 1
    for sub in session.subagents_within(start + len(parent.turns), start):
        report.subagent_entries += 1
        if o.subagents:
            made = _trace_agent(sub, o, tokens)
            report.note(sub.trajectory, made, o)
            if made.turns and made.primer is not None:
                agents.append((made.turns, made.primer))
                report.subagent_agents += 1
    return agents


def _collect(sessions: Iterable[_Session], o: WorkloadOptions, source: str,
             what: str) -> TraceAgents:
    """Agents of the first ``o.agents`` sessions that fit, then copies of those if too few."""
    tokens, report = _Tokens(o.seed, o.vocab_size), _Report(o.subagents)
    used: list[_Session] = []
    made: list[tuple[list[AgentTurn], AgentTurn]] = []
    for session in sessions:
        if o.agents is not None and len(used) == o.agents:
            break
        agents = _session_agents(session, o, tokens, report)
        if agents:
            used.append(session)
            report.sessions.append(session.session.parent.name)
            made += agents
    if not used:
        window = f" from request {o.first_turn} on" if o.first_turn > 1 else ""
        raise ValueError(f"no {what} of {source} has a first turn{window} within max_context "
                         f"{o.max_context} at scale {o.scale}")
    for k in range((o.agents or len(used)) - len(used)):
        made += _session_agents(used[k % len(used)].copy(k // len(used) + 1), o, tokens,
                                _Report(o.subagents))
        report.copies += 1
    return TraceAgents([turns for turns, _ in made], [primer for _, primer in made],
                       report.info(source, o))


def weka_agents(members: Iterable[tuple[str, Any]], source: str,
                o: WorkloadOptions) -> TraceAgents:
    """Agents, primers and ``info`` of Weka sessions (``(member name, parsed session)``
    pairs, in order, read by :func:`dualpath.workloads.weka.weka_sessions`; an archive stream
    is closed once enough are read).

    Raises ``ValueError`` for a malformed session or when none fits ``o.max_context``.
    """
    stream = weka_sessions(members, source)
    try:
        made = _collect((_Session(s, s.parent.name) for s in stream), o, source, "session")
    finally:
        stream.close()  # stop reading an archive early
    made.info["trace_block"] = WEKA_BLOCK
    return made


def mooncake_agents(path: Path, o: WorkloadOptions) -> TraceAgents:
    """Agents, primers and ``info`` of the conversations of a Mooncake JSONL file (grouped by
    :mod:`dualpath.workloads.mooncake`), each conversation its own token scope.

    Raises ``ValueError`` for a malformed line or when none fits ``o.max_context``.
    """
    sessions = (_Session(c, f"mooncake/{i}") for i, c in enumerate(mooncake_conversations(path)))
    made = _collect(sessions, o, str(path), "conversation")
    made.info["trace_block"] = MOONCAKE_BLOCK
    made.info["subagents"] = "none in this format"
    return made
