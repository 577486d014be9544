"""Real agentic traces (``shared/traces/``) as per-agent trajectories for the simulator.

Each loader turns recorded requests into :class:`~dualpath.workloads.presets.Turn` values
(``prompt``, ``hit``, ``gen``); the hash lists are dropped once the hits are known. The
folder comes from the caller (``root``) or ``$DUALPATH_TRACES_DIR``; none is guessed, since a
user's clone has no ``../shared`` (the test suite points the variable there when it exists).
The replay rules, chosen to stay honest about what the traces record:

* **Hit = common prefix with the agent's previous request.** A request's hit is the number of
  leading ``hash_ids`` it shares with the previous request of its trajectory, times the trace's
  block size. The ids are prefix-consistent (equal id at position k means equal prefix up to
  k), so this is the KV a store holding the previous request's full blocks would serve. On
  Weka it covers 96.26 % of prompt tokens against 96.30 % for a per-session unbounded cache
  (README: about 96 %), so older requests add almost nothing; on Mooncake 65.0 % against
  65.1 % for one unbounded cache shared by all requests. The previous turn's *output* is not
  credited, because the hashes only cover inputs and nothing certifies the next prompt repeats
  it verbatim. A compaction (the context is rewritten and shrinks) therefore keeps only the
  system/tool prefix it still shares (typically about 15K tokens). The hit keeps whole blocks
  and leaves at least one prompt token to compute (an engine recomputes the last prompt token
  to get the first logits); the first turn has hit 0. ``gen`` is the recorded output, at least 1.
* **Weka** (``weka-agentic-dev``): one trajectory per session file, in archive order, made of
  its top-level requests (streaming ``s`` and non-streaming ``n`` alike) in recorded order,
  which is time order. ``subagent`` entries are skipped: their requests (1.8 % of the total)
  mostly run on a different, smaller model (Haiku) than the parent, use their own tool/system
  prompt and hash space, and run concurrently with the parent, so they are neither turns of
  the parent's sequential loop nor work for the same model deployment.
* **Mooncake** (``mooncake-synthetic``): requests are grouped into conversations. A request
  continues the conversation whose last request shares its longest prefix of ``hash_ids`` (at
  least one block); otherwise it starts a new one. Because the ids are prefix-consistent, two
  requests share a block exactly when their first ids match, so the conversation is the one
  keyed by the request's first id (unique: a new conversation only starts on a new first id).
  Conversations are ordered by their first request. Mooncake hashes 512-token blocks. The
  trace is not agentic: most conversations (1,803 of 2,211) are a single request, and many
  follow-ups (780 of 1,782) are shorter than the request before them (a shared document
  re-sent with another question) rather than an extension of one context.
* **More agents than sessions** (:func:`trace_trajectories`): the recorded sessions come first,
  in order; the rest are copies drawn with replacement by ``random.Random(seed)``. As in the
  paper's rule (``shared/traces/README.md``), each copy starts with a synthetic turn of
  ``block_size`` random tokens (hit 0, one generated token) so that copies share no prefix
  with their original. The copied turns keep their recorded lengths: the synthetic turn would
  shift later prompts by ``block_size + 1`` tokens (under 0.1 % of a Weka prompt), and the
  simulator takes each hit as given.
* **``max_context``** truncates a trajectory before its first turn whose ``prompt + gen``
  exceeds it (the agent stops, as a run capped at a maximum length would); sessions left with
  no turn are dropped from the pool.
"""

from __future__ import annotations

import json
import lzma
import os
import random
import tarfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from dualpath.workloads.presets import Turn

TRACES = ("weka", "mooncake")
ENV_DIR = "DUALPATH_TRACES_DIR"
_FILES = {
    "weka": Path("weka-agentic-dev") / "weka_traces_dev.tar.xz",
    "mooncake": Path("mooncake-synthetic") / "synthetic_trace.jsonl",
}
WEKA_BLOCK = 64  # tokens per hash id when a Weka file has no ``block_size`` field
# Tokens per hash id in Mooncake's FAST'25 traces (the Mooncake report's 512-token blocks);
# every request of synthetic_trace.jsonl has len(hash_ids) == ceil(input_length / 512).
MOONCAKE_BLOCK = 512

