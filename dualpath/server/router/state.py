"""The router's state machine: every request's phase and what it holds (pure: no sockets, no
clock reads — time is an argument; the records are in ``router/types.py``).

A request goes QUEUED (in the global scheduler) → BUFFERING (its DE allocates the prompt buffer
and, on the DE read path, reads the hit) → PREFILLING (its PE computes the miss and fills the
buffer) → DECODING → done. Each placement is an *attempt* with its own wire id, so a late
message of an earlier attempt can never move a later one. What a request holds — engine load,
the DE's KV and buffer reservations, the PE's host-pool slots, its node's read-queue tokens —
is recorded in one :class:`Holds` and released by one function on every terminal path:
finished, failed, aborted, engine lost. Every call returns :class:`Effects` (messages to send,
requests to complete) for the I/O loop (``server/router/loop.py``) to carry out.

The class is built in layers, one pure module each: ``router/ledger.py`` (the records and
every request's holds), ``router/placement.py`` (queueing and dispatch), ``router/endings.py``
(retry, move, abort, drain); this module adds the inputs, membership and engine messages.

Membership: whenever an engine joins, rejoins or is lost, every registered engine is sent
``Peers`` (the whole list, once per call however many engines changed), so engines know each
other's compute-NIC grant address and EP receive buffer.

Faults: a request whose engine is lost before decoding started is placed again (up to
``MAX_ATTEMPTS``); one decoding while its PE is lost goes on. One whose DE is lost (or fails it)
while decoding *moves*: it is placed again (MOVING, then QUEUED once its hit is looked up anew:
``Effects.lookups`` → ``resume``) with its prompt plus the tokens already streamed as the KV to
assemble — their full blocks, persisted as they were generated, are hits — and the new DE
samples from the next output index with the same seed, so the caller's stream goes on without a
repeated or missing token; after ``MAX_ATTEMPTS`` placements it fails with a clear error.
A request aborted while its PE may still write into the DE buffer waits in DRAINING until the
PE lets go; where the PE never confirms (it was lost) the buffer is fenced
(``router/endings.py``): it is never reused under a writer not known to have stopped.

Liveness has two clocks, both in the heartbeat: the inbox-read age (a request the router sent
before the engine's last inbox read, and that the engine does not list, was lost on the way:
``UNSEEN_BEATS`` such beats correct it, through ``Abort`` and the fence) and the progress age
(work that has not moved for ``engine_timeout_s`` beyond ``PROGRESS_MARGIN`` times the time the
step under way should take is stuck). A busy engine reads its inbox late and proves nothing.
A role left with no live engine for ``engine_timeout_s`` fails the requests waiting for it.
"""

from __future__ import annotations

from dualpath.errors import RequestError
from dualpath.protocol import (
    Aborted,
    BufferReady,
    Decode,
    Failed,
    Finished,
    Heartbeat,
    HeartbeatAck,
    Hello,
    Message,
    PeerInfo,
    Peers,
    Prefill,
    Prefilled,
    ReadDone,
    Tokens,
    Unfence,
)
from dualpath.server.router.endings import RouterEndings
from dualpath.server.router.ledger import count
from dualpath.server.router.types import (
    ClusterOutput,
    Effects,
    EngineInfo,
    EngineState,
    RequestAborted,
    RequestFailed,
    RequestState,
    timeline,
)
from dualpath.vocab import Mode, Phase, PrefillMode, ReadPath

LET_GO = (Aborted, Failed, Prefilled)  # a PE's answers: no write of the attempt can still land
UNSEEN_BEATS = 3  # heartbeats of a live engine not listing a request it should hold
MAX_LOST = 1024  # lost engine names remembered
# no progress for engine_timeout_s plus this many times the step's expected time is a hang: a
# layer may run a few times slower than the one before it on a shared core
PROGRESS_MARGIN = 3.0


