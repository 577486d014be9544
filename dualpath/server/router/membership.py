"""Which engines the router counts on, and whether they are alive (pure: no sockets, no clock).

Membership: whenever an engine joins, rejoins or is lost, every registered engine is sent
``Peers`` (the whole list, once per call however many engines changed), so engines know each
other's compute-NIC grant address and EP receive buffer.

Liveness has two clocks, both in the heartbeat: the inbox-read age (a request the router sent
before the engine's last inbox read, and that the engine does not list, was lost on the way:
``UNSEEN_BEATS`` such beats correct it, through ``Abort`` and the fence) and the progress age
(work that has not moved for ``engine_timeout_s`` beyond ``PROGRESS_MARGIN`` times the time the
step under way should take is stuck). A busy engine reads its inbox late and proves nothing.
A role left with no live engine for ``engine_timeout_s`` fails the requests waiting for it.
"""

from __future__ import annotations

from dualpath.protocol import Heartbeat, HeartbeatAck, Hello, PeerInfo, Peers, Unfence
from dualpath.server.router.endings import Endings, Fences
from dualpath.server.router.ledger import Ledger
from dualpath.server.router.types import (
    Effects,
    EngineInfo,
    EngineState,
    Records,
    RequestFailed,
    RequestState,
)
from dualpath.vocab import Phase, Role

UNSEEN_BEATS = 3  # heartbeats of a live engine not listing a request it should hold
MAX_LOST = 1024  # lost engine names remembered
# no progress for engine_timeout_s plus this many times the step's expected time is a hang: a
# layer may run a few times slower than the one before it on a shared core
PROGRESS_MARGIN = 3.0


