"""Trace workloads for :mod:`dualpath.workloads.agents`: finding Weka and Mooncake traces and
turning their requests into token-level agent turns (the rules are that module's doc).

Each trajectory (a Weka session's top-level requests, one sub-agent's, or a Mooncake
conversation) has a token scope; its hash ids, relabelled 0, 1, … by first appearance in it,
become ``round(B / scale)`` seeded tokens each, drawn from (seed, scope, id).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dualpath.bench.cluster import AgentTurn
from dualpath.workloads import sim_traces as traces

FIRST_TOKEN = 3  # lowest token id drawn (ids below are special tokens in common vocabularies)
LISTED_MAX = 20  # names listed per info entry (skipped, cut); the counts are complete
SUBAGENTS_SKIPPED = "skipped (as in dualpath.workloads.sim_traces)"
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


# -- traces: finding them -----------------------------------------------------------------------


def traces_folder(name: str, trace_dir: Path | str | None) -> Path:
    """``trace_dir``, else ``$DUALPATH_TRACES_DIR``, for workload ``name``.

    Raises ``ValueError`` naming ``--trace-dir`` and the variable when neither is given or the
    path does not exist.
    """
    hint = f"pass --trace-dir or set {traces.ENV_DIR}"
    if trace_dir is None:
        trace_dir = os.environ.get(traces.ENV_DIR) or None
        if trace_dir is None:
            raise ValueError(f"workload {name!r} needs a traces folder: {hint} (or use the "
                             "shipped weka-sample)")
    path = Path(trace_dir)
    if not path.exists():
        raise ValueError(f"traces folder {path} for {name!r} does not exist ({hint})")
    return path


def weka_source(path: Path) -> tuple[str, Iterator[tuple[str, Any]]]:
    """(source name, ``(member name, parsed session)`` stream) of the Weka sessions at
    ``path``: an archive, a session file, or a folder holding ``weka-agentic-dev/``, a
    ``.tar.xz`` archive or ``trace_*.json`` files.

    Raises ``ValueError`` when ``path`` holds none of these, or several archives.
    """
    if path.is_dir() and (path / "weka-agentic-dev").is_dir():
        path = path / "weka-agentic-dev"
    if path.is_dir():
        archives = sorted(path.glob("*.tar.xz"))
        preferred = [a for a in archives if a.name == "weka_traces_dev.tar.xz"]
        if len(archives) > 1 and not preferred:
            names = ", ".join(a.name for a in archives)
            raise ValueError(f"{path} holds several archives ({names}): pass one of them as "
                             "--trace-dir")
        if archives:
            path = (preferred or archives)[0]
        else:
            files = sorted(path.glob("trace_*.json"))
            if not files:
                raise ValueError(f"no Weka traces in {path}: expected weka-agentic-dev/, a "
                                 ".tar.xz archive or trace_*.json files")
            return str(path), _json_files(files)
    if path.name.endswith(".tar.xz"):
        return str(path), traces.weka_members(path)
    return str(path), _json_files([path])


def _json_files(files: Sequence[Path]) -> Iterator[tuple[str, Any]]:
    """(file name, parsed JSON) of each file, read when reached."""
    for f in files:
        try:
            yield f.name, json.loads(f.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{f}: not a readable JSON file ({exc})") from exc


def mooncake_file(path: Path) -> Path:
    """The Mooncake JSONL file at ``path``: the file, or in a folder
    ``mooncake-synthetic/synthetic_trace.jsonl``, ``synthetic_trace.jsonl`` or its one
    ``.jsonl`` file.

    Raises ``ValueError`` when the folder holds none of these.
    """
    if path.is_file():
        return path
    for candidate in (path / "mooncake-synthetic" / "synthetic_trace.jsonl",
                      path / "synthetic_trace.jsonl"):
        if candidate.is_file():
            return candidate
    found = sorted(path.glob("*.jsonl"))
    if len(found) != 1:
        raise ValueError(f"no single Mooncake trace in {path}: expected "
                         "mooncake-synthetic/synthetic_trace.jsonl or one .jsonl file "
                         f"(found {len(found)})")
    return found[0]


# -- traces: requests to turns ------------------------------------------------------------------


@dataclass(frozen=True)
class _Request:
    """One recorded request: input and output tokens and its hash ids."""

    tokens_in: int
    tokens_out: int
    ids: tuple[int, ...]


@dataclass(frozen=True)
class _Trajectory:
    """One agent's recorded requests; ``scope`` keys its token ids."""

    name: str
    scope: str
    trace_block: int  # trace tokens per hash id
    requests: tuple[_Request, ...]

    def copy(self, k: int) -> _Trajectory:
        """The ``k``-th copy: same lengths, its own token ids."""
        return replace(self, scope=f"{self.scope}#copy{k}")