class RouterState(RouterEndings):
    """Requests, engines, nodes and reservations, with every transition between them."""

    public_keys: dict[str, str] | None = None  # engine -> CURVE public key (the router's keys)

    # -- inputs ---------------------------------------------------------------------------------
    def submit(self, req: RequestState, now_s: float) -> Effects:
        """Admit a new request (its hit already looked up) or refuse one that can never fit."""
        out = Effects()
        self._now_s = now_s
        req.marks["submitted"] = now_s
        error = self._never_fits(req)
        if error is not None:
            out.finish(req.req_id, RequestError(error))
            return out
        most = (len(req.prompt_ids) - 1) // self.capacity.block_size  # compute >= 1 token
        req.num_hit_blocks = min(req.num_hit_blocks, most, self.capacity.host_pool_blocks)
        self.requests[req.req_id] = req
        self._enqueue(req)
        self._schedule(out)
        return out

    def abort(self, req_id: int, reason: str) -> Effects:
        """Cancel a request in any phase; its engines are told to drop it."""
        out = Effects()
        req = self.requests.get(req_id)
        if req is not None:
            self._end(req, out, RequestAborted(reason))
            self._schedule(out)
        return out

    def on_message(self, engine: str, msg: Message, now_s: float) -> Effects:
        """Apply one engine message; late, duplicated or unknown ones are counted and dropped."""
        out = Effects()
        self._now_s = now_s
        if getattr(msg, "name", engine) != engine:
            self.dropped_messages += 1  # a message speaks only for the engine that sent it
        elif isinstance(msg, Hello):
            self._hello(msg, now_s, out)
        elif isinstance(msg, Heartbeat):
            self._heartbeat(engine, msg, now_s, out)
        elif engine not in self.engines:
            # a lost engine speaking: it hears so at its heartbeat; a PE's answer for an attempt
            # still lifts that attempt's fence (it writes no more there)
            if not (isinstance(msg, LET_GO) and self._let_go_late(engine, msg.req_id, out)):
                self.dropped_messages += 1
        else:
            self.engines[engine].last_heard_s = now_s
            self._request_message(engine, msg, out)
        self._announce_peers(out)
        self._schedule(out)
        return out

    def tick(self, now_s: float) -> Effects:
        """Declare engines lost whose heartbeats stopped more than the timeout ago; fail the
        waiting requests of a role that has had no live engine for as long."""
        out = Effects()
        self._now_s = now_s
        for name, engine in list(self.engines.items()):
            if now_s - engine.last_heard_s > self.engine_timeout_s:
                self._lose(name, f"engine {name} silent for over {self.engine_timeout_s:g} s", out)
        self._fail_orphaned(now_s, out)
        self._announce_peers(out)
        self._schedule(out)
        return out

    def _fail_orphaned(self, now_s: float, out: Effects) -> None:
        """Requests waiting for a role that has had no live engine for ``engine_timeout_s``
        fail with an error that says so (instead of waiting for their deadline)."""
        live = {e.info.role for e in self.engines.values()}
        for role in self.roles_seen - live:
            since = self.role_gone_s.setdefault(role, now_s)
            if now_s - since <= self.engine_timeout_s:
                continue
            why = RequestFailed(f"no live {role} engine for over {self.engine_timeout_s:g} s")
            for req in [r for r in self.requests.values()
                        if r.phase in (Phase.QUEUED, Phase.MOVING)]:
                self._end(req, out, why)
        for role in live:
            self.role_gone_s.pop(role, None)

    def resume(self, req_id: int, num_hit_blocks: int, now_s: float) -> Effects:
        """Queue a moved request again with its hit (over ``kv_ids``) looked up anew."""
        out = Effects()
        self._now_s = now_s
        req = self.requests.get(req_id)
        if req is None or req.phase != Phase.MOVING:
            return out  # aborted meanwhile
        error = self._never_fits(req)
        if error is not None:  # the prompt and its outputs outgrew a DE's buffer or a PE's KV
            self._end(req, out, RequestFailed(f"the stream cannot move to another decode "
                                              f"engine: {error}"))
            return out
        most = (len(req.kv_ids) - 1) // self.capacity.block_size  # compute >= 1 token
        req.num_hit_blocks = min(num_hit_blocks, most, self.capacity.host_pool_blocks)
        self._enqueue(req)
        self._schedule(out)
        return out

    def lose(self, name: str, reason: str, exited: bool = False) -> Effects:
        """An engine is gone: it stopped answering, or (``exited``, as its launcher saw) its
        process ended — then it writes nowhere any more, and the fences it held are lifted."""
        out = Effects()
        self._lose(name, reason, out)
        if exited:
            self._writer_stopped(name, None, out)
            for wire_id in [w for w, f in self.fences.items() if f.de == name]:
                del self.fences[wire_id]  # the buffer went with its process
        self._announce_peers(out)
        self._schedule(out)
        return out

    # -- observers ------------------------------------------------------------------------------
    def counters(self) -> dict[str, int]:
        """Sums the router holds; all zero on an idle cluster with nothing lost track of."""
        loads = [e.load for e in self.engines.values()]
        return {"read_queue_tokens": sum(self.read_queue_tokens.values()),
                "seq": sum(x.seq for x in loads), "tok": sum(x.tok for x in loads),
                "kv_tokens": sum(x.kv_tokens for x in loads),
                "buffer_blocks": sum(x.buffer_blocks for x in loads),
                "pool_blocks": sum(x.pool_blocks for x in loads),
                "requests": len(self.requests), "draining": len(self.draining),
                "queued": len(self.scheduler), "wire_ids": len(self._by_wire),
                "fences": len(self.fences)}

    # -- engines --------------------------------------------------------------------------------
    def _hello(self, msg: Hello, now_s: float, out: Effects) -> None:
        if any(e.info.node_id == msg.node_id and e.info.role != msg.role
               for name, e in self.engines.items() if name != msg.name):
            self.dropped_messages += 1  # a node hosts one role's engines (one scheduler group)
            return
        if msg.name in self.engines:  # restarted under the same name: its old work is gone
            self._lose(msg.name, f"engine {msg.name} restarted", out)
        self.lost.pop(msg.name, None)
        if msg.incarnation:
            # a process says hello only new, or after it dropped its requests and settled
            # every transfer: it writes into no buffer it was given before
            self._writer_stopped(msg.name, msg.incarnation, out)
        info = EngineInfo(msg.name, msg.role, msg.node_id, msg.endpoint, msg.nic_address,
                          msg.ep_buffer_addr, msg.ep_buffer_bytes, msg.incarnation,
                          (self.public_keys or {}).get(msg.name, ""))
        self.engines[msg.name] = EngineState(info, now_s)
        self.roles_seen.add(msg.role)
        self.read_queue_tokens.setdefault(msg.node_id, 0)
        self._members_changed = True

    def _announce_peers(self, out: Effects) -> None:
        """Send every registered engine the engine list, if it changed during this call."""
        if not self._members_changed:
            return
        self._members_changed = False
        peers = Peers(tuple(PeerInfo(i.name, i.role, i.node_id, i.endpoint, i.nic_address,
                                     i.ep_buffer_addr, i.ep_buffer_bytes, i.public_key)
                            for i in (e.info for e in self.engines.values())))
        for name in self.engines:
            out.send(name, peers)

    def _heartbeat(self, engine: str, msg: Heartbeat, now_s: float, out: Effects) -> None:
        state = self.engines.get(engine)
        if state is None:
            if engine in self.lost:  # it was declared lost: drop everything, say hello again
                out.send(engine, HeartbeatAck(known=False))
            return  # a beat that overtook the engine's hello (another socket): nothing to say
        allowed_s = self.engine_timeout_s + PROGRESS_MARGIN * msg.step_budget_s
        if msg.progress_age_s > allowed_s and (msg.running or self._held_by(engine)):
            # alive but its work does not move (a transfer that never ends, a deadlock): lost
            # like a silent one; its next beats hear so, and it rejoins once its loop moves
            self._lose(engine, f"engine {engine} made no progress for "
                               f"{msg.progress_age_s:.1f} s (a step of it should take "
                               f"{msg.step_budget_s:.1f} s) while holding requests", out)
            self.stuck[engine] = self.stuck.get(engine, 0) + 1
            out.send(engine, HeartbeatAck(known=False))
            return
        state.last_heard_s = now_s
        state.report = msg
        out.send(engine, HeartbeatAck(known=True))
        stale = tuple(w for w in msg.fenced if w not in self.fences)
        if stale:  # fenced by the DE itself (it was lost), and no writer the router knows of
            out.send(engine, Unfence(stale))
        mine = {r.wire_id: r for r in self._held_by(engine)}
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
                self._correct(req, engine, out)

    def _held_by(self, engine: str) -> list[RequestState]:
        """Requests the router expects ``engine`` to be holding right now."""
        return [r for r in self.requests.values()
                if (r.phase == Phase.PREFILLING and engine == r.pe)
                or (r.phase != Phase.QUEUED and engine == r.de)]

    def _lose(self, name: str, reason: str, out: Effects) -> None:
        state = self.engines.pop(name, None)
        if state is None:
            return
        self._members_changed = True
        self.lost[name] = state.info.incarnation
        while len(self.lost) > MAX_LOST:  # a server runs for weeks: forget the oldest
            del self.lost[next(iter(self.lost))]
        self.drift.pop(name, None)
        for req in list(self.draining.values()):
            if name in (req.pe, req.de):
                self._drained(req, out, pe_let_go=False)
        for req in [r for r in self.requests.values() if name in (r.pe, r.de)]:
            if req.phase == Phase.DECODING and name == req.pe:
                continue  # its prefill is done: it decodes on a live DE
            if req.phase == Phase.DECODING:
                self._move(req, out, reason)
            else:
                self._retry(req, out, reason)

    # -- request messages -----------------------------------------------------------------------
    def _request_message(self, engine: str, msg: Message, out: Effects) -> None:
        if isinstance(msg, Tokens):
            for wire_id, first, tokens in msg.items:
                self._tokens(engine, wire_id, first, tokens, out)
            return
        req = self._by_wire.get(getattr(msg, "req_id", -1))
        if req is None:
            if not (isinstance(msg, LET_GO) and self._let_go_late(engine, msg.req_id, out)):
                self.dropped_messages += 1
            return
        if req.phase == Phase.DRAINING:
            if engine == req.pe and isinstance(msg, Aborted | Prefilled | Failed):
                self._drained(req, out, pe_let_go=True)
            else:
                self.dropped_messages += 1
            return
        if isinstance(msg, Failed) and engine in (req.pe, req.de):
            self._failed(req, engine, msg.error, out)
        elif isinstance(msg, BufferReady) and engine == req.de and req.phase == Phase.BUFFERING:
            self._buffer_ready(req, msg, out)
        elif isinstance(msg, ReadDone) and engine == req.pe and req.phase == Phase.PREFILLING:
            self._release_read(req)
        elif isinstance(msg, Prefilled) and engine == req.pe and req.phase == Phase.PREFILLING:
            self._prefilled(req, msg, out)
        elif isinstance(msg, Finished) and engine == req.de and req.phase == Phase.DECODING:
            self._finished(req, msg, out)
        else:
            self.dropped_messages += 1

    def _tokens(self, engine: str, wire_id: int, first: int, tokens: tuple[int, ...],
                out: Effects) -> None:
        req = self._by_wire.get(wire_id)
        if req is None or req.phase != Phase.DECODING or engine != req.de:
            self.dropped_messages += 1
            return
        req.marks.setdefault("first_decode", self._now_s)
        self._stream(req, first, tokens, out)

    def _stream(self, req: RequestState, first: int, tokens: tuple[int, ...],
                out: Effects) -> None:
        """Hand on the tokens from index ``first`` that the caller does not have yet."""
        new = tokens[max(0, req.num_streamed - first):] if first <= req.num_streamed else ()
        if new:
            req.output_ids.extend(new)
            out.stream(req.req_id, tuple(new))

    def _buffer_ready(self, req: RequestState, msg: BufferReady, out: Effects) -> None:
        if req.path == ReadPath.DE:
            self._release_read(req)
        elif req.path == ReadPath.SPLIT:
            self._release_de_read(req)
        if req.path != ReadPath.PE and req.reads:  # a DE loads no more than it was asked
            req.num_hit_blocks = min(req.num_hit_blocks, msg.num_loaded_blocks)
        req.phase = Phase.PREFILLING
        req.marks["buffer_ready"] = self._now_s
        req.sent_s[req.pe] = self._now_s
        de = self.engines[req.de].info
        out.send(req.pe, Prefill(req.wire_id, req.kv_ids, req.num_hit_blocks, req.path,
                                 de.endpoint, msg.buffer_addr, PrefillMode.of(req.mode), req.params,
                                 num_pe_read_blocks=req.num_pe_read_blocks,
                                 num_prior_outputs=req.num_prior_outputs,
                                 cache_salt=req.cache_salt))

    def _prefilled(self, req: RequestState, msg: Prefilled, out: Effects) -> None:
        req.num_hit_blocks = msg.num_hit_blocks
        req.num_computed_tokens = msg.num_computed_tokens
        req.marks["prefilled"] = self._now_s
        req.pe_timings = {"wait_s": msg.wait_s, "read_s": msg.read_s, "forward_s": msg.forward_s}
        h, pe, de = req.holds, self.engines[req.pe].load, self.engines[req.de].load
        self._release_read(req)
        count(pe, req, -1)
        pe.pool_blocks -= h.pe_pool_blocks
        de.buffer_blocks -= h.de_buffer_blocks  # the DE frees the buffer as decoding starts
        h.pe_load, h.pe_pool_blocks, h.de_buffer_blocks = False, 0, 0
        req.phase = Phase.DECODING
        # the tokens and the salt went to this DE in its AllocBuffer
        out.send(req.de, Decode(req.wire_id, msg.first_token, msg.num_hit_blocks, req.params,
                                oracle=req.mode == Mode.ORACLE,
                                num_prior_outputs=req.num_prior_outputs))
        if not req.num_prior_outputs:  # a moved stream's DE streams it (or drops it)
            self._stream(req, 0, (msg.first_token,), out)  # the time to first token ends here

    def _finished(self, req: RequestState, msg: Finished, out: Effects) -> None:
        req.marks.setdefault("first_decode", self._now_s)
        self._stream(req, 0, msg.output_ids, out)  # whatever the last Tokens did not carry
        result = ClusterOutput(req.req_id, list(req.prompt_ids), list(msg.output_ids),
                               msg.finish_reason, req.num_hit_blocks * self.capacity.block_size,
                               req.path, req.pe, req.de, req.num_computed_tokens, req.attempts,
                               timeline(req.marks, req.pe_timings))
        self._release(req)
        self._forget(req)
        out.finish(req.req_id, result)

    def _correct(self, req: RequestState, engine: str, out: Effects) -> None:
        """``engine`` does not hold a request it read the message of: place it again. Its PE
        is told to abort (it may yet hold the request) and the DE buffer stays fenced until it
        answers."""
        reason = f"{engine}: the engine lost track of the request"
        if req.phase == Phase.DECODING:
            self._failed(req, engine, "the engine lost track of the request", out)
        else:
            self._retry(req, out, reason, pe_let_go=False)

    def _failed(self, req: RequestState, engine: str, error: str, out: Effects) -> None:
        if req.phase == Phase.DECODING and engine == req.de:
            self._move(req, out, f"{engine}: {error}")
        elif req.phase == Phase.DECODING:
            self._end(req, out, RequestFailed(f"{engine}: {error}"))
        else:
            self._retry(req, out, f"{engine}: {error}", pe_let_go=engine == req.pe)
