"""Agent sessions as the API receives them (pure): a session id and the harness's hints.

A session id names the chain of requests one agent (an RL trajectory, a coding agent's
conversation) sends, each extending the last one's context. It comes from the
``X-Session-ID`` header (SkyRL's), ``x-dynamo-session-id`` (Dynamo's) or the body's
``session_id``; the first two are what RL frameworks already send for sticky routing. The
optional ``agent_hint`` follows the names of vLLM's agent-hint RFC where it has them:
``priority``, ``lease_s`` (keep this session's KV at least this long), ``next_turn_in_s`` (when
the next turn is expected) and ``end_of_session`` (no next turn: its KV may go first).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from dualpath.errors import RequestError

SESSION_HEADERS = ("x-session-id", "x-dynamo-session-id")  # what RL frameworks send
MAX_SESSION_ID_CHARS = 256
MAX_HINT_S = 86_400.0  # a lease or an expected return of at most a day
MIN_PRIORITY, MAX_PRIORITY = -100, 100
# visible ASCII, no spaces: a header carries it as is, and it names the session in logs
SESSION_ID = re.compile(rf"[\x21-\x7e]{{1,{MAX_SESSION_ID_CHARS}}}")


@dataclass(frozen=True)
class AgentHint:
    """What an agent harness says about its session's next turns."""

    priority: int = 0  # higher keeps its KV longer under pressure
    lease_s: float | None = None  # keep the session's KV at least this long from now
    next_turn_in_s: float | None = None  # the next turn is expected in about this long
    end_of_session: bool = False  # no next turn: this session's KV may be evicted first

    def names(self) -> tuple[str, ...]:
        """The hints this one sets (for counting)."""
        given = {"priority": self.priority != 0, "lease_s": self.lease_s is not None,
                 "next_turn_in_s": self.next_turn_in_s is not None,
                 "end_of_session": self.end_of_session}
        return tuple(name for name, on in given.items() if on)


@dataclass(frozen=True)
class Session:
    """A request's session: its id, where the id came from, and the request's hint."""

    session_id: str
    source: str  # "header" or "body"
    hint: AgentHint | None = None


def check_session_id(text: str, where: str) -> str:
    """``text`` if it can name a session; else a ``RequestError`` naming ``where`` it came
    from."""
    if SESSION_ID.fullmatch(text) is None:
        raise RequestError(f"{where} must be 1 to {MAX_SESSION_ID_CHARS} visible ASCII "
                           "characters (no spaces)")
    return text


def session_of(headers: dict[str, str], body_id: str | None,
               hint: AgentHint | None) -> Session | None:
    """The request's session from its (lower-cased) headers and body, or None without an id.
    Ids that disagree, or a hint without a session, are a ``RequestError``."""
    found = {name: check_session_id(headers[name], name) for name in SESSION_HEADERS
             if name in headers}
    if body_id is not None:
        found["session_id"] = check_session_id(body_id, "session_id")
    if len(set(found.values())) > 1:
        raise RequestError("the session id differs between " + " and ".join(sorted(found)))
    if not found:
        if hint is not None:
            raise RequestError("agent_hint needs a session: send X-Session-ID or session_id")
        return None
    source = "body" if set(found) == {"session_id"} else "header"
    return Session(next(iter(found.values())), source, hint)


def session_key(session_id: str, cache_salt: str) -> str:
    """What names a session inside the cluster: its id within its tenant's salt."""
    return f"{cache_salt}\0{session_id}"


def warm_key(session: Session | None, cache_salt: str) -> str:
    """The short key engines keep a session's warm blocks under ("": no session): a hash, so
    no client text travels to the engines."""
    if session is None:
        return ""
    return hashlib.sha256(session_key(session.session_id, cache_salt).encode()).hexdigest()[:32]


def warm_lease_s(session: Session | None) -> float:
    """How long engines keep the session's warm blocks before any unleased session's."""
    hint = session.hint if session is not None else None
    return hint.lease_s or 0.0 if hint is not None else 0.0
