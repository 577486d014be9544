"""The router's book of agent sessions (pure: times come in as arguments).

A request that names a session (``dualpath/sessions.py``) is noted when it is admitted, and
leaves a mark then: its chain ends at its prompt's last full block, so the blocks its prefill
stores are its session's as they land. When it finishes, the book turns it into the
session's new mark for the store (``kv/retention.py``): the chain now ends at the last full
block of its prompt and output (the blocks its decode engine stores; until they land, the
mark's anchors, its prompt's, its hit's and its first blocks, stand for it), live for the
configured window or as long as the hint asks, or ended. Requests that store nothing
(oracle, recompute) leave no mark, and failed ones no new mark at their end. The mark is
keyed by the session id under the request's cache salt, so two tenants' sessions of one
name stay apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dualpath.kv.hashing import KeySpace, extend_block_hashes
from dualpath.kv.retention import (
    DEFAULT_WINDOW_S,
    SessionMark,
    in_flight_mark,
    mark_for,
    spaced_anchors,
)
from dualpath.server.router.types import ClusterOutput
from dualpath.sessions import Session, session_key
from dualpath.vocab import Mode


@dataclass(frozen=True)
class _Noted:
    session: Session
    cache_salt: str
    prompt_hashes: tuple[bytes, ...]  # the hit lookup's: a prefix of the chain, hashed once


@dataclass(frozen=True)
class MarkWrite:
    """A mark to write to the store, under its session's key."""

    session_key: str
    mark: SessionMark


class SessionBook:
    """Sessions of requests in flight, and the marks their finished turns leave."""

    def __init__(self, key_space: KeySpace, window_s: float = DEFAULT_WINDOW_S) -> None:
        self.key_space = key_space
        self.window_s = window_s
        self._noted: dict[int, _Noted] = {}
        self.marks_made = 0

    def admit(self, req_id: int, session: Session | None, mode: Mode, cache_salt: str,
              prompt_hashes: Sequence[bytes] = (), num_hit_blocks: int = 0,
              now_ns: int = 0) -> MarkWrite | None:
        """Note a request's session, if it has one and its blocks will be stored;
        ``prompt_hashes``: the hashes of its prompt's leading blocks, if already made (the
        finish hashes only what follows them). Returns the mark the turn leaves while in
        flight (``retention.in_flight_mark``; None: nothing noted or no full block)."""
        if session is None or mode in (Mode.ORACLE, Mode.RECOMPUTE):
            return None
        self._noted[req_id] = _Noted(session, cache_salt, tuple(prompt_hashes))
        if not prompt_hashes:
            return None
        return MarkWrite(session_key(session.session_id, cache_salt),
                         in_flight_mark(prompt_hashes[-1], now_ns, session.hint, self.window_s,
                                        spaced_anchors(prompt_hashes, num_hit_blocks)))

    def finish(self, req_id: int, result: ClusterOutput | Exception,
               now_ns: int) -> MarkWrite | None:
        """The mark a finished request leaves (None: no session, no full block, or a
        failure)."""
        noted = self._noted.pop(req_id, None)
        if noted is None or not isinstance(result, ClusterOutput):
            return None
        stored_ids = result.prompt_ids + result.output_ids[:-1]  # the last token's KV: never
        hashes = extend_block_hashes(list(noted.prompt_hashes), stored_ids,
                                     self.key_space.block_size,
                                     self.key_space.salted(noted.cache_salt).seed)
        if not hashes:
            return None
        self.marks_made += 1
        return MarkWrite(session_key(noted.session.session_id, noted.cache_salt),
                         mark_for(hashes[-1], now_ns, noted.session.hint, self.window_s,
                                  anchors(hashes, result, self.key_space.block_size)))

    def __len__(self) -> int:
        return len(self._noted)


def anchors(hashes: Sequence[bytes], result: ClusterOutput, block_size: int) -> tuple[bytes, ...]:
    """The blocks a mark falls back on until its tip is stored, deepest first: the prompt's
    last full block (its prefill engine stores it first), the hit's (stored already) and
    the chain's first."""
    ends = (len(result.prompt_ids) // block_size, result.num_hit_tokens // block_size, 1)
    return tuple(dict.fromkeys(hashes[n - 1] for n in ends if 0 < n <= len(hashes)))
