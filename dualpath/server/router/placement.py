"""Where the router's requests go: the scheduler's view, queueing, dispatch and the read path
(pure: no sockets, no clock).
"""

from __future__ import annotations

from dualpath.protocol import AllocBuffer
from dualpath.scheduler.view import Assignment, ClusterView, EngineView, NodeView, PendingRequest
from dualpath.server.router.ledger import RouterLedger
from dualpath.server.router.types import Effects, RequestState
from dualpath.vocab import Mode, Phase, ReadPath, Role


class RouterPlacement(RouterLedger):
    """Queues requests in the global scheduler and dispatches its assignments to engines."""

    def view(self) -> ClusterView:
        """The scheduler's snapshot of engines and node read queues."""
        cap = self.capacity
        engines = []
        for name, e in self.engines.items():
            info, load = e.info, e.load
            free_buffer_tokens = (cap.buffer_blocks - load.buffer_blocks) * cap.block_size
            free = max(0, min(cap.kv_tokens - load.kv_tokens, free_buffer_tokens))
            host = cap.host_pool_blocks - load.pool_blocks if info.role == Role.PREFILL else None
            engines.append(EngineView(name, info.role, info.node_id,
                                      f"{info.role}-node{info.node_id}", load.seq, load.tok, free,
                                      host))
        nodes = tuple(NodeView(n, max(0, q)) for n, q in sorted(self.read_queue_tokens.items()))
        return ClusterView(tuple(engines), nodes)

    def _enqueue(self, req: RequestState) -> None:
        req.phase = Phase.QUEUED
        req.unseen.clear()
        req.sent_s.clear()
        req.pe = req.de = ""
        req.path = None
        self.scheduler.submit(PendingRequest(req.req_id, len(req.kv_ids),
                                             self._read_tokens(req), req.read_path,
                                             req.mode in (Mode.BASIC, Mode.LAYERWISE)))

    def _schedule(self, out: Effects) -> None:
        if not len(self.scheduler) or not self.engines:
            return
        roles = {e.info.role for e in self.engines.values()}
        if roles != set(Role):
            return
        for assignment in self.scheduler.schedule(self.view()):
            self._dispatch(self.requests[assignment.req_id], assignment, out)

    def _dispatch(self, req: RequestState, a: Assignment, out: Effects) -> None:
        req.attempts += 1
        req.marks["dispatched"] = self._now_s
        req.wire_id, self._next_wire = self._next_wire, self._next_wire + 1
        self._by_wire[req.wire_id] = req
        req.pe, req.de = a.prefill, a.decode
        req.path = a.read_path  # scheduler/rules.py: read_plan decided it
        req.num_pe_read_blocks = (a.pe_read_tokens // self.capacity.block_size
                                  if a.read_path == ReadPath.SPLIT else 0)
        req.phase = Phase.BUFFERING
        req.sent_s[req.de] = self._now_s
        self._hold(req)
        self.decisions.append((req.req_id, req.pe, req.de, req.path, req.num_hit_blocks))
        num_blocks = -(-len(req.kv_ids) // self.capacity.block_size)
        de_reads = req.num_hit_blocks if req.path != ReadPath.PE and req.reads else 0
        out.send(req.de, AllocBuffer(req.wire_id, req.kv_ids, num_blocks, de_reads,
                                     read_from_block=req.num_pe_read_blocks,
                                     cache_salt=req.cache_salt))
