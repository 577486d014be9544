"""How a router request's attempt ends: retried, moved to another decode engine, completed with
an error, drained, forgotten (pure: no sockets, no clock) — and the write fences those endings
leave behind.

**Fences, not timers.** A prefill engine writes a request's KV into its DE buffer with one-sided
transfers the DE cannot refuse. So when an attempt is taken back while its PE may still be
writing (the PE was lost, or never confirmed an abort), the DE keeps the buffer out of its pool
(``Abort(fenced=True)``) and the router records a :class:`Fence`. The fence is lifted — the DE
told ``Unfence`` — only once that writer is known to have stopped: it answered for the request
(``Aborted``, ``Failed`` or ``Prefilled``: a PE sends them only once no write of the request can
still land, and they count even from an engine declared lost), it said hello again as the same
process (it drops its requests and settles its transfers first), or its process exited (the
launcher saw it). A heartbeat timeout decides where new work goes; it never frees memory. A DE
lists its fenced buffers in its heartbeats; those the router holds no fence for (a DE that was
itself declared lost fences every buffer it announced) are unfenced then.
"""

from __future__ import annotations

from dualpath.errors import DualPathError
from dualpath.protocol import Abort, Unfence
from dualpath.server.router.ledger import Ledger
from dualpath.server.router.placement import Placement
from dualpath.server.router.types import Effects, Fence, Records, RequestFailed, RequestState
from dualpath.vocab import Phase

MAX_ATTEMPTS = 4  # placements of one request before an engine problem fails it


class Fences:
    """The DE prompt buffers a writer the router gave up on may still reach (wire id -> fence)."""

    def __init__(self, records: Records) -> None:
        self.records = records
        self.fences: dict[int, Fence] = {}

    def fence(self, req: RequestState) -> None:
        """Record that the attempt's PE may still write its DE buffer; the buffer's blocks stay
        counted on the DE until the fence is lifted."""
        engines, lost = self.records.engines, self.records.lost
        pe = engines.get(req.pe)
        incarnation = pe.info.incarnation if pe is not None else lost.get(req.pe, "")
        self.fences[req.wire_id] = Fence(req.pe, incarnation, req.de, engines.get(req.de),
                                         req.holds.de_buffer_blocks)
        req.holds.de_buffer_blocks = 0  # the fence holds them now

    def lift(self, wire_ids: list[int], out: Effects) -> None:
        """The writers of these fences stopped: uncount their blocks and tell the DEs."""
        by_de: dict[str, list[int]] = {}
        for wire_id in wire_ids:
            fence = self.fences.pop(wire_id, None)
            if fence is None:
                continue
            de = self.records.engines.get(fence.de)
            if de is not None and de is fence.de_state:
                de.load.buffer_blocks -= fence.buffer_blocks
            if de is not None:
                by_de.setdefault(fence.de, []).append(wire_id)
        for de_name, ids in by_de.items():
            out.send(de_name, Unfence(tuple(sorted(ids))))

    def writer_stopped(self, name: str, incarnation: str | None, out: Effects) -> None:
        """Engine ``name`` (that process, when ``incarnation`` is given) writes no more: lift
        every fence it is the writer of."""
        self.lift([w for w, f in self.fences.items() if f.pe == name
                   and (incarnation is None or f.incarnation == incarnation)], out)

    def let_go_late(self, engine: str, wire_id: int, out: Effects) -> bool:
        """A PE answered for an attempt the router took back: its fence (if any) is lifted.
        True if the answer was for a fence."""
        fence = self.fences.get(wire_id)
        if fence is None or fence.pe != engine:
            return False
        self.lift([wire_id], out)
        return True

    def buffers_gone(self, de_name: str) -> None:
        """A DE's process exited: the buffers fenced on it went with it."""
        for wire_id in [w for w, f in self.fences.items() if f.de == de_name]:
            del self.fences[wire_id]

    def unknown(self, wire_ids: tuple[int, ...]) -> tuple[int, ...]:
        """Of the buffers a DE lists as fenced, those the router holds no fence for."""
        return tuple(w for w in wire_ids if w not in self.fences)


