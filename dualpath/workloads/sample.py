"""The Weka sample shipped in the package (``workloads/data/weka_sample.json``): format, maker.

A user's clone has no ``../shared``, so ``dualpath bench agents --workload weka-sample`` reads
this excerpt of the Weka agentic dev traces (GitHub ``callanjfox/kv-cache-tester``, Apache-2.0;
the license and NOTICE are in ``dualpath/workloads/data/LICENSE-weka``). Unlike
``weka_demo.json``, which keeps token counts only, the sample keeps each request's block hash
ids, so :mod:`dualpath.workloads.agents` turns it into token ids exactly as it turns the full
archive.

What it holds (:func:`reduce_session`): the first :data:`SESSIONS` sessions in archive order
that reach top-level request :data:`FIRST_TURN` (the one ``dualpath bench agents`` times from:
an agent in its stride, whose turns reload 98% of their context, where a session's early turns
reload less); of each, its top-level requests up to request ``FIRST_TURN - 1 + TURNS`` (the
earlier ones too, so that every request gets the token ids the full archive gives it) and the
sub-agent entries listed from request ``FIRST_TURN - 1`` on before the next top-level request,
every sub-agent cut to its first :data:`TURNS` requests. Of a request only ``type``, ``in``,
``out`` and the hash ids are kept (``agent_id`` for a sub-agent entry).

Compact ids (:func:`renumber`, :func:`encode_ids`): a session's hash ids are relabelled 1, 2, …
in order of first appearance over the whole file (parent first, sub-agents where they are
listed; the ids are file-scoped, so one relabelling keeps every equality the trace records),
then stored as runs: a flat list ``[start, count, start, count, …]``. The loader relabels the
ids of each trajectory (a session's top-level requests, or one sub-agent's) by first appearance
within it, so the kept requests get the very token ids the full archive gives them.

Remake it with ``dualpath workloads sample [--trace-dir DIR]``; the traces
folder is ``DIR`` or ``$DUALPATH_TRACES_DIR``.
"""

from __future__ import annotations

import csv
import json
import sys
import textwrap
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dualpath.workloads.notices import with_notice

if TYPE_CHECKING:
    from argparse import ArgumentParser

SESSIONS = 32  # leading sessions of the archive that reach FIRST_TURN, kept
FIRST_TURN = 21  # the top-level request (1-based) a timed window starts at by default
TURNS = 8  # top-level requests kept from FIRST_TURN on (and requests per sub-agent)
SAMPLE_FILE = "weka_sample.json"
LICENSE_FILE = "LICENSE-weka"
UPSTREAM = "https://github.com/callanjfox/kv-cache-tester (folder traces/)"


