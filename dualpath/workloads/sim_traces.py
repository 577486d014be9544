"""Real agentic traces (``shared/traces/``) as per-agent trajectories for the simulator.

The readers (:mod:`dualpath.workloads.weka`, :mod:`dualpath.workloads.mooncake`) give recorded
sessions; this module turns each trajectory into :class:`~dualpath.workloads.turns.Turn` values
(``prompt``, ``hit``, ``gen``) and drops the hash lists once the hits are known. The folder comes
from the caller (``root``) or ``$DUALPATH_TRACES_DIR`` (:mod:`dualpath.workloads.trace_files`).
Replay rules:

* **Hit** (:func:`chain_turns`): leading ``hash_ids`` shared with the agent's previous request ×
  block size, whole blocks, at least one prompt token left; 0 on the first turn; ``gen`` is the
  recorded output, at least 1. Weka: a trajectory per session, sub-agents only with
  ``subagents=True``; Mooncake: one per conversation, 512-token blocks.
* **More agents than trajectories** (:func:`trace_trajectories`): copies drawn with replacement
  by ``random.Random(seed)``, each starting with a synthetic ``block_size``-token turn.
* **``max_context``** ends a trajectory before its first turn past it.

Why these rules, and the measured hit shares: docs/derivations.md, 'workloads/sim_traces.py'.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dualpath.workloads.mooncake import mooncake_conversations
from dualpath.workloads.trace_files import trace_file
from dualpath.workloads.turns import Request, Session, Trajectory, Turn
from dualpath.workloads.weka import weka_members, weka_sessions


@dataclass(frozen=True)
class _SimSession:
    """A recorded session as simulator turns: the top-level trajectory and each sub-agent's
    (with the top-level requests listed before it)."""

    parent: tuple[Turn, ...]
    subagents: tuple[tuple[int, tuple[Turn, ...]], ...] = ()

    @classmethod
    def of(cls, session: Session) -> _SimSession:
        """The session's trajectories as turns (:func:`chain_turns`)."""
        return cls(tuple(_turns(session.parent)),
                   tuple((s.listed_after, tuple(_turns(s.trajectory)))
                         for s in session.subagents))

    def agents(self, max_context: int | None, subagents: bool) -> list[list[Turn]]:
        """Its trajectories cut at ``max_context``: the top-level one (none when it has no
        turn left), then with ``subagents`` each sub-agent listed before the first dropped
        top-level turn that keeps a turn (the rule of :mod:`dualpath.workloads.weka`)."""
        parent = _truncate(list(self.parent), max_context)
        if not parent:
            return []
        out = [parent]
        if subagents:
            for listed_after, turns in self.subagents:
                kept = _truncate(list(turns), max_context)
                if listed_after <= len(parent) and kept:
                    out.append(kept)
        return out


# (name, file) -> (parsed sessions, whether they are all the file holds)
_CACHE: dict[tuple[str, str], tuple[list[_SimSession], bool]] = {}


def _sessions(name: str, limit: int | None, root: Path | None) -> list[_SimSession]:
    """The first ``limit`` (None: all) recorded sessions of trace ``name``, cached per file."""
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    path = trace_file(name, root)
    key = (name, str(path.resolve()))
    sessions, complete = _CACHE.get(key, ([], False))
    if not complete and (limit is None or len(sessions) < limit):
        if name == "weka":
            sessions, complete = _read_weka(path, limit)
        else:
            sessions = [_SimSession.of(c) for c in mooncake_conversations(path)]
            complete = True
        _CACHE[key] = (sessions, complete)
    return sessions[:limit]


def load_sessions(name: str, *, limit: int | None = None, root: Path | None = None,
                  subagents: bool = False) -> list[list[Turn]]:
    """The trajectories of the recorded sessions of trace ``name``, in a stable order: each
    session's top-level trajectory, then (``subagents``) its sub-agents'.

    ``limit`` keeps the first sessions only (Weka then stops reading the archive early).
    Parsed sessions are cached per (name, file); the caller gets fresh lists.
    """
    return [t for s in _sessions(name, limit, root) for t in s.agents(None, subagents)]