# (name, file) -> (parsed sessions, whether they are all the file holds)
_CACHE: dict[tuple[str, str], tuple[list[list[Turn]], bool]] = {}

Request = tuple[int, int, Sequence[int]]  # (prompt tokens, generated tokens, hash ids)


def trace_dir() -> Path:
    """The traces folder named by ``$DUALPATH_TRACES_DIR``.

    Raises ``ValueError`` when the variable is unset or empty: no folder outside the
    repository is guessed (a user's clone has no ``../shared``), so pass ``--trace-dir`` or
    set the variable.
    """
    env = os.environ.get(ENV_DIR)
    if not env:
        raise ValueError(f"no traces folder given: pass --trace-dir or set {ENV_DIR} to the "
                         "folder holding weka-agentic-dev/ and mooncake-synthetic/")
    return Path(env)


def trace_file(name: str, root: Path | None = None) -> Path:
    """The data file of trace ``name`` under ``root`` (default :func:`trace_dir`).

    Raises ``ValueError`` for an unknown name, a missing folder or a missing file.
    """
    if name not in _FILES:
        raise ValueError(f"unknown trace {name!r}; known: {', '.join(TRACES)}")
    folder = Path(root) if root is not None else trace_dir()
    if not folder.is_dir():
        raise ValueError(f"traces folder {folder} does not exist (pass --trace-dir or set "
                         f"{ENV_DIR})")
    path = folder / _FILES[name]
    if not path.is_file():
        raise ValueError(f"trace file {path} for {name!r} does not exist")
    return path


