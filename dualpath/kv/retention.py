"""Session-aware retention: which stored blocks a full store gives up first (pure: no clock,
no I/O; times are passed in as wall-clock ns).

A *session mark* says that a chain of stored blocks (its *tip* and every ancestor of it) is an
agent session's context, when the session last finished a turn, until when it counts as
*live* (its lease, its expected return, or a recent turn) and whether the harness ended it.
The router writes one mark per session after each turn (``server/router/sessions.py``); an
eviction pass, in whichever process runs it, ranks every stored block by the marks:

1. ``ENDED``: only on chains of ended or expired sessions (nobody is coming back for it);
2. ``ANONYMOUS``: on no session's chain (a request that named no session);
3. ``SHARED``: on an ended or expired session's chain, and a prefix that two or more chains
   continue (a system prompt, a forked trajectory's common past): the next session is likely
   to start there;
4. ``LIVE``: on a live session's chain; a higher hint ``priority`` goes later.

The index evicts leaves only, so within a rank a chain's tail goes before the prefix it
extends; ties go least recently used first, as before. Without marks every block is
``ANONYMOUS`` and eviction is plain prefix-closed LRU.

**Expected returns.** LRU bets that a block unused for ``t`` seconds is wanted again in about
``t``. A live session whose harness said when it comes back (``next_turn_in_s``) replaces
that guess on its chain by the hint (:func:`block_recency`): among live chains of one
priority, the one expected back last goes first, so a queued agent due in a minute gives way
to one due in a second, not the other way round (Belady's rule, with the harness's forecast).
A session past its expected return ages from that moment, as if it had been used then: LRU's
bet again, from the forecast on. A chain is as fresh as it is close to its expected return,
before or after it, and never fresher than a block used now.

**Anchors.** A mark's tip is the last full block of the turn's prompt and output, which the
decode engine stores after the turn; until it lands, the mark protects its chain from the
shallower blocks it names as anchors (the prompt's last full block, the hit's, the chain's
first), and the blocks already stored below that anchor (on their way to the tip) as its
own. A turn
also leaves a mark as it is admitted (:func:`in_flight_mark`), so the blocks its prefill
stores belong to its session from the moment they land, not only once the turn is over.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum

from dualpath.sessions import AgentHint

NS_PER_S = 1_000_000_000
DEFAULT_WINDOW_S = 300.0  # a session seen this recently is live without a hint
NEXT_TURN_SLACK = 2.0  # an expected return keeps the session live this many times as long
MARK_KEPT_S = 86_400.0  # a mark outlives its session's liveness by this much, then goes
MAX_ANCHORS = 4


class Retention(IntEnum):
    """A stored block's claim to stay, lowest evicted first."""

    ENDED = 0
    ANONYMOUS = 1
    SHARED = 2
    LIVE = 3


Rank = tuple[int, int]  # (Retention, priority): compared as a tuple, lowest evicted first
DEFAULT_RANK: Rank = (Retention.ANONYMOUS, 0)


class BadMark(ValueError):
    """A session mark that cannot be parsed (a damaged or foreign file)."""


