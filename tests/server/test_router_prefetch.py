"""Prefetch during tool time in the router's state (``server/router/prefetch.py``): a session
expected back whose warm copy went is read into another decode engine's DRAM, and its next
turn is placed there; nothing is prefetched for sessions that ended, that nothing says will
come back, or that stayed away too long."""

from __future__ import annotations

from dualpath.protocol import AllocBuffer, Heartbeat, Prefetch
from dualpath.server.router.state import RouterState
from dualpath.sessions import AgentHint, Session, warm_key
from dualpath.vocab import ReadPath

from .test_router_state import EngineModel, apply, hello_all, make_state, request


class Cluster:
    """A router state, engines that answer, and the messages sent so far."""

    def __init__(self, prefetch: bool = True) -> None:
        self.state: RouterState = make_state()
        self.state.prefetches.enabled = prefetch
        self.model, self.done, self.sent = EngineModel(), {}, []
        hello_all(self.state)

    def turn(self, req_id: int, session: Session, now: float) -> str:
        """Run one turn to its end; the decode engine it ran on."""
        req = request(req_id, hit_blocks=2)
        req.session = session
        sends: list = []
        apply(self.state.submit(req, now), self.done, sends, self.state)
        while sends:
            engine, msg = sends.pop(0)
            self.sent.append((engine, msg))
            for reply in self.model.answer(engine, msg):
                apply(self.state.on_message(engine, reply, now), self.done, sends, self.state)
        return self.state.decisions[-1][2]

    def tick(self, now: float) -> list[tuple[str, Prefetch]]:
        for name in ("pe0", "pe1", "de2", "de3"):  # every engine beats: none is lost
            self.state.on_message(name, Heartbeat(name, 100, 100, 0), now)
        out = self.state.tick(now)
        return [(e, m) for e, m in out.sends if isinstance(m, Prefetch)]

    def drop(self, engine: str, session: Session, now: float) -> None:
        """``engine`` reports that it let the session's DRAM copy go."""
        beat = Heartbeat(engine, 100, 100, 0, warm_dropped=(warm_key(session, ""),))
        self.state.on_message(engine, beat, now)


def session(name: str = "traj", **hint) -> Session:
    return Session(name, "header", AgentHint(**hint) if hint else None)


def test_a_session_whose_copy_went_is_prefetched_elsewhere_and_its_next_turn_goes_there():
    c, s = Cluster(), session(next_turn_in_s=10.0)
    first_de = c.turn(1, s, now=0.0)
    assert c.tick(1.0) == []  # still warm where it ran
    c.drop(first_de, s, now=2.0)
    (target, prefetch), = c.tick(2.0)
    other = "de3" if first_de == "de2" else "de2"
    assert target == other and prefetch.warm_session == warm_key(s, "")
    assert prefetch.token_ids == (*range(3, 43), 7, 8)  # prompt and output but the last
    assert prefetch.expires_in_s == 18.0  # twice the gap past the turn's end
    assert c.tick(3.0) == []  # sent once
    assert c.turn(2, s, now=10.0) == other
    alloc = [m for e, m in c.sent if isinstance(m, AllocBuffer)][-1]
    assert alloc.warm_session == warm_key(s, "") and c.state.decisions[-1][3] == ReadPath.DE


def test_a_session_on_a_lost_engine_is_prefetched_on_a_live_one():
    c, s = Cluster(), session(next_turn_in_s=10.0)
    first_de = c.turn(1, s, now=0.0)
    c.state.members.lose(first_de, "killed", c.state.tick(0.5))
    prefetches = c.state.tick(1.0).sends
    assert [(e, type(m)) for e, m in prefetches if isinstance(m, Prefetch)] == [
        ("de3" if first_de == "de2" else "de2", Prefetch)]


def test_the_gap_is_learned_from_the_sessions_own_turns():
    c, s = Cluster(), session()
    first_de = c.turn(1, s, now=0.0)
    c.drop(first_de, s, now=1.0)
    assert c.tick(1.0) == []  # nothing says when it comes back
    c.turn(2, s, now=4.0)  # a 4 s tool call
    c.drop(c.state.decisions[-1][2], s, now=5.0)
    (_, prefetch), = c.tick(5.0)
    assert prefetch.expires_in_s == 7.0  # 2 x 4 s past the end at 4 s, seen at 5 s


def test_ended_late_or_disabled_sessions_are_not_prefetched():
    c = Cluster()
    ended = session("done", end_of_session=True)
    c.drop(c.turn(1, ended, now=0.0), ended, now=1.0)
    assert c.tick(1.0) == []
    late = session("late", next_turn_in_s=1.0)
    c.drop(c.turn(2, late, now=0.0), late, now=0.5)
    assert c.tick(2.5) == [] and not c.state.prefetches.away  # forgotten after 2 gaps
    off = Cluster(prefetch=False)
    s = session(next_turn_in_s=10.0)
    off.drop(off.turn(1, s, now=0.0), s, now=1.0)
    assert off.tick(1.0) == []
