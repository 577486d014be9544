"""How a router request's attempt ends: retried, moved to another decode engine, completed with
an error, drained, forgotten (pure: no sockets, no clock).
"""

from __future__ import annotations

from dualpath.errors import DualPathError
from dualpath.protocol import Abort
from dualpath.server.router_placement import RouterPlacement
from dualpath.server.router_types import Effects, RequestFailed, RequestState
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
        self._release(req)
        self._by_wire.pop(req.wire_id, None)
        req.num_prior_outputs = req.num_streamed
        req.phase = Phase.MOVING
        req.pe = req.de = req.path = ""
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
        """Free the DE's part; its prompt buffer after a quarantine when the PE may still be
        writing into it (the PE was lost or never confirmed), so no late write lands in a
        reused buffer."""
        writer = req.phase in (Phase.PREFILLING, Phase.DRAINING) and not pe_let_go
        out.send(req.de, Abort(req.wire_id, self.engine_timeout_s if writer else 0.0))

    def _drained(self, req: RequestState, out: Effects, pe_let_go: bool) -> None:
        self._abort_de(req, out, pe_let_go)
        self._release(req)
        self.draining.pop(req.wire_id, None)
        self._by_wire.pop(req.wire_id, None)

    def _forget(self, req: RequestState) -> None:
        self.requests.pop(req.req_id, None)
        self._by_wire.pop(req.wire_id, None)