def trace_trajectories(name: str, agents: int, *, seed: int = 0, block_size: int = 64,
                       max_context: int | None = None, root: Path | None = None,
                       subagents: bool = False) -> list[list[Turn]]:
    """``agents`` trajectories from trace ``name``: recorded ones, then seeded copies.

    Copies start with a synthetic ``block_size``-token turn (hit 0, gen 1); ``max_context``
    truncates each trajectory before its first turn with ``prompt + gen > max_context``;
    ``subagents`` adds Weka sub-agents as trajectories of their own (module doc).
    """
    if agents < 0:
        raise ValueError(f"agents must be >= 0, got {agents}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if max_context is not None and max_context <= block_size:
        raise ValueError(f"max_context ({max_context}) must exceed block_size ({block_size})")
    if agents == 0:
        return []

    def pool_of(limit: int | None) -> list[list[Turn]]:
        return [t for s in _sessions(name, limit, root) for t in s.agents(max_context, subagents)]

    pool = pool_of(agents)
    if len(pool) < agents:
        pool = pool_of(None)
    if not pool:
        raise ValueError(f"no session of {name!r} has a turn within max_context={max_context}")
    rng = random.Random(seed)
    copies = [[_synthetic_turn(block_size), *pool[rng.randrange(len(pool))]]
              for _ in range(max(0, agents - len(pool)))]
    return [list(s) for s in pool[:agents]] + copies


def trace_summary(trajs: list[list[Turn]]) -> dict[str, float]:
    """Agents, turns (total, mean, max), mean prompt/miss/gen per turn and the hit rate."""
    turns = [t for traj in trajs for t in traj]
    n = max(1, len(turns))
    prompt = sum(t.prompt for t in turns)
    hit = sum(t.hit for t in turns)
    return {"agents": len(trajs), "turns": len(turns),
            "turns_mean": len(turns) / max(1, len(trajs)),
            "turns_max": max((len(traj) for traj in trajs), default=0),
            "prompt_mean": prompt / n, "miss_mean": (prompt - hit) / n,
            "gen_mean": sum(t.gen for t in turns) / n, "hit_rate": hit / max(1, prompt)}


def _synthetic_turn(block_size: int) -> Turn:
    """The paper's first turn for a copy: one block of random tokens, one generated token."""
    return Turn(prompt=block_size, hit=0, gen=1)


def _truncate(turns: list[Turn], max_context: int | None) -> list[Turn]:
    """The turns before the first one whose ``prompt + gen`` exceeds ``max_context``."""
    if max_context is None:
        return turns
    for i, t in enumerate(turns):
        if t.prompt + t.gen > max_context:
            return turns[:i]
    return turns


def _common_blocks(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two hash-id lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _hit(blocks: int, prompt: int, block: int) -> int:
    """Tokens served from ``blocks`` shared blocks: whole blocks, at least one token left."""
    return min(blocks, (prompt - 1) // block) * block if prompt > 0 else 0


def chain_turns(requests: Iterable[Request], block: int) -> list[Turn]:
    """Turns of recorded requests replayed in order, each hitting its common prefix of
    ``block``-token hash blocks with the request before (the module doc's hit rule)."""
    turns: list[Turn] = []
    prev: Sequence[int] = ()
    for r in requests:
        turns.append(Turn(prompt=r.tokens_in,
                          hit=_hit(_common_blocks(r.ids, prev), r.tokens_in, block),
                          gen=max(1, r.tokens_out)))
        prev = r.ids
    return turns


def _turns(trajectory: Trajectory) -> list[Turn]:
    """A recorded trajectory's turns at its own block size."""
    return chain_turns(trajectory.requests, trajectory.block)


def _read_weka(path: Path, limit: int | None) -> tuple[list[_SimSession], bool]:
    """Stream the archive's sessions; returns (sessions, whether all were read)."""
    sessions: list[_SimSession] = []
    if limit == 0:
        return sessions, False
    stream = weka_sessions(weka_members(path), str(path))
    for session in stream:
        sessions.append(_SimSession.of(session))
        if limit is not None and len(sessions) >= limit:
            stream.close()  # stop reading the archive
            return sessions, False
    return sessions, True