@dataclass(frozen=True)
class _Session:
    """A session's top-level trajectory and its sub-agents, each with the number of
    top-level requests listed before it."""

    parent: _Trajectory
    subagents: tuple[tuple[int, _Trajectory], ...] = ()

    def copy(self, k: int) -> _Session:
        """The ``k``-th copy of the session and its sub-agents."""
        return _Session(self.parent.copy(k), tuple((n, s.copy(k)) for n, s in self.subagents))


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


def _trace_agent(traj: _Trajectory, o: WorkloadOptions,
                 tokens: _Tokens) -> tuple[list[AgentTurn], str | None]:
    """A trajectory's turns (module doc) and why it was cut short (None: not cut)."""
    per_block = round(traj.trace_block / o.scale)
    if per_block < 1:
        raise ValueError(f"scale {o.scale} leaves no token per {traj.trace_block}-token hash "
                         f"block (at most {2 * traj.trace_block - 1})")
    labels: dict[int, int] = {}
    out: list[AgentTurn] = []
    prev: tuple[Sequence[int], int] = ((), 0)  # previous ids and prompt length
    requests = traj.requests[:o.turns]
    for index, r in enumerate(requests):
        ids = [labels.setdefault(h, len(labels)) for h in r.ids]
        length = max(1, round(r.tokens_in * per_block / traj.trace_block))
        gen = max(1, round(r.tokens_out / o.scale))
        if length + gen > o.max_context:
            return out, (f"kept {index} of {len(requests)} turns: turn {index} needs "
                         f"{length + gen} tokens")
        keep = min(_common_blocks(ids, prev[0]) * per_block, prev[1], length - 1)
        new = _request_tokens(tokens, traj.scope, index, ids, per_block, length, keep)
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

    def note(self, traj: _Trajectory, turns: list[AgentTurn], cut: str | None,
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
        kept = [(r.tokens_in, r.tokens_out, r.ids) for r in traj.requests[:len(turns)]]
        sims = traces.chain_turns(kept, traj.trace_block)
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
    report.note(session.parent, parent, cut, o)
    if not parent:
        return []
    agents = [parent]
    for listed_after, sub in session.subagents:
        if listed_after > len(parent):
            continue
        report.subagent_entries += 1
        if o.subagents:
            turns, sub_cut = _trace_agent(sub, o, tokens)
            report.note(sub, turns, sub_cut, o)
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
            report.sessions.append(session.parent.name)
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
    order; an archive stream is closed once enough are read).

    Raises ``ValueError`` for a malformed session or when none fits ``o.max_context``.
    """
    stream = iter(members)
    try:
        parsed = (_weka_session(Path(m).stem, d, f"{source}:{m}") for m, d in stream)
        agents, info = _collect(parsed, o, source, "session")
    finally:
        close = getattr(stream, "close", None)
        if close is not None:
            close()  # stop reading an archive early
    info["trace_block"] = traces.WEKA_BLOCK
    return agents, info


def _weka_request(r: Any) -> _Request:
    """One Weka request entry (KeyError, TypeError or ValueError when malformed)."""
    return _Request(int(r["in"]), int(r["out"]), tuple(r["hash_ids"]))


def _weka_session(name: str, data: Any, where: str) -> _Session:
    """A parsed Weka session file as a :class:`_Session`; ValueError naming ``where``."""
    try:
        block = int(data.get("block_size", traces.WEKA_BLOCK))
        top: list[_Request] = []
        subs: list[tuple[int, _Trajectory]] = []
        for r in data["requests"]:
            if r.get("type") != "subagent":
                top.append(_weka_request(r))
                continue
            sub = f"{name}/{r.get('agent_id') or f'subagent{len(subs) + 1}'}"
            reqs = tuple(_weka_request(q) for q in r["requests"] if q.get("type") != "subagent")
            subs.append((len(top), _Trajectory(sub, sub, block, reqs)))
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{where}: not a Weka session ({exc!r})") from exc
    if block < 1:
        raise ValueError(f"{where}: block_size must be >= 1, got {block}")
    return _Session(_Trajectory(name, name, block, tuple(top)), tuple(subs))


def mooncake_agents(path: Path,
                    o: WorkloadOptions) -> tuple[list[list[AgentTurn]], dict[str, Any]]:
    """Agents and ``info`` of the conversations of a Mooncake JSONL file (grouped as
    :mod:`dualpath.workloads.sim_traces` does), each conversation its own token scope.

    Raises ``ValueError`` for a malformed line or when none fits ``o.max_context``.
    """
    convs = traces.mooncake_conversations(path)
    sessions = (_Session(_Trajectory(f"conversation{i}", f"mooncake/{i}", traces.MOONCAKE_BLOCK,
                                     tuple(_Request(a, b, tuple(ids)) for a, b, ids in reqs)))
                for i, reqs in enumerate(convs))
    agents, info = _collect(sessions, o, str(path), "conversation")
    info["trace_block"] = traces.MOONCAKE_BLOCK
    info["subagents"] = "none in this format"
    return agents, info
