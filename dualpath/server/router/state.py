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

The state is composed of parts that each own their data, one pure module each, over shared
:class:`Records` (engines, requests, attempts, drains): the :class:`Ledger` (``router/ledger.py``:
node read queues and every request's holds), :class:`Placement` (``router/placement.py``: the
scheduler's queue, dispatch, wire ids), :class:`Fences` and :class:`Endings`
(``router/endings.py``: retry, move, abort, drain and the write fences they leave), and
:class:`Membership` (``router/membership.py``: engines joining, beating, stalling, leaving).
This module applies the inputs and the requests' engine messages through those parts.

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
"""

from __future__ import annotations

from collections import deque

from dualpath.errors import RequestError
from dualpath.protocol import (
    Aborted,
    BufferReady,
    Decode,
    Failed,
    Finished,
    Heartbeat,
    Hello,
    Message,
    Prefill,
    Prefilled,
    ReadDone,
    Tokens,
)
from dualpath.scheduler.global_scheduler import GlobalScheduler
from dualpath.server.router.endings import Endings, Fences
from dualpath.server.router.ledger import Ledger
from dualpath.server.router.membership import Membership
from dualpath.server.router.placement import Placement
from dualpath.server.router.prefetch import Prefetches
from dualpath.server.router.types import (
    Capacity,
    ClusterOutput,
    Effects,
    EngineState,
    Fence,
    Records,
    RequestAborted,
    RequestFailed,
    RequestState,
    timeline,
)
from dualpath.vocab import Mode, Phase, PrefillMode, ReadPath

LET_GO = (Aborted, Failed, Prefilled)  # a PE's answers: no write of the attempt can still land


class RouterState:
    """Requests, engines, nodes and reservations, with every transition between them."""

    def __init__(self, scheduler: GlobalScheduler, capacity: Capacity,
                 engine_timeout_s: float, heartbeat_s: float | None = None,
                 prefetch: bool = True, local_prefill_tokens: int = 0) -> None:
        """``prefetch``: read sessions' chains into a decode engine's DRAM during their tool
        time when their warm copy went (``prefetch.py``). ``local_prefill_tokens``: a session's
        turn with at most this many tokens to compute is prefilled on the DE where the session
        is warm (``placement.py``; 0: never)."""
        self.capacity = capacity
        self.engine_timeout_s = engine_timeout_s
        self.heartbeat_s = engine_timeout_s / 10 if heartbeat_s is None else heartbeat_s
        self.records = records = Records(capacity)
        self.ledger = Ledger(records)
        self.placement = Placement(records, scheduler, self.ledger, local_prefill_tokens)
        self.fencing = Fences(records)
        self.endings = Endings(records, self.ledger, self.placement, self.fencing)
        self.members = Membership(records, self.ledger, self.fencing, self.endings,
                                  engine_timeout_s, self.heartbeat_s)
        self.prefetches = Prefetches(records, self.placement.warm_at,
                                     self.ledger.read_queue_tokens, prefetch)
        self.dropped_messages = 0  # late, duplicated or unknown messages ignored

    # -- the parts' tables, as callers read them ------------------------------------------------
    @property
    def engines(self) -> dict[str, EngineState]:
        """Registered engines by name."""
        return self.records.engines

    @property
    def requests(self) -> dict[int, RequestState]:
        """Every request not yet completed, by request id."""
        return self.records.requests

    @property
    def draining(self) -> dict[int, RequestState]:
        """Completed attempts whose PE has not let go yet, by wire id."""
        return self.records.draining

    @property
    def fences(self) -> dict[int, Fence]:
        """Fenced DE buffers by wire id."""
        return self.fencing.fences

    @property
    def decisions(self) -> deque[tuple[int, str, str, str, int]]:
        """The latest placements (req, pe, de, path, hit)."""
        return self.placement.decisions

    @property
    def stuck(self) -> dict[str, int]:
        """Engine -> times it was declared stuck."""
        return self.members.stuck

    @property
    def drift(self) -> dict[str, int]:
        """Engine -> requests it and the router disagree on."""
        return self.members.drift

    @property
    def corrected(self) -> int:
        """Requests an engine lost track of, placed again or failed."""
        return self.members.corrected

    @property
    def moved(self) -> int:
        """Streams moved off a lost or failing decode engine."""
        return self.endings.moved

    # -- inputs ---------------------------------------------------------------------------------
    def submit(self, req: RequestState, now_s: float) -> Effects:
        """Admit a new request (its hit already looked up) or refuse one that can never fit."""
        out = Effects()
        self.records.now_s = now_s
        req.marks["submitted"] = now_s
        error = self.ledger.never_fits(req)
        if error is not None:
            out.finish(req.req_id, RequestError(error))
            return out
        most = (len(req.prompt_ids) - 1) // self.capacity.block_size  # compute >= 1 token
        req.num_hit_blocks = min(req.num_hit_blocks, most, self.capacity.host_pool_blocks)
        self.requests[req.req_id] = req
        self.prefetches.returned(req, now_s)
        self.placement.enqueue(req)
        self.placement.schedule(out)
        return out

    def abort(self, req_id: int, reason: str) -> Effects:
        """Cancel a request in any phase; its engines are told to drop it."""
        out = Effects()
        req = self.requests.get(req_id)
        if req is not None:
            self.endings.end(req, out, RequestAborted(reason))
            self.placement.schedule(out)
        return out

    def on_message(self, engine: str, msg: Message, now_s: float) -> Effects:
        """Apply one engine message; late, duplicated or unknown ones are counted and dropped."""
        out = Effects()
        self.records.now_s = now_s
        if getattr(msg, "name", engine) != engine:
            self.dropped_messages += 1  # a message speaks only for the engine that sent it
        elif isinstance(msg, Hello):
            if not self.members.hello(msg, now_s, out):
                self.dropped_messages += 1
        elif isinstance(msg, Heartbeat):
            self.members.heartbeat(engine, msg, now_s, out)
            self.prefetches.lost(engine, msg.warm_dropped)
        elif engine not in self.engines:
            # a lost engine speaking: it hears so at its heartbeat; a PE's answer for an attempt
            # still lifts that attempt's fence (it writes no more there)
            if not (isinstance(msg, LET_GO) and self.fencing.let_go_late(engine, msg.req_id, out)):
                self.dropped_messages += 1
        else:
            self.engines[engine].last_heard_s = now_s
            self._request_message(engine, msg, out)
        self.members.announce_peers(out)
        self.placement.schedule(out)
        return out

    def tick(self, now_s: float) -> Effects:
        """Declare engines lost whose heartbeats stopped more than the timeout ago; fail the
        waiting requests of a role that has had no live engine for as long."""
        out = Effects()
        self.records.now_s = now_s
        self.members.lose_silent(now_s, out)
        self.members.fail_orphaned(now_s, out)
        self.prefetches.check(now_s, out)
        self.members.announce_peers(out)
        self.placement.schedule(out)
        return out

    def resume(self, req_id: int, num_hit_blocks: int, now_s: float) -> Effects:
        """Queue a moved request again with its hit (over ``kv_ids``) looked up anew."""
        out = Effects()
        self.records.now_s = now_s
        req = self.requests.get(req_id)
        if req is None or req.phase != Phase.MOVING:
            return out  # aborted meanwhile
        error = self.ledger.never_fits(req)
        if error is not None:  # the prompt and its outputs outgrew a DE's buffer or a PE's KV
            self.endings.end(req, out, RequestFailed(f"the stream cannot move to another decode "
                                              f"engine: {error}"))
            return out
        most = (len(req.kv_ids) - 1) // self.capacity.block_size  # compute >= 1 token
        req.num_hit_blocks = min(num_hit_blocks, most, self.capacity.host_pool_blocks)
        self.placement.enqueue(req)
        self.placement.schedule(out)
        return out

    def lose(self, name: str, reason: str, exited: bool = False) -> Effects:
        """An engine is gone: it stopped answering, or (``exited``, as its launcher saw) its
        process ended — then it writes nowhere any more, and the fences it held are lifted."""
        out = Effects()
        self.members.lose(name, reason, out)
        if exited:
            self.fencing.writer_stopped(name, None, out)
            self.fencing.buffers_gone(name)  # the buffers went with its process
        self.members.announce_peers(out)
        self.placement.schedule(out)
        return out

    # -- observers ------------------------------------------------------------------------------
    def counters(self) -> dict[str, int]:
        """Sums the router holds; all zero on an idle cluster with nothing lost track of."""
        loads = [e.load for e in self.engines.values()]
        return {"read_queue_tokens": sum(self.ledger.read_queue_tokens.values()),
                "seq": sum(x.seq for x in loads), "tok": sum(x.tok for x in loads),
                "kv_tokens": sum(x.kv_tokens for x in loads),
                "buffer_blocks": sum(x.buffer_blocks for x in loads),
                "pool_blocks": sum(x.pool_blocks for x in loads),
                "requests": len(self.requests), "draining": len(self.draining),
                "queued": len(self.placement.scheduler), "wire_ids": len(self.records.by_wire),
                "fences": len(self.fences)}

    # -- request messages -----------------------------------------------------------------------
    def _request_message(self, engine: str, msg: Message, out: Effects) -> None:
        if isinstance(msg, Tokens):
            for wire_id, first, tokens in msg.items:
                self._tokens(engine, wire_id, first, tokens, out)
            return
        req = self.records.by_wire.get(getattr(msg, "req_id", -1))
        if req is None:
            if not (isinstance(msg, LET_GO) and self.fencing.let_go_late(engine, msg.req_id, out)):
                self.dropped_messages += 1
            return
        if req.phase == Phase.DRAINING:
            if engine == req.pe and isinstance(msg, Aborted | Prefilled | Failed):
                self.endings.drained(req, out, pe_let_go=True)
            else:
                self.dropped_messages += 1
            return
        if isinstance(msg, Failed) and engine in (req.pe, req.de):
            self.endings.failed(req, engine, msg.error, out)
        elif isinstance(msg, BufferReady) and engine == req.de and req.phase == Phase.BUFFERING:
            self._buffer_ready(req, msg, out)
        elif isinstance(msg, ReadDone) and engine == req.pe and req.phase == Phase.PREFILLING:
            self.ledger.release_read(req)
        elif isinstance(msg, Prefilled) and engine == req.pe and req.phase == Phase.PREFILLING:
            self._prefilled(req, msg, out)
        elif isinstance(msg, Finished) and engine == req.de and req.phase == Phase.DECODING:
            self._finished(req, msg, out)
        else:
            self.dropped_messages += 1

    def _tokens(self, engine: str, wire_id: int, first: int, tokens: tuple[int, ...],
                out: Effects) -> None:
        req = self.records.by_wire.get(wire_id)
        if req is None or req.phase != Phase.DECODING or engine != req.de:
            self.dropped_messages += 1
            return
        req.marks.setdefault("first_decode", self.records.now_s)
        if req.local and "prefilled" not in req.marks:  # its DE computed the first token
            req.marks["prefilled"] = self.records.now_s
            req.pe_timings = {"forward_s": self.records.now_s - req.marks["buffer_ready"]}
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
            self.ledger.release_read(req)
        elif req.path == ReadPath.SPLIT:
            self.ledger.release_de_read(req)
        if req.path != ReadPath.PE and req.reads:  # a DE loads no more than it was asked
            req.num_hit_blocks = min(req.num_hit_blocks, msg.num_loaded_blocks)
        req.marks["buffer_ready"] = self.records.now_s
        if req.local:
            self._prefill_on_de(req, out)
            return
        req.phase = Phase.PREFILLING
        req.sent_s[req.pe] = self.records.now_s
        de = self.engines[req.de].info
        out.send(req.pe, Prefill(req.wire_id, req.kv_ids, req.num_hit_blocks, req.path,
                                 de.endpoint, msg.buffer_addr, PrefillMode.of(req.mode), req.params,
                                 num_pe_read_blocks=req.num_pe_read_blocks,
                                 num_prior_outputs=req.num_prior_outputs,
                                 cache_salt=req.cache_salt, **req.warm))

    def _prefill_on_de(self, req: RequestState, out: Effects) -> None:
        """A local attempt's hit is in its DE's buffer: the DE prefills the rest and streams
        from the first token on (no PE, so no writer and nothing to fence)."""
        block = self.capacity.block_size
        req.num_computed_tokens = len(req.kv_ids) - req.num_hit_blocks * block
        self.ledger.release_prefill(req)
        req.phase = Phase.DECODING
        req.sent_s[req.de] = self.records.now_s
        out.send(req.de, Decode(req.wire_id, 0, req.num_hit_blocks, req.params, local=True))

    def _prefilled(self, req: RequestState, msg: Prefilled, out: Effects) -> None:
        req.num_hit_blocks = msg.num_hit_blocks
        req.num_computed_tokens = msg.num_computed_tokens
        req.marks["prefilled"] = self.records.now_s
        req.pe_timings = {"wait_s": msg.wait_s, "read_s": msg.read_s, "forward_s": msg.forward_s}
        self.ledger.release_prefill(req)
        req.phase = Phase.DECODING
        # the tokens and the salt went to this DE in its AllocBuffer
        out.send(req.de, Decode(req.wire_id, msg.first_token, msg.num_hit_blocks, req.params,
                                oracle=req.mode == Mode.ORACLE,
                                num_prior_outputs=req.num_prior_outputs))
        if not req.num_prior_outputs:  # a moved stream's DE streams it (or drops it)
            self._stream(req, 0, (msg.first_token,), out)  # the time to first token ends here

    def _finished(self, req: RequestState, msg: Finished, out: Effects) -> None:
        req.marks.setdefault("first_decode", self.records.now_s)
        self._stream(req, 0, msg.output_ids, out)  # whatever the last Tokens did not carry
        # the output is what the caller was streamed: a DE whose Finished disagrees with its
        # own Tokens (or with the PE's first token) cannot hand it a different text at the end
        result = ClusterOutput(req.req_id, list(req.prompt_ids), list(req.output_ids),
                               msg.finish_reason, req.num_hit_blocks * self.capacity.block_size,
                               req.path, req.pe, req.de, req.num_computed_tokens, req.attempts,
                               timeline(req.marks, req.pe_timings))
        self.ledger.release(req)
        self.placement.warmed(req)
        self.prefetches.ended(req, result, self.records.now_s)
        self.records.forget(req)
        out.finish(req.req_id, result)