class Membership:
    """Engines joining, beating, stalling and leaving, and what each of those does to the
    requests they hold."""

    def __init__(self, records: Records, ledger: Ledger, fencing: Fences, endings: Endings,
                 engine_timeout_s: float, heartbeat_s: float) -> None:
        self.records = records
        self.ledger = ledger
        self.fencing = fencing
        self.endings = endings
        self.engine_timeout_s = engine_timeout_s
        self.heartbeat_s = heartbeat_s
        self.public_keys: dict[str, str] | None = None  # engine -> CURVE public key
        self.roles_seen: set[Role] = set()  # roles that had an engine once
        self.role_gone_s: dict[Role, float] = {}  # role -> since when it has no live engine
        self.stuck: dict[str, int] = {}  # engine -> times it was declared stuck (registered)
        self.drift: dict[str, int] = {}  # engine -> requests it and the router disagree on
        self.corrected = 0  # requests an engine lost track of, placed again or failed
        self._changed = False  # an engine joined or left during this call: send Peers

    def hello(self, msg: Hello, now_s: float, out: Effects) -> bool:
        """Register (or re-register) an engine; False if its node hosts the other role."""
        engines = self.records.engines
        if any(e.info.node_id == msg.node_id and e.info.role != msg.role
               for name, e in engines.items() if name != msg.name):
            return False  # a node hosts one role's engines (one scheduler group)
        if msg.name in engines:  # restarted under the same name: its old work is gone
            self.lose(msg.name, f"engine {msg.name} restarted", out)
        self.records.lost.pop(msg.name, None)
        if msg.incarnation:
            # a process says hello only new, or after it dropped its requests and settled
            # every transfer: it writes into no buffer it was given before
            self.fencing.writer_stopped(msg.name, msg.incarnation, out)
        info = EngineInfo(msg.name, msg.role, msg.node_id, msg.endpoint, msg.nic_address,
                          msg.ep_buffer_addr, msg.ep_buffer_bytes, msg.incarnation,
                          (self.public_keys or {}).get(msg.name, ""))
        engines[msg.name] = EngineState(info, now_s)
        self.roles_seen.add(msg.role)
        self.ledger.add_node(msg.node_id)
        self._changed = True
        return True

    def announce_peers(self, out: Effects) -> None:
        """Send every registered engine the engine list, if it changed during this call."""
        if not self._changed:
            return
        self._changed = False
        engines = self.records.engines
        peers = Peers(tuple(PeerInfo(i.name, i.role, i.node_id, i.endpoint, i.nic_address,
                                     i.ep_buffer_addr, i.ep_buffer_bytes, i.public_key)
                            for i in (e.info for e in engines.values())))
        for name in engines:
            out.send(name, peers)

    def heartbeat(self, engine: str, msg: Heartbeat, now_s: float, out: Effects) -> None:
        """Apply an engine's beat: answer it, find it stuck, or correct what it lost track of."""
        state = self.records.engines.get(engine)
        if state is None:
            if engine in self.records.lost:  # declared lost: drop everything, say hello again
                out.send(engine, HeartbeatAck(known=False))
            return  # a beat that overtook the engine's hello (another socket): nothing to say
        allowed_s = self.engine_timeout_s + PROGRESS_MARGIN * msg.step_budget_s
        if msg.progress_age_s > allowed_s and (msg.running or self.held_by(engine)):
            # alive but its work does not move (a transfer that never ends, a deadlock): lost
            # like a silent one; its next beats hear so, and it rejoins once its loop moves
            self.lose(engine, f"engine {engine} made no progress for "
                              f"{msg.progress_age_s:.1f} s (a step of it should take "
                              f"{msg.step_budget_s:.1f} s) while holding requests", out)
            self.stuck[engine] = self.stuck.get(engine, 0) + 1
            out.send(engine, HeartbeatAck(known=False))
            return
        state.last_heard_s = now_s
        state.report = msg
        out.send(engine, HeartbeatAck(known=True))
        stale = self.fencing.unknown(msg.fenced)
        if stale:  # fenced by the DE itself (it was lost), and no writer the router knows of
            out.send(engine, Unfence(stale))
        self._check_held(engine, msg, now_s, out)

    def _check_held(self, engine: str, msg: Heartbeat, now_s: float, out: Effects) -> None:
        """Count the beats of a live engine that read a request's message and does not list it;
        after ``UNSEEN_BEATS`` the request is corrected."""
        mine = {r.wire_id: r for r in self.held_by(engine)}
        self.drift[engine] = len(mine.keys() ^ set(msg.running))
        read_s = now_s - msg.inbox_age_s  # (at the latest) when it last read its inbox
        for wire_id, req in mine.items():
            if wire_id in msg.running:
                req.unseen.pop(engine, None)
                continue
            if read_s <= req.sent_s.get(engine, now_s) + self.heartbeat_s:
                continue  # not read since it was sent (a busy engine): proves nothing
            req.unseen[engine] = req.unseen.get(engine, 0) + 1
            if req.unseen[engine] >= UNSEEN_BEATS:  # a message was lost: correct, go on
                self.corrected += 1
                self.endings.correct(req, engine, out)

    def held_by(self, engine: str) -> list[RequestState]:
        """Requests the router expects ``engine`` to be holding right now."""
        return [r for r in self.records.requests.values()
                if (r.phase == Phase.PREFILLING and engine == r.pe)
                or (r.phase != Phase.QUEUED and engine == r.de)]

    def lose_silent(self, now_s: float, out: Effects) -> None:
        """Declare engines lost whose heartbeats stopped more than the timeout ago."""
        for name, engine in list(self.records.engines.items()):
            if now_s - engine.last_heard_s > self.engine_timeout_s:
                self.lose(name, f"engine {name} silent for over {self.engine_timeout_s:g} s", out)

    def lose(self, name: str, reason: str, out: Effects) -> None:
        """Unregister an engine; its attempts are drained, moved or placed again."""
        records = self.records
        state = records.engines.pop(name, None)
        if state is None:
            return
        self._changed = True
        records.lost[name] = state.info.incarnation
        while len(records.lost) > MAX_LOST:  # a server runs for weeks: forget the oldest
            del records.lost[next(iter(records.lost))]
        self.drift.pop(name, None)
        for req in list(records.draining.values()):
            if name in (req.pe, req.de):
                self.endings.drained(req, out, pe_let_go=False)
        for req in [r for r in records.requests.values() if name in (r.pe, r.de)]:
            if req.phase == Phase.DECODING and name == req.pe:
                continue  # its prefill is done: it decodes on a live DE
            if req.phase == Phase.DECODING:
                self.endings.move(req, out, reason)
            else:
                self.endings.retry(req, out, reason)

    def fail_orphaned(self, now_s: float, out: Effects) -> None:
        """Requests waiting for a role that has had no live engine for ``engine_timeout_s``
        fail with an error that says so (instead of waiting for their deadline)."""
        live = {e.info.role for e in self.records.engines.values()}
        for role in self.roles_seen - live:
            since = self.role_gone_s.setdefault(role, now_s)
            if now_s - since <= self.engine_timeout_s:
                continue
            why = RequestFailed(f"no live {role} engine for over {self.engine_timeout_s:g} s")
            for req in [r for r in self.records.requests.values()
                        if r.phase in (Phase.QUEUED, Phase.MOVING)]:
                self.endings.end(req, out, why)
        for role in live:
            self.role_gone_s.pop(role, None)