@dataclass(frozen=True)
class SessionMark:
    """One session's stored chain and how long it is wanted."""

    tip: bytes  # hash of the chain's last full block
    seen_ns: int  # wall clock of the session's last finished turn
    live_until_ns: int  # live until then, unless ended
    ended: bool = False  # the harness said no turn follows
    priority: int = 0  # the harness's priority: higher stays longer among live chains
    return_ns: int = 0  # wall clock the harness expects the next turn at (0: not said)
    anchors: tuple[bytes, ...] = ()  # shallower blocks of the chain, deepest first

    def start(self, stored: Mapping[bytes, object]) -> bytes | None:
        """The deepest block this mark names that is ``stored`` (None: none yet)."""
        return next((h for h in (self.tip, *self.anchors) if h in stored), None)

    def live(self, now_ns: int) -> bool:
        """Whether the session may still come back for its chain."""
        return not self.ended and now_ns < self.live_until_ns

    def stale(self, now_ns: int) -> bool:
        """Whether the mark itself can go: its session stopped being live long ago."""
        end_ns = self.seen_ns if self.ended else self.live_until_ns
        return now_ns - end_ns > MARK_KEPT_S * NS_PER_S

    def to_json(self) -> bytes:
        """The mark as a small JSON document (what an ``fs`` store keeps per session)."""
        return json.dumps({"tip": self.tip.hex(), "seen_ns": self.seen_ns,
                           "live_until_ns": self.live_until_ns, "ended": self.ended,
                           "priority": self.priority, "return_ns": self.return_ns,
                           "anchors": [h.hex() for h in self.anchors]}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> SessionMark:
        """A mark from ``to_json``'s bytes; ``BadMark`` for anything else."""
        try:
            data = json.loads(raw)
            anchors = data.get("anchors", [])
            if not isinstance(anchors, list) or len(anchors) > MAX_ANCHORS:
                raise ValueError("anchors must be a short list")
            mark = cls(bytes.fromhex(data["tip"]), int(data["seen_ns"]),
                       int(data["live_until_ns"]), bool(data["ended"]), int(data["priority"]),
                       int(data.get("return_ns", 0)), tuple(bytes.fromhex(h) for h in anchors))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise BadMark(f"not a session mark: {exc}") from None
        if not mark.tip:
            raise BadMark("a session mark without a tip")
        return mark


def mark_for(tip: bytes, seen_ns: int, hint: AgentHint | None,
             window_s: float = DEFAULT_WINDOW_S, anchors: tuple[bytes, ...] = ()) -> SessionMark:
    """The mark a finished turn leaves: live for ``window_s``, or as long as its hint's lease
    or (``NEXT_TURN_SLACK`` times) its expected return, whichever is longest; ``anchors``:
    shallower blocks of the chain, deepest first (at most ``MAX_ANCHORS``)."""
    live_s, return_ns = window_s, 0
    if hint is not None and hint.lease_s is not None:
        live_s = max(live_s, hint.lease_s)
    if hint is not None and hint.next_turn_in_s is not None:
        live_s = max(live_s, hint.next_turn_in_s * NEXT_TURN_SLACK)
        return_ns = seen_ns + round(hint.next_turn_in_s * NS_PER_S)
    return SessionMark(tip, seen_ns, seen_ns + round(live_s * NS_PER_S),
                       hint is not None and hint.end_of_session,
                       hint.priority if hint is not None else 0, return_ns,
                       tuple(a for a in anchors if a != tip)[:MAX_ANCHORS])


def in_flight_mark(tip: bytes, now_ns: int, hint: AgentHint | None,
                   window_s: float = DEFAULT_WINDOW_S,
                   anchors: tuple[bytes, ...] = ()) -> SessionMark:
    """The mark a turn leaves as it is admitted: its chain ends at the prompt's last full
    block (``tip``), live as :func:`mark_for` says but with no expected return (its blocks
    are in use: their own recency is the latest) and never ended (the turn is not over);
    ``anchors``: blocks of the prompt stored already or sooner, deepest first."""
    still = None if hint is None else AgentHint(hint.priority, hint.lease_s)
    return mark_for(tip, now_ns, still, window_s, anchors)


def spaced_anchors(hashes: Sequence[bytes], num_hit_blocks: int) -> tuple[bytes, ...]:
    """Anchors along a chain being stored (``hashes``, its blocks in order), deepest first:
    the hit's last block (stored already) or else the chain's first, and half of the way.
    The deepest that has landed claims the chain up to it and the blocks landing below it
    (:func:`block_ranks`), so even a chain stored from nothing is its session's from its
    first block on: were it nobody's, a store full of live chains would take that block at
    once and every later one as an orphan."""
    count = len(hashes)
    ends = sorted({count // 2, max(1, num_hit_blocks)}, reverse=True)
    return tuple(hashes[n - 1] for n in ends if 0 < n <= count)


def block_ranks(parents: Mapping[bytes, bytes | None], marks: Iterable[SessionMark],
                now_ns: int) -> dict[bytes, Rank]:
    """Each stored block's rank (blocks absent from the result are ``DEFAULT_RANK``).

    ``parents`` maps every stored block to its parent's hash (None for a first block); a
    mark none of whose blocks (tip, anchors) is stored protects nothing.
    """
    live_priority: dict[bytes, int] = {}
    marked: set[bytes] = set()
    tips: set[bytes] = set()
    pending: list[tuple[bytes, int]] = []  # live marks whose tip has not landed yet
    for mark in marks:
        start = mark.start(parents)
        if start is None:
            continue
        tips.add(start)
        if mark.live(now_ns):
            _walk_live(parents, start, mark.priority, live_priority)
            if start != mark.tip:
                pending.append((start, mark.priority))
        else:
            _walk_marked(parents, start, marked)
    children = _children(parents) if pending or marked else {}
    if pending:
        claimed = set(live_priority) | marked
        for start, priority in pending:
            _walk_landing(children, start, priority, claimed, live_priority)
    shared = _shared_blocks(parents, tips, children) if marked else set()
    ranks: dict[bytes, Rank] = {
        h: (Retention.SHARED if h in shared else Retention.ENDED, 0) for h in marked}
    ranks.update((h, (Retention.LIVE, p)) for h, p in live_priority.items())
    return ranks


def block_recency(parents: Mapping[bytes, bytes | None], marks: Iterable[SessionMark],
                  now_ns: int) -> dict[bytes, int]:
    """The recency eviction orders by on live chains whose harness said when they come back
    (the module doc): ``now - |now - return|``. Before the return that is ``2 * now -
    return``, the last use LRU would need to expect it; past it, the return itself (an
    overdue session ages from when it was due, never fresher than now). The freshest wins on
    a block that several chains share. Blocks absent from the result keep their own last
    use."""
    out: dict[bytes, int] = {}
    for mark in marks:
        start = mark.start(parents)
        if start is None or not mark.return_ns or not mark.live(now_ns):
            continue
        used = now_ns - abs(now_ns - mark.return_ns)
        block: bytes | None = start
        while block is not None and block in parents:
            if out.get(block, used - 1) >= used:
                break  # a sooner return already covers the rest of the chain
            out[block] = used
            block = parents[block]
    return out


def surviving_tip(parents: Mapping[bytes, bytes | None], tip: bytes,
                  gone: set[bytes]) -> bytes | None:
    """The deepest block of ``tip``'s chain that is stored and not ``gone``: where a mark
    moves once eviction took its tip (None: nothing of the chain is left)."""
    block: bytes | None = tip
    while block is not None and block in parents:
        if block not in gone:
            return block
        block = parents[block]
    return None


def _walk_live(parents: Mapping[bytes, bytes | None], tip: bytes, priority: int,
               live_priority: dict[bytes, int]) -> None:
    """Mark ``tip`` and its stored ancestors live at ``priority`` (at least)."""
    block: bytes | None = tip
    while block is not None and block in parents:
        if live_priority.get(block, priority - 1) >= priority:
            return  # an earlier walk covered the rest of the chain at this priority or above
        live_priority[block] = priority
        block = parents[block]


def _children(parents: Mapping[bytes, bytes | None]) -> dict[bytes, list[bytes]]:
    """Each stored block's stored children."""
    out: dict[bytes, list[bytes]] = {}
    for block, parent in parents.items():
        if parent is not None and parent in parents:
            out.setdefault(parent, []).append(block)
    return out


def _walk_landing(children: Mapping[bytes, list[bytes]], start: bytes, priority: int,
                  claimed: set[bytes], live_priority: dict[bytes, int]) -> None:
    """Mark the stored blocks below ``start`` that no mark claims live at ``priority`` (at
    least): a live mark's tip has not landed, so the blocks on their way to it are the
    session's, not nobody's; another session's chain below it keeps its own claim."""
    stack = list(children.get(start, ()))
    while stack:
        block = stack.pop()
        if block in claimed or live_priority.get(block, priority - 1) >= priority:
            continue
        live_priority[block] = priority
        stack.extend(children.get(block, ()))


def _walk_marked(parents: Mapping[bytes, bytes | None], tip: bytes, marked: set[bytes]) -> None:
    """Mark ``tip`` and its stored ancestors as on an ended or expired session's chain."""
    block: bytes | None = tip
    while block is not None and block in parents and block not in marked:
        marked.add(block)
        block = parents[block]


def _shared_blocks(parents: Mapping[bytes, bytes | None], tips: set[bytes],
                   stored_children: Mapping[bytes, list[bytes]]) -> set[bytes]:
    """Blocks that two or more chains continue: more than one leaf or session tip lies at or
    below them."""
    children = {h: len(kids) for h, kids in stored_children.items()}
    ends = {h: int(h in tips or h not in children) for h in parents}
    waiting = dict(children)
    ready = [h for h in parents if h not in children]
    while ready:  # leaves up: a block is done once all its children are
        block = ready.pop()
        parent = parents[block]
        if parent is None or parent not in parents:
            continue
        ends[parent] += ends[block]
        waiting[parent] -= 1
        if not waiting[parent]:
            ready.append(parent)
    return {h for h, count in ends.items() if count >= 2}