def load_sessions(name: str, *, limit: int | None = None,
                  root: Path | None = None) -> list[list[Turn]]:
    """One trajectory per recorded session of trace ``name``, in a stable order.

    ``limit`` keeps the first sessions only (Weka then stops reading the archive early).
    Parsed sessions are cached per (name, file); the caller gets fresh lists.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    path = trace_file(name, root)
    key = (name, str(path.resolve()))
    sessions, complete = _CACHE.get(key, ([], False))
    if not complete and (limit is None or len(sessions) < limit):
        if name == "weka":
            sessions, complete = _read_weka(path, limit)
        else:
            sessions, complete = _read_mooncake(path), True
        _CACHE[key] = (sessions, complete)
    return [list(s) for s in sessions[:limit]]


def trace_trajectories(name: str, agents: int, *, seed: int = 0, block_size: int = 64,
                       max_context: int | None = None,
                       root: Path | None = None) -> list[list[Turn]]:
    """``agents`` trajectories from trace ``name``: recorded sessions, then seeded copies.

    Copies start with a synthetic ``block_size``-token turn (hit 0, gen 1); ``max_context``
    truncates each trajectory before its first turn with ``prompt + gen > max_context``.
    """
    if agents < 0:
        raise ValueError(f"agents must be >= 0, got {agents}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if max_context is not None and max_context <= block_size:
        raise ValueError(f"max_context ({max_context}) must exceed block_size ({block_size})")
    if agents == 0:
        return []
    pool = _fitting(load_sessions(name, limit=agents, root=root), max_context)
    if len(pool) < agents:
        pool = _fitting(load_sessions(name, root=root), max_context)
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


def _fitting(sessions: list[list[Turn]], max_context: int | None) -> list[list[Turn]]:
    """Sessions truncated at ``max_context``; those left empty are dropped."""
    if max_context is None:
        return sessions
    out = []
    for turns in sessions:
        kept = _truncate(turns, max_context)
        if kept:
            out.append(kept)
    return out


def _truncate(turns: list[Turn], max_context: int) -> list[Turn]:
    """The turns before the first one whose ``prompt + gen`` exceeds ``max_context``."""
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
    """Turns of ``(prompt, gen, hash ids)`` requests replayed in order, each hitting its
    common prefix of ``block``-token hash blocks with the request before (the module doc's hit
    rule)."""
    turns: list[Turn] = []
    prev: Sequence[int] = ()
    for prompt, gen, ids in requests:
        turns.append(Turn(prompt=prompt, hit=_hit(_common_blocks(ids, prev), prompt, block),
                          gen=max(1, gen)))
        prev = ids
    return turns


def _weka_session(data: Any, where: str) -> list[Turn]:
    """The trajectory of one parsed Weka session (top-level requests, sub-agents skipped)."""
    try:
        block = int(data.get("block_size", WEKA_BLOCK))
        reqs = [(int(r["in"]), int(r["out"]), r["hash_ids"])
                for r in data["requests"] if r.get("type") != "subagent"]
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{where}: not a Weka session ({exc!r})") from exc
    if block < 1:
        raise ValueError(f"{where}: block_size must be >= 1, got {block}")
    return chain_turns(reqs, block)


def _read_json(stream: IO[bytes] | None, where: str) -> Any:
    """Parse one archive member, naming it on failure."""
    if stream is None:
        raise ValueError(f"{where}: cannot read the member")
    try:
        return json.load(stream)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise ValueError(f"{where}: bad JSON ({exc})") from exc


def weka_members(path: Path) -> Iterator[tuple[str, Any]]:
    """(member name, parsed JSON) of each ``.json`` member of a Weka archive, streamed in
    archive order (closing the generator stops reading the archive).

    Raises ``ValueError`` for an unreadable archive or a member that is not JSON.
    """
    try:
        with tarfile.open(path, "r:xz") as tar:
            for member in tar:
                if member.isfile() and member.name.endswith(".json"):
                    where = f"{path}:{member.name}"
                    yield member.name, _read_json(tar.extractfile(member), where)
    except (tarfile.TarError, lzma.LZMAError, EOFError, OSError) as exc:
        raise ValueError(f"cannot read Weka archive {path}: {exc}") from exc


def weka_sessions(path: Path) -> Iterator[tuple[str, list[Turn]]]:
    """(member name, trajectory) of each session in a Weka archive, streamed in archive order.

    Raises ``ValueError`` for an unreadable archive or a member that is not a Weka session.
    """
    members = weka_members(path)
    try:
        for name, data in members:
            yield name, _weka_session(data, f"{path}:{name}")
    finally:
        members.close()


def _read_weka(path: Path, limit: int | None) -> tuple[list[list[Turn]], bool]:
    """Stream the archive's ``.json`` members; returns (sessions, whether all were read)."""
    sessions: list[list[Turn]] = []
    if limit == 0:
        return sessions, False
    stream = weka_sessions(path)
    for _, turns in stream:
        sessions.append(turns)
        if limit is not None and len(sessions) >= limit:
            stream.close()  # stop reading the archive
            return sessions, False
    return sessions, True


def _read_mooncake(path: Path) -> list[list[Turn]]:
    """Mooncake conversations (see the module doc), in order of their first request."""
    return [chain_turns(reqs, MOONCAKE_BLOCK) for reqs in mooncake_conversations(path)]


def mooncake_conversations(path: Path) -> list[list[Request]]:
    """The requests ``(input, output, hash ids)`` of a Mooncake JSONL file grouped into
    conversations (see the module doc), in order of their first request.

    Raises ``ValueError`` naming the line that is not a Mooncake request.
    """
    convs: dict[object, list[Request]] = {}
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            prompt, gen, ids = _mooncake_request(line, f"{path}:{i}")
            convs.setdefault(ids[0] if ids else ("no-hash", i), []).append((prompt, gen, ids))
    return list(convs.values())


def _mooncake_request(line: str, where: str) -> Request:
    """(input, output, hash ids) of one Mooncake JSON line, naming it on failure."""
    try:
        r = json.loads(line)
        return int(r["input_length"]), int(r["output_length"]), list(r["hash_ids"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{where}: not a Mooncake request ({exc!r})") from exc
