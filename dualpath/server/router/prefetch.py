"""Prefetch during tool time (pure: times come in as arguments).

Between two turns an agent runs its tools; its session's chain is warm in the DRAM of the
decode engine that served the last turn (``storage/warm.py``), unless that engine let it go
(its budget, an expiry) or is gone. Such a session, if it is expected back (a
``next_turn_in_s`` hint, or the gaps it showed so far), is *prefetched*: the decode engine
whose node has the shortest read queue (as Algorithm 1 picks a read path) is asked to read
the chain from storage into its DRAM on its lowest priority (``Prefetch``), and the session's
next turn is placed there. The prefetch is wanted until a while after the expected return;
its engine drops it then, or sooner under pressure, and counts it as wasted. A session that
returns, ends or stays away too long is forgotten.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from dualpath.protocol import Prefetch
from dualpath.server.router.types import ClusterOutput, Effects, Records, RequestState
from dualpath.vocab import Role

GAP_WEIGHT = 0.5  # a learned gap: this much of the newest, the rest of the earlier ones
MIN_AHEAD_S = 0.05  # a return expected sooner than this is not worth a prefetch
KEPT_PAST_RETURN = 2.0  # a prefetch is wanted until this many gaps after the turn's end
# sessions between turns the router follows (the most recent); each holds its chain's token
# ids at 4 bytes a token, so 1,000 sessions of 100K tokens take 400 MB at most
MAX_AWAY = 1_000


@dataclass
class Away:
    """A session between turns: its chain and when it should be back."""

    token_ids: array[int]  # the last turn's prompt and output (the chain's tokens)
    cache_salt: str
    lease_s: float
    ended_s: float  # when its last turn finished
    gap_s: float  # how long its tool time should take
    avoid: str = ""  # the decode engine that let its copy go (a prefetch goes elsewhere)

    @property
    def back_s(self) -> float:
        """When its next turn is expected."""
        return self.ended_s + self.gap_s

    @property
    def wanted_until_s(self) -> float:
        """After this it is forgotten, and a prefetch of it dropped."""
        return self.ended_s + KEPT_PAST_RETURN * self.gap_s


class Prefetches:
    """Sessions between turns, their learned gaps, and the prefetches sent for them."""

    def __init__(self, records: Records, warm_at: dict[str, str],
                 read_queue_tokens: dict[int, int], enabled: bool = True) -> None:
        self.records = records
        self.warm_at = warm_at  # Placement's: session -> the DE keeping it warm
        self.read_queue_tokens = read_queue_tokens  # Ledger's: node -> tokens being read
        self.enabled = enabled
        self.away: dict[str, Away] = {}
        self.ended_s: dict[str, float] = {}  # session -> when its last turn finished
        self.gaps_s: dict[str, float] = {}  # session -> its learned tool time
        self.sent = 0  # prefetches sent

    def returned(self, req: RequestState, now_s: float) -> None:
        """A session's next turn arrived: learn its gap, stop following it."""
        key = str(req.warm.get("warm_session", ""))
        self.away.pop(key, None)
        ended_s = self.ended_s.pop(key, None)
        if ended_s is None:
            return
        gap_s = max(0.0, now_s - ended_s)
        old = self.gaps_s.pop(key, None)
        self.gaps_s[key] = gap_s if old is None else GAP_WEIGHT * gap_s + (1 - GAP_WEIGHT) * old
        if len(self.gaps_s) > MAX_AWAY:
            del self.gaps_s[next(iter(self.gaps_s))]

    def ended(self, req: RequestState, result: ClusterOutput, now_s: float) -> None:
        """A session's turn finished: follow it while it is expected back."""
        key = str(req.warm.get("warm_session", ""))
        if not key or req.session is None:
            return
        hint = req.session.hint
        if hint is not None and hint.end_of_session:
            for table in (self.away, self.ended_s, self.gaps_s):
                table.pop(key, None)
            return
        self.ended_s.pop(key, None)
        self.ended_s[key] = now_s
        if len(self.ended_s) > MAX_AWAY:
            del self.ended_s[next(iter(self.ended_s))]
        gap_s = hint.next_turn_in_s if hint is not None else None
        gap_s = self.gaps_s.get(key) if gap_s is None else gap_s
        if gap_s is None or gap_s < MIN_AHEAD_S:
            return  # nothing says when (or it is back at once): no prefetch
        tokens = array("i", result.prompt_ids)
        tokens.extend(result.output_ids[:-1])
        self.away.pop(key, None)
        self.away[key] = Away(tokens, req.cache_salt, float(req.warm.get("warm_lease_s", 0.0)),
                              now_s, gap_s)
        if len(self.away) > MAX_AWAY:
            del self.away[next(iter(self.away))]

    def lost(self, engine: str, keys: tuple[str, ...]) -> None:
        """``engine`` let these sessions' DRAM copies go: they are warm nowhere now."""
        for key in keys:
            if self.warm_at.get(key) == engine:
                del self.warm_at[key]
            if key in self.away:
                self.away[key].avoid = engine

    def check(self, now_s: float, out: Effects) -> None:
        """Forget sessions away too long; prefetch those expected back that are warm on no
        live decode engine."""
        for key, away in list(self.away.items()):
            if now_s > away.wanted_until_s:
                del self.away[key]
                continue
            if not self.enabled or self.warm_at.get(key) in self.records.engines:
                continue
            if away.back_s - now_s < MIN_AHEAD_S:
                continue  # too late to be of use: the turn reads from storage
            target = self._target(exclude=away.avoid)
            if target is None:
                continue
            out.send(target, Prefetch(key, tuple(away.token_ids), away.cache_salt, away.lease_s,
                                      expires_in_s=away.wanted_until_s - now_s))
            self.warm_at[key] = target
            self.sent += 1

    def _target(self, exclude: str) -> str | None:
        """The live decode engine whose node has the shortest read queue (ties: name); not
        ``exclude`` (the one that let the session's copy go) when another is there."""
        des = [(self.read_queue_tokens.get(e.info.node_id, 0), name)
               for name, e in self.records.engines.items() if e.info.role == Role.DECODE]
        others = [d for d in des if d[1] != exclude] or des
        return min(others)[1] if others else None