class Endings:
    """Takes attempts back from their engines and completes or re-places their requests."""

    def __init__(self, records: Records, ledger: Ledger, placement: Placement,
                 fences: Fences) -> None:
        self.records = records
        self.ledger = ledger
        self.placement = placement
        self.fences = fences
        self.moved = 0  # streams moved off a lost or failing decode engine

    def retry(self, req: RequestState, out: Effects, reason: str,
              pe_let_go: bool = False) -> None:
        """Take an attempt back from its engines and queue the request again (or fail it)."""
        if req.attempts >= MAX_ATTEMPTS:
            self.end(req, out, RequestFailed(f"{reason} (after {req.attempts} attempts)"))
            return
        self._tell_engines(req, out, pe_let_go)
        self.ledger.release(req)
        self.records.by_wire.pop(req.wire_id, None)
        self.placement.enqueue(req)

    def move(self, req: RequestState, out: Effects, reason: str) -> None:
        """Its DE is gone or failed it while decoding: continue the stream on another DE from
        the KV of the prompt and the tokens streamed so far (``router/state.py``'s docstring)."""
        if req.attempts >= MAX_ATTEMPTS:
            self.end(req, out, RequestFailed(
                f"{reason} while decoding the request (after {req.attempts} attempts)"))
            return
        self._tell_engines(req, out, pe_let_go=True)  # decoding: only the DE holds it
        self.moved += 1
        self.ledger.release(req)
        self.records.by_wire.pop(req.wire_id, None)
        req.num_prior_outputs = req.num_streamed
        req.phase = Phase.MOVING
        req.left_de = req.de
        req.pe = req.de = ""
        req.path = None
        out.lookup(req.req_id)

    def end(self, req: RequestState, out: Effects, error: DualPathError) -> None:
        """Complete a request with an error, freeing what it holds on live engines."""
        records = self.records
        if req.phase in (Phase.QUEUED, Phase.MOVING):
            self.placement.cancel(req)
            records.forget(req)
        elif (req.phase == Phase.PREFILLING and req.pe in records.engines
              and req.de in records.engines):
            out.send(req.pe, Abort(req.wire_id))  # the DE buffer stays until the PE lets go
            req.phase = Phase.DRAINING
            del records.requests[req.req_id]
            records.draining[req.wire_id] = req
        else:
            self._tell_engines(req, out, pe_let_go=False)
            self.ledger.release(req)
            records.forget(req)
        out.finish(req.req_id, error)

    def drained(self, req: RequestState, out: Effects, pe_let_go: bool) -> None:
        """A draining attempt's PE let go (or was lost): free the DE's part and forget it."""
        self._abort_de(req, out, pe_let_go)
        self.ledger.release(req)
        self.records.draining.pop(req.wire_id, None)
        self.records.by_wire.pop(req.wire_id, None)

    def correct(self, req: RequestState, engine: str, out: Effects) -> None:
        """``engine`` does not hold a request it read the message of: place it again. Its PE
        is told to abort (it may yet hold the request) and the DE buffer stays fenced until it
        answers."""
        reason = f"{engine}: the engine lost track of the request"
        if req.phase == Phase.DECODING:
            self.failed(req, engine, "the engine lost track of the request", out)
        else:
            self.retry(req, out, reason, pe_let_go=False)

    def failed(self, req: RequestState, engine: str, error: str, out: Effects) -> None:
        """``engine`` failed the attempt: move a decoding stream off its DE, fail one whose
        PE failed after prefill, place any other again."""
        if req.phase == Phase.DECODING and engine == req.de:
            self.move(req, out, f"{engine}: {error}")
        elif req.phase == Phase.DECODING:
            self.end(req, out, RequestFailed(f"{engine}: {error}"))
        else:
            self.retry(req, out, f"{engine}: {error}", pe_let_go=engine == req.pe)

    def _tell_engines(self, req: RequestState, out: Effects, pe_let_go: bool) -> None:
        """Abort the attempt on its engines — registered or not: one declared lost may be alive
        (stopped, rejoining) and still hold it; ZeroMQ drops what a dead one cannot take."""
        if req.phase != Phase.DECODING and not pe_let_go and req.pe:  # the PE let go at
            out.send(req.pe, Abort(req.wire_id))  # Prefilled; a local attempt has none
        self._abort_de(req, out, pe_let_go)

    def _abort_de(self, req: RequestState, out: Effects, pe_let_go: bool) -> None:
        """Free the DE's part; its prompt buffer stays fenced while the PE may still be writing
        into it (it was lost or never confirmed), so no late write lands in a reused buffer."""
        writer = req.phase in (Phase.PREFILLING, Phase.DRAINING) and not pe_let_go
        if writer:
            self.fences.fence(req)
        out.send(req.de, Abort(req.wire_id, fenced=writer))
