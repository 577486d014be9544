"""The demo's workload: a few real Weka agent sessions, scaled to the default model, shipped.

``dualpath/workloads/data/weka_demo.json`` holds the first turns of a few sessions of the Weka
agentic trace (Claude Code tool loops, GitHub ``callanjfox/kv-cache-tester``, Apache-2.0: the
license and a NOTICE are in ``dualpath/workloads/data/LICENSE-weka``). A user's clone has no
``../shared``, so
``make demo`` reads only this file; :func:`write_demo_trace` remakes it from the archive in
``shared/traces`` (``python -m dualpath.workloads.demo``), so the excerpt is reproducible.

How a session becomes demo turns (:func:`scale_session`):

* Every token count is divided by :data:`SCALE` (rounded; at least one generated token): the
  sessions' contexts of 15K–110K tokens become 0.5K–3.5K, well inside SmolLM2's 8K context and
  small enough for a 2-core machine, while the *ratio* of reloaded to new tokens per turn,
  which is what makes the workload storage-bound, stays the trace's.
* Turn i+1 normally extends turn i: its hash ids cover every full block of turn i's input, so
  its prompt keeps turn i's whole context (prompt and generated tokens; ``keep`` = that length)
  and adds new tokens up to the scaled input length. Otherwise (a compaction or an edit) it
  keeps only the scaled common prefix with turn i's input. At least one new token per turn.
* Sessions are taken in archive order; a session qualifies when its first request starts
  from the agent's system and tool prompt (at most :data:`FIRST_PROMPT_MAX` tokens), it has
  :data:`TURNS` top-level turns and none of them needs more than :data:`MAX_CONTEXT` tokens
  (prompt + generated) after scaling; the first :data:`SESSIONS` that qualify are kept.
"""

from __future__ import annotations

import csv
import json
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from dualpath.workloads.notices import with_notice
from dualpath.workloads.turns import Turn

SCALE = 96  # divide the trace's token counts by this
# The window of top-level turns kept starts here (1-based): past the early turns, whose hit rate
# against the previous turn is the traces' lowest (95.2% for turns 2-5, 97.5% for 21-50), so
# the demo reloads what an agent in its stride reloads (h 98% at 16-token blocks).
FIRST_TURN = 21
TURNS = 5  # top-level turns kept per session, from FIRST_TURN on
SESSIONS = 8  # sessions kept
MAX_CONTEXT = 3584  # tokens (prompt + generated) a kept turn may reach after scaling
# Raw tokens of a session's first request: sessions that begin at the agent's ~15K-token
# system and tool prompt (as the traces' notes describe them), not ones resumed mid-conversation,
# whose first turn is one large cold prefill (trace_0001 starts at 71K tokens).
FIRST_PROMPT_MAX = 20_000
WEKA_BLOCK = 64  # the trace's tokens per hash id
DATA_FILE = "weka_demo.json"
LICENSE_FILE = "LICENSE-weka"
UPSTREAM = "https://github.com/callanjfox/kv-cache-tester (folder traces/)"


@dataclass(frozen=True)
class DemoTurn:
    """One scaled turn: keep ``keep`` tokens of the context so far, reach ``prompt`` tokens
    with new ones, generate ``gen``."""

    prompt: int
    keep: int
    gen: int


@dataclass(frozen=True)
class DemoSession:
    """One scaled session of the excerpt, named by its archive member."""

    trace: str
    turns: tuple[DemoTurn, ...]


def scale_session(turns: list[Turn], scale: int = SCALE,
                  block: int = WEKA_BLOCK) -> list[DemoTurn]:
    """A session's turns with token counts divided by ``scale`` (see the module doc)."""
    if scale < 1:
        raise ValueError(f"scale must be >= 1, got {scale}")
    out: list[DemoTurn] = []
    prev: Turn | None = None
    for t in turns:
        gen = max(1, round(t.gen / scale))
        if prev is None:
            keep = 0
        elif t.hit >= prev.prompt // block * block:  # every full block of the last input
            keep = out[-1].prompt + out[-1].gen
        else:  # compaction or edit: only the common prefix survives
            keep = min(round(t.hit / scale), out[-1].prompt)
        out.append(DemoTurn(prompt=max(keep + 1, round(t.prompt / scale)), keep=keep, gen=gen))
        prev = t
    return out


def select_sessions(sessions: Iterable[tuple[str, list[Turn]]], count: int = SESSIONS,
                    turns: int = TURNS, scale: int = SCALE, max_context: int = MAX_CONTEXT,
                    first_prompt_max: int = FIRST_PROMPT_MAX,
                    first_turn: int = 1) -> list[DemoSession]:
    """The first ``count`` sessions that start at most ``first_prompt_max`` tokens long and
    whose ``turns`` turns from turn ``first_turn`` (1-based) on fit ``max_context`` once
    scaled (no more of ``sessions`` is read once they are found). A window's first turn keeps
    nothing: it is a cold prefill of that turn's whole prompt."""
    if first_turn < 1:
        raise ValueError(f"first_turn counts from 1, got {first_turn}")
    kept: list[DemoSession] = []
    for name, session in sessions:
        window = session[first_turn - 1:first_turn - 1 + turns]
        if len(window) < turns or session[0].prompt > first_prompt_max:
            continue
        scaled = scale_session(window, scale)
        if max(t.prompt + t.gen for t in scaled) <= max_context:
            kept.append(DemoSession(Path(name).stem, tuple(scaled)))
            if len(kept) == count:
                break
    return kept


