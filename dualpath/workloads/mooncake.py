"""The one reader of the Mooncake trace format (``mooncake-synthetic``), for every workload.

A JSONL file of requests (``input_length``, ``output_length``, ``hash_ids`` of 512-token
blocks, the Mooncake report's block size: every request of ``synthetic_trace.jsonl`` has
``len(hash_ids) == ceil(input_length / 512)``) grouped into conversations, each a
:class:`~dualpath.workloads.turns.Session` with no sub-agents. A request continues the
conversation whose last request shares its longest prefix of ``hash_ids`` (at least one
block); otherwise it starts a new one. Because the ids are prefix-consistent (equal id at
position k means equal prefix up to k), two requests share a block exactly when their first ids
match, so the conversation is the one keyed by the request's first id (unique: a new
conversation only starts on a new first id). Conversations are ordered by their first request
and named ``conversation<i>``. The trace is not agentic: most conversations (1,803 of 2,211)
are a single request, and many follow-ups (780 of 1,782) are shorter than the request before
them (a shared document re-sent with another question) rather than an extension of one context.
"""

from __future__ import annotations

import json
from pathlib import Path

from dualpath.workloads.turns import Request, Session, Trajectory

MOONCAKE_BLOCK = 512  # tokens per hash id
TRACE_FILE = "synthetic_trace.jsonl"


def mooncake_conversations(path: Path) -> list[Session]:
    """The conversations of a Mooncake JSONL file (the module doc's grouping), in order of
    their first request.

    Raises ``ValueError`` naming the line that is not a Mooncake request.
    """
    convs: dict[object, list[Request]] = {}
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            r = _request(line, f"{path}:{i}")
            convs.setdefault(r.ids[0] if r.ids else ("no-hash", i), []).append(r)
    return [Session(Trajectory(f"conversation{i}", MOONCAKE_BLOCK, tuple(reqs)))
            for i, reqs in enumerate(convs.values())]


def _request(line: str, where: str) -> Request:
    """One Mooncake JSON line as a request, naming it on failure."""
    try:
        r = json.loads(line)
        return Request(int(r["input_length"]), int(r["output_length"]), tuple(r["hash_ids"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{where}: not a Mooncake request ({exc!r})") from exc


def mooncake_file(path: Path) -> Path:
    """The Mooncake JSONL file at ``path``: the file, or in a folder
    ``mooncake-synthetic/synthetic_trace.jsonl``, ``synthetic_trace.jsonl`` or its one
    ``.jsonl`` file.

    Raises ``ValueError`` when the folder holds none of these.
    """
    if path.is_file():
        return path
    for candidate in (path / "mooncake-synthetic" / TRACE_FILE, path / TRACE_FILE):
        if candidate.is_file():
            return candidate
    found = sorted(path.glob("*.jsonl"))
    if len(found) != 1:
        raise ValueError(f"no single Mooncake trace in {path}: expected "
                         f"mooncake-synthetic/{TRACE_FILE} or one .jsonl file "
                         f"(found {len(found)})")
    return found[0]
