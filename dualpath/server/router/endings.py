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
from dualpath.server.router.placement import RouterPlacement
from dualpath.server.router.types import Effects, Fence, RequestFailed, RequestState
from dualpath.vocab import Phase

MAX_ATTEMPTS = 4  # placements of one request before an engine problem fails it


class RouterEndings(RouterPlacement):
    """Takes attempts back from their engines and completes or re-places their requests."""

    def _retry(self, req: RequestState, out: Effects, reason: str,
               pe_let_go: bool = False) -> None:
        """Take an attempt back from its engines and queue the request again (or fail it)."""
        if req.attempts >= MAX_ATTEMPTS:
            self._end(req, out, RequestFailed(f"{reason} (after {req.attempts} attempts)"))
            return
        self._tell_engines(req, out, pe_let_go)
        self._release(req)
        self._by_wire.pop(req.wire_id, None)
        self._enqueue(req)

    def _move(self, req: RequestState, out: Effects, reason: str) -> None:
        """Its DE is gone or failed it while decoding: continue the stream on another DE from
        the KV of the prompt and the tokens streamed so far (see the module docstring)."""
        if req.attempts >= MAX_ATTEMPTS:
            self._end(req, out, RequestFailed(
                f"{reason} while decoding the request (after {req.attempts} attempts)"))
            return
        self._tell_engines(req, out, pe_let_go=True)  # decoding: only the DE holds it
        self.moved += 1
        self._release(req)
        self._by_wire.pop(req.wire_id, None)
        req.num_prior_outputs = req.num_streamed
        req.phase = Phase.MOVING
        req.pe = req.de = ""
        req.path = None
        out.lookup(req.req_id)

    def _end(self, req: RequestState, out: Effects, error: DualPathError) -> None:
        """Complete a request with an error, freeing what it holds on live engines."""
        if req.phase in (Phase.QUEUED, Phase.MOVING):
            self.scheduler.cancel(req.req_id)
            self._forget(req)
        elif req.phase == Phase.PREFILLING and req.pe in self.engines and req.de in self.engines:
            out.send(req.pe, Abort(req.wire_id))  # the DE buffer stays until the PE lets go
            req.phase = Phase.DRAINING
            del self.requests[req.req_id]
            self.draining[req.wire_id] = req
        else:
            self._tell_engines(req, out, pe_let_go=False)
            self._release(req)
            self._forget(req)
        out.finish(req.req_id, error)

    def _tell_engines(self, req: RequestState, out: Effects, pe_let_go: bool) -> None:
        """Abort the attempt on its engines — registered or not: one declared lost may be alive
        (stopped, rejoining) and still hold it; ZeroMQ drops what a dead one cannot take."""
        if req.phase != Phase.DECODING and not pe_let_go:  # the PE let go at Prefilled
            out.send(req.pe, Abort(req.wire_id))
        self._abort_de(req, out, pe_let_go)

    def _abort_de(self, req: RequestState, out: Effects, pe_let_go: bool) -> None:
        """Free the DE's part; its prompt buffer stays fenced while the PE may still be writing
        into it (it was lost or never confirmed), so no late write lands in a reused buffer."""
        writer = req.phase in (Phase.PREFILLING, Phase.DRAINING) and not pe_let_go
        if writer:
            self._fence(req)
        out.send(req.de, Abort(req.wire_id, fenced=writer))

    def _fence(self, req: RequestState) -> None:
        """Record that the attempt's PE may still write its DE buffer; the buffer's blocks stay
        counted on the DE until the fence is lifted."""
        pe = self.engines.get(req.pe)
        incarnation = pe.info.incarnation if pe is not None else self.lost.get(req.pe, "")
        de = self.engines.get(req.de)
        self.fences[req.wire_id] = Fence(req.pe, incarnation, req.de, de,
                                         req.holds.de_buffer_blocks)
        req.holds.de_buffer_blocks = 0  # the fence holds them now

    def _lift(self, wire_ids: list[int], out: Effects) -> None:
        """The writers of these fences stopped: uncount their blocks and tell the DEs."""
        by_de: dict[str, list[int]] = {}
        for wire_id in wire_ids:
            fence = self.fences.pop(wire_id, None)
            if fence is None:
                continue
            de = self.engines.get(fence.de)
            if de is not None and de is fence.de_state:
                de.load.buffer_blocks -= fence.buffer_blocks
            if de is not None:
                by_de.setdefault(fence.de, []).append(wire_id)
        for de_name, ids in by_de.items():
            out.send(de_name, Unfence(tuple(sorted(ids))))

    def _writer_stopped(self, name: str, incarnation: str | None, out: Effects) -> None:
        """Engine ``name`` (that process, when ``incarnation`` is given) writes no more: lift
        every fence it is the writer of."""
        self._lift([w for w, f in self.fences.items() if f.pe == name
                    and (incarnation is None or f.incarnation == incarnation)], out)

    def _let_go_late(self, engine: str, wire_id: int, out: Effects) -> bool:
        """A PE answered for an attempt the router took back: its fence (if any) is lifted.
        True if the answer was for a fence."""
        fence = self.fences.get(wire_id)
        if fence is None or fence.pe != engine:
            return False
        self._lift([wire_id], out)
        return True

    def _drained(self, req: RequestState, out: Effects, pe_let_go: bool) -> None:
        self._abort_de(req, out, pe_let_go)
        self._release(req)
        self.draining.pop(req.wire_id, None)
        self._by_wire.pop(req.wire_id, None)

    def _forget(self, req: RequestState) -> None:
        self.requests.pop(req.req_id, None)
        self._by_wire.pop(req.wire_id, None)