def load_demo_trace(path: Path | None = None) -> tuple[list[DemoSession], dict[str, Any]]:
    """The shipped excerpt (or the file at ``path``): its sessions and its header fields.

    Raises ``ValueError`` when the file is malformed.
    """
    if path is None:
        text = resources.files("dualpath.workloads.data").joinpath(DATA_FILE).read_text()
    else:
        text = Path(path).read_text()
    try:
        data = json.loads(text)
        sessions = [DemoSession(s["trace"], tuple(DemoTurn(int(t["prompt"]), int(t["keep"]),
                                                           int(t["gen"])) for t in s["turns"]))
                    for s in data["sessions"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"demo trace {path or DATA_FILE}: malformed ({exc!r})") from exc
    for s in sessions:
        _check(s)
    return sessions, {k: v for k, v in data.items() if k != "sessions"}


def license_text() -> str:
    """The upstream license and NOTICE shipped beside the excerpt."""
    return resources.files("dualpath.workloads.data").joinpath(LICENSE_FILE).read_text()


def _check(session: DemoSession) -> None:
    """Each turn keeps at most the context before it and adds at least one token."""
    context = 0
    for i, t in enumerate(session.turns):
        if t.keep > context or t.prompt <= t.keep or t.gen < 1 or (i == 0 and t.keep):
            raise ValueError(f"demo trace: {session.trace} turn {i} is inconsistent: {t}")
        context = t.prompt + t.gen


def _manifest(folder: Path) -> dict[str, dict[str, str]]:
    """MANIFEST.tsv rows by file name."""
    with (folder / "MANIFEST.tsv").open(newline="") as f:
        return {row["file"]: row for row in csv.DictReader(f, delimiter="\t")}


def write_demo_trace(out: Path | None = None, root: Path | None = None,
                     first_turn: int = FIRST_TURN,
                     turns: int = TURNS, scale: int = SCALE, count: int = SESSIONS,
                     max_context: int = MAX_CONTEXT) -> Path:
    """Remake the excerpt from ``shared/traces`` (or ``root``); returns the file written.
    ``first_turn``: the top-level turn (1-based) each session's window starts at; its first
    turn is then a cold prefill of that turn's whole prompt (untimed in the demo)."""
    from dualpath.workloads.sim_traces import chain_turns
    from dualpath.workloads.trace_files import trace_file
    from dualpath.workloads.weka import weka_members, weka_sessions

    archive = trace_file("weka", root)
    manifest = _manifest(archive.parent)
    stream = weka_sessions(weka_members(archive), str(archive))
    sessions = select_sessions(
        ((s.parent.name, chain_turns(s.parent.requests, s.parent.block)) for s in stream),
        count=count, turns=turns, scale=scale, max_context=max_context, first_turn=first_turn)
    stream.close()
    out = out or Path(str(resources.files("dualpath.workloads.data").joinpath(DATA_FILE)))
    data = {
        "name": "weka-agentic-demo",
        "source": f"{UPSTREAM}, archive {archive.parent.name}/{archive.name}",
        "license": f"Apache-2.0; see {LICENSE_FILE}",
        "scale": scale, "first_turn": first_turn, "turns_per_session": turns,
        "max_context": max_context, "first_prompt_max": FIRST_PROMPT_MAX,
        "rule": "first sessions in archive order whose first request has at most "
                "first_prompt_max tokens and whose first turns_per_session top-level turns "
                "(sub-agents skipped) fit max_context after dividing token counts by scale; "
                "keep = tokens of the previous turn's prompt + generated tokens this prompt "
                "starts with",
        "sessions": [{"trace": s.trace, "sha256": manifest[f"{s.trace}.json"]["sha256"],
                      "turns": [{"prompt": t.prompt, "keep": t.keep, "gen": t.gen}
                                for t in s.turns]} for s in sessions],
    }
    out.write_text(json.dumps(data, indent=1) + "\n")
    upstream = (archive.parent / "LICENSE").read_text()
    license_path = out.with_name(LICENSE_FILE)  # the sample's NOTICE is kept there
    license_path.write_text(with_notice(license_path, _notice(sessions, first_turn, turns, scale),
                                        upstream))
    return out


def _notice(sessions: list[DemoSession], first_turn: int, turns: int, scale: int) -> str:
    """Where the excerpt comes from and what was changed (Apache-2.0 §4(b))."""
    names = ", ".join(s.trace for s in sessions)
    paragraphs = [
        f"NOTICE for dualpath/workloads/data/{DATA_FILE}",
        f"{DATA_FILE} is derived from the Weka agentic coding traces ({names} of the dev set), "
        f"published by Callan Fox in {UPSTREAM} under the Apache License, Version 2.0, "
        "reproduced below.",
        f"Changes made: only {turns} top-level requests of each of these sessions are kept, "
        f"from its request {first_turn} on (sub-agent requests dropped); of each request only "
        "token counts are kept (input and output lengths, and the shared-prefix length derived "
        f"from the block hash ids), each divided by {scale} and rounded; hash ids, timings and "
        "every other field are "
        "dropped. The file is made from the upstream archive by dualpath/workloads/demo.py.",
    ]
    return "\n\n".join(textwrap.fill(p, 92, break_on_hyphens=False) for p in paragraphs) + "\n"


if __name__ == "__main__":
    print(write_demo_trace())
