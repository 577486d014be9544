"""The one reader of the Weka agentic traces (``weka-agentic-dev``), for every workload.

Archive members → sessions → one trajectory per agent. A session file (``trace_*.json``, in
``weka_traces_dev.tar.xz`` or loose) holds ``block_size`` (64 when absent) and ``requests`` in
recorded order, which is time order: top-level requests (streaming ``s`` and non-streaming
``n`` alike), each with ``in`` and ``out`` token counts and ``hash_ids``, and ``subagent``
entries, each holding that sub-agent's own ``requests`` (and usually an ``agent_id``).
:func:`read_session` makes it a :class:`~dualpath.workloads.turns.Session`; the simulator
(:mod:`dualpath.workloads.sim_traces`) and the token-level workloads
(:mod:`dualpath.workloads.trace_tokens`) both read sessions through :func:`weka_sessions`.

**Sub-agents: a trajectory of their own, used only when asked.** The reader never splices a
sub-agent into its parent: the session's top-level requests are one trajectory (named after the
file), and each ``subagent`` entry is another (``<file>/<agent_id>``, or ``<file>/subagentN``
without one), with the number of top-level requests listed before it; ``subagent`` entries
nested inside a sub-agent are skipped. Sub-agents run concurrently with their parent, start
from their own tool/system prompt and hash space, and mostly on a smaller model (Haiku) than the
parent; they hold 1.8 % of the archive's requests. So both workload paths apply one selection
rule (:meth:`~dualpath.workloads.turns.Session.subagents_within`): by default they replay the
top-level trajectories only; with ``subagents=True`` each sub-agent listed before the parent's
first dropped turn (a trajectory cut at ``max_context`` or ``turns``) is an agent of its own,
right after its parent, and its hits come from its own earlier requests only.
"""

from __future__ import annotations

import json
import lzma
import tarfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from dualpath.workloads.turns import Request, Session, SubAgent, Trajectory

WEKA_BLOCK = 64  # tokens per hash id when a session file has no ``block_size`` field
ARCHIVE = "weka_traces_dev.tar.xz"


def read_session(name: str, data: Any, where: str) -> Session:
    """A parsed Weka session file (the module doc's rule); ``name`` names its top-level
    trajectory. Raises ``ValueError`` naming ``where`` when it is not a Weka session."""
    try:
        block = int(data.get("block_size", WEKA_BLOCK))
        top: list[Request] = []
        subs: list[SubAgent] = []
        for r in data["requests"]:
            if r.get("type") != "subagent":
                top.append(_request(r))
                continue
            sub = f"{name}/{r.get('agent_id') or f'subagent{len(subs) + 1}'}"
            reqs = tuple(_request(q) for q in r["requests"] if q.get("type") != "subagent")
            subs.append(SubAgent(len(top), Trajectory(sub, block, reqs)))
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{where}: not a Weka session ({exc!r})") from exc
    if block < 1:
        raise ValueError(f"{where}: block_size must be >= 1, got {block}")
    return Session(Trajectory(name, block, tuple(top)), tuple(subs))


def _request(r: Any) -> Request:
    """One request entry (KeyError, TypeError or ValueError when malformed)."""
    think_s = float(r.get("think_time") or 0.0)
    if not think_s >= 0:
        raise ValueError(f"think_time must be >= 0, got {r.get('think_time')!r}")
    return Request(int(r["in"]), int(r["out"]), tuple(r["hash_ids"]), think_s)


def weka_sessions(members: Iterable[tuple[str, Any]], source: str) -> Iterator[Session]:
    """The sessions of ``(member name, parsed JSON)`` pairs, in order, each named by its
    member's stem; closing this generator closes ``members`` (stops reading an archive).

    Raises ``ValueError`` for a member that is not a Weka session.
    """
    stream = iter(members)
    try:
        for member, data in stream:
            yield read_session(Path(member).stem, data, f"{source}:{member}")
    finally:
        close = getattr(stream, "close", None)
        if close is not None:
            close()


def weka_members(archive: Path) -> Iterator[tuple[str, Any]]:
    """(member name, parsed JSON) of each ``.json`` member of a Weka archive, streamed in
    archive order (closing the generator stops reading the archive).

    Raises ``ValueError`` for an unreadable archive or a member that is not JSON.
    """
    try:
        with tarfile.open(archive, "r:xz") as tar:
            for member in tar:
                if member.isfile() and member.name.endswith(".json"):
                    where = f"{archive}:{member.name}"
                    yield member.name, _read_json(tar.extractfile(member), where)
    except (tarfile.TarError, lzma.LZMAError, EOFError, OSError) as exc:
        raise ValueError(f"cannot read Weka archive {archive}: {exc}") from exc


def _read_json(stream: IO[bytes] | None, where: str) -> Any:
    """Parse one archive member, naming it on failure."""
    if stream is None:
        raise ValueError(f"{where}: cannot read the member")
    try:
        return json.load(stream)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise ValueError(f"{where}: bad JSON ({exc})") from exc


def weka_source(path: Path) -> tuple[str, Iterator[tuple[str, Any]]]:
    """(source name, ``(member name, parsed JSON)`` stream) of the Weka sessions at ``path``:
    an archive, a session file, or a folder holding ``weka-agentic-dev/``, a ``.tar.xz``
    archive or ``trace_*.json`` files.

    Raises ``ValueError`` when ``path`` holds none of these, or several archives.
    """
    if path.is_dir() and (path / "weka-agentic-dev").is_dir():
        path = path / "weka-agentic-dev"
    if path.is_dir():
        archives = sorted(path.glob("*.tar.xz"))
        preferred = [a for a in archives if a.name == ARCHIVE]
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
        return str(path), weka_members(path)
    return str(path), _json_files([path])


def _json_files(files: Sequence[Path]) -> Iterator[tuple[str, Any]]:
    """(file name, parsed JSON) of each file, read when reached."""
    for f in files:
        try:
            yield f.name, json.loads(f.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{f}: not a readable JSON file ({exc})") from exc