def renumber(data: dict[str, Any]) -> dict[str, Any]:
    """A copy of a Weka session whose hash ids are 1, 2, … in order of first appearance
    (top-level requests and sub-agents' nested requests, in listed order)."""
    labels: dict[Any, int] = {}

    def relabel(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for r in requests:
            r = dict(r)
            if r.get("type") == "subagent":
                r["requests"] = relabel(r.get("requests", []))
            elif "hash_ids" in r:
                r["hash_ids"] = [labels.setdefault(h, len(labels) + 1) for h in r["hash_ids"]]
            out.append(r)
        return out

    return {**data, "requests": relabel(data.get("requests", []))}


def encode_ids(ids: Sequence[int]) -> list[int]:
    """Runs of consecutive ids as a flat ``[start, count, start, count, …]`` list."""
    out: list[int] = []
    for h in ids:
        if out and h == out[-2] + out[-1]:
            out[-1] += 1
        else:
            out += [h, 1]
    return out


def decode_ids(runs: Sequence[int]) -> list[int]:
    """The ids of a flat ``[start, count, …]`` run list (:func:`encode_ids`'s inverse).

    Raises ``ValueError`` when the list has an odd length or a negative count.
    """
    if len(runs) % 2 or any(n < 0 for n in runs[1::2]):
        raise ValueError(f"bad id runs {list(runs)[:6]}…: want [start, count, …] pairs")
    return [start + k for start, n in zip(runs[::2], runs[1::2], strict=True)
            for k in range(n)]


def top_level_requests(data: dict[str, Any]) -> int:
    """How many top-level requests a Weka session has."""
    return sum(r.get("type") != "subagent" for r in data["requests"])


def reduce_session(data: dict[str, Any], first_turn: int = FIRST_TURN,
                   turns: int = TURNS) -> dict[str, Any]:
    """The top-level requests of a Weka session up to request ``first_turn - 1 + turns``
    (1-based) and the sub-agent entries listed from request ``first_turn - 1`` on before the
    next one, each sub-agent cut to ``turns`` requests; of every request only ``type``,
    ``in``, ``out``, ``hash_ids``, ``think_time`` (the tool time before it, where recorded) and
    a sub-agent's ``agent_id``."""
    kept, top, last = [], 0, first_turn - 1 + turns
    for r in data["requests"]:
        if r.get("type") == "subagent":
            if top >= first_turn - 1:
                kept.append({"type": "subagent", "agent_id": r.get("agent_id"),
                             "requests": [_slim(q) for q in r["requests"][:turns]]})
        elif top < last:
            kept.append(_slim(r))
            top += 1
        else:
            break
    return {"block_size": data.get("block_size", 64), "requests": kept}


def _slim(r: dict[str, Any]) -> dict[str, Any]:
    return {"type": r.get("type"), "in": r["in"], "out": r["out"], "hash_ids": r["hash_ids"],
            "think_time": r.get("think_time", 0.0)}


def _compact(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Requests with ``hash_ids`` stored as runs under ``ids``."""
    out = []
    for r in requests:
        if r.get("type") == "subagent":
            out.append({**r, "requests": _compact(r["requests"])})
        else:
            out.append({"type": r["type"], "in": r["in"], "out": r["out"],
                        "ids": encode_ids(r["hash_ids"]),
                        **({"think": r["think_time"]} if r.get("think_time") else {})})
    return out


def _expand(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`_compact`'s inverse: the Weka request format."""
    out = []
    for r in requests:
        if r.get("type") == "subagent":
            out.append({**r, "requests": _expand(r["requests"])})
        else:
            out.append({"type": r["type"], "in": r["in"], "out": r["out"],
                        "hash_ids": decode_ids(r["ids"]), "think_time": r.get("think", 0.0)})
    return out


def read_sample(path: Path | None = None) -> tuple[list[tuple[str, dict[str, Any]]],
                                                     dict[str, Any]]:
    """The shipped sample (or the file at ``path``): ``(trace name, session)`` pairs in the
    Weka session format, and the file's header fields.

    Raises ``ValueError`` when the file is malformed.
    """
    where = str(path) if path is not None else f"dualpath/workloads/data/{SAMPLE_FILE}"
    try:
        if path is None:
            text = resources.files("dualpath.workloads.data").joinpath(SAMPLE_FILE).read_text()
        else:
            text = Path(path).read_text()
        data = json.loads(text)
        sessions = [(s["trace"], {"block_size": s.get("block_size", 64),
                                  "requests": _expand(s["requests"])})
                    for s in data["sessions"]]
    except (OSError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"Weka sample {where}: malformed or unreadable ({exc!r})") from exc
    return sessions, {k: v for k, v in data.items() if k != "sessions"}


def _manifest(folder: Path) -> dict[str, dict[str, str]]:
    """MANIFEST.tsv rows by file name (empty when the folder has none)."""
    path = folder / "MANIFEST.tsv"
    if not path.is_file():
        return {}
    with path.open(newline="") as f:
        return {row["file"]: row for row in csv.DictReader(f, delimiter="\t")}


def _first_sessions(archive: Path, count: int,
                    first_turn: int) -> Iterator[tuple[str, dict[str, Any]]]:
    """The first ``count`` members of a Weka archive with at least ``first_turn`` top-level
    requests (the rest is not read)."""
    from dualpath.workloads.weka import weka_members

    members = weka_members(archive)
    found = 0
    try:
        for name, data in members:
            if found == count:
                break
            if top_level_requests(data) >= first_turn:
                found += 1
                yield Path(name).stem, data
    finally:
        members.close()


def write_sample(out: Path | None = None, root: Path | None = None) -> Path:
    """Remake the sample from the Weka archive under ``root`` (default: the traces folder of
    ``$DUALPATH_TRACES_DIR``) and its NOTICE in ``LICENSE-weka``; returns the file written."""
    from dualpath.workloads.trace_files import trace_file

    archive = trace_file("weka", root)
    manifest = _manifest(archive.parent)
    sessions = []
    for name, data in _first_sessions(archive, SESSIONS, FIRST_TURN):
        small = renumber(reduce_session(data))
        sessions.append({"trace": name,
                         "sha256": manifest.get(f"{name}.json", {}).get("sha256"),
                         "block_size": small["block_size"],
                         "requests": _compact(small["requests"])})
    out = out or Path(str(resources.files("dualpath.workloads.data").joinpath(SAMPLE_FILE)))
    header = {
        "name": "weka-sample",
        "source": f"{UPSTREAM}, archive {archive.parent.name}/{archive.name}",
        "license": f"Apache-2.0; see {LICENSE_FILE}",
        "sessions_kept": SESSIONS, "first_turn": FIRST_TURN, "turns_per_session": TURNS,
        "rule": "first sessions_kept sessions in archive order with at least first_turn "
                "top-level requests; of each, its top-level requests up to request "
                "first_turn - 1 + turns_per_session and the sub-agent entries listed from "
                "request first_turn - 1 on before the next one (each cut to turns_per_session "
                "requests); hash ids relabelled 1, 2, ... by first appearance in the file and "
                "stored as [start, count] runs",
        "made_by": "python -m dualpath.workloads.sample",
    }
    out.write_text(_dump(header, sessions))
    license_path = out.with_name(LICENSE_FILE)
    upstream = (archive.parent / "LICENSE").read_text()
    license_path.write_text(with_notice(license_path, _notice([s["trace"] for s in sessions]),
                                        upstream))
    return out


def _dump(header: dict[str, Any], sessions: list[dict[str, Any]]) -> str:
    """The sample as JSON with one request per line (small and readable in a diff)."""
    lines = ["{"] + [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in header.items()]
    lines.append(' "sessions": [')
    for i, s in enumerate(sessions):
        head = {k: v for k, v in s.items() if k != "requests"}
        lines.append(f"  {json.dumps(head)[:-1]}, \"requests\": [")
        reqs = [f"   {json.dumps(r, separators=(',', ':'))}" for r in s["requests"]]
        lines.append(",\n".join(reqs))
        lines.append("  ]}" + ("," if i + 1 < len(sessions) else ""))
    lines += [" ]", "}"]
    return "\n".join(lines) + "\n"


def _notice(names: list[str]) -> str:
    """Where the sample comes from and what was changed (Apache-2.0 §4(b))."""
    paragraphs = [
        f"NOTICE for dualpath/workloads/data/{SAMPLE_FILE}",
        f"{SAMPLE_FILE} is derived from the Weka agentic coding traces ({', '.join(names)} of "
        f"the dev set), published by Callan Fox in {UPSTREAM} under the Apache License, "
        "Version 2.0, reproduced below.",
        f"Changes made: only the first {FIRST_TURN - 1 + TURNS} top-level requests of each of "
        f"these sessions (the first {SESSIONS} of the archive with at least {FIRST_TURN} top-level "
        "requests) are "
        f"kept, with the sub-agent entries listed from request {FIRST_TURN - 1} on among them "
        f"(each cut to its first {TURNS} requests); of each request only its type, input and "
        "output token counts and its "
        "block hash ids are kept (and a sub-agent's agent id), the hash ids relabelled 1, 2, ... "
        "in order of first appearance within each file and stored as runs of consecutive ids; "
        "timings, models, content types and every other field are dropped. The file is made "
        "from the upstream archive by dualpath/workloads/sample.py.",
    ]
    return "\n\n".join(textwrap.fill(p, 92, break_on_hyphens=False) for p in paragraphs) + "\n"


@dataclass(frozen=True)
class SampleOptions:
    """``dualpath workloads sample``."""

    trace_dir: Path | None = None
    json: Path | None = None


def add_arguments(parser: ArgumentParser) -> None:
    """The options of :class:`SampleOptions`."""
    parser.add_argument("--trace-dir", type=Path, default=None,
                        help="folder holding weka-agentic-dev/ (default: $DUALPATH_TRACES_DIR)")
    parser.add_argument("--json", type=Path, default=None, help="file to write (default: the "
                        "package's dualpath/workloads/data/weka_sample.json)")


def run(options: SampleOptions) -> int:
    """Remake the sample; print where it went."""
    print(write_sample(options.json, options.trace_dir))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Remake the sample: ``python -m dualpath.workloads.sample [--trace-dir DIR]`` is
    ``dualpath workloads sample``."""
    from dualpath.cli import main as cli_main

    return cli_main(["workloads", "sample", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
