"""Where the router's requests go: the scheduler's view, queueing, and dispatch of the
scheduler's assignments as attempts (pure: no sockets, no clock).

Conditional disaggregation: an agent session's turn that has little to compute beyond its hit
(``scheduler.rules.prefill_on_de``) skips the global scheduler and goes to the decode engine
that keeps the session warm, which takes the hit from its device KV where its prefix cache
still holds it, reads the rest (from its DRAM copy, else from storage) and prefills the tail in
its own decode batch: no prefill engine, no KV over the compute network.
"""

from __future__ import annotations

from collections import deque

from dualpath.protocol import AllocBuffer
from dualpath.scheduler.global_scheduler import GlobalScheduler
from dualpath.scheduler.rules import prefill_on_de
from dualpath.scheduler.view import Assignment, ClusterView, EngineView, NodeView, PendingRequest
from dualpath.server.router.ledger import Ledger
from dualpath.server.router.types import Effects, Records, RequestState
from dualpath.vocab import Mode, Phase, ReadPath, Role

DECISIONS_KEPT = 10_000
WARM_SESSIONS_KEPT = 100_000  # where sessions are warm: the most recent ones


class Placement:
    """The global scheduler's queue, the attempts' wire ids and the latest placements."""

    def __init__(self, records: Records, scheduler: GlobalScheduler, ledger: Ledger,
                 local_prefill_tokens: int = 0) -> None:
        """``local_prefill_tokens``: the most tokens a turn may have to compute and still be
        prefilled on the DE where its session is warm (0: never)."""
        self.records = records
        self.scheduler = scheduler
        self.ledger = ledger
        self.local_prefill_tokens = local_prefill_tokens
        self._local: deque[RequestState] = deque()  # to prefill on their warm DE, if it can
        self.num_local = 0  # attempts prefilled on their decode engine, since start
        # the latest placements (req, pe, de, path, hit), bounded: a server runs for days
        self.decisions: deque[tuple[int, str, str, str, int]] = deque(maxlen=DECISIONS_KEPT)
        # an agent session's warm key -> the DE that last read and stored its blocks, and so
        # keeps them in DRAM (storage/warm.py) unless its budget let them go since
        self.warm_at: dict[str, str] = {}
        self._next_wire = 1

    def warmed(self, req: RequestState) -> None:
        """A request finished: its session's blocks are warm on its DE now."""
        key = req.warm.get("warm_session")
        if not key or not req.de:
            return
        self.warm_at.pop(str(key), None)  # the most recent last
        self.warm_at[str(key)] = req.de
        if len(self.warm_at) > WARM_SESSIONS_KEPT:
            del self.warm_at[next(iter(self.warm_at))]

    def _warm_engine(self, req: RequestState) -> str:
        """The live DE where the request's session is warm ("": none)."""
        engine = self.warm_at.get(str(req.warm.get("warm_session", "")), "")
        return engine if engine in self.records.engines else ""

    def view(self) -> ClusterView:
        """The scheduler's snapshot of engines and node read queues."""
        cap = self.records.capacity
        engines = []
        for name, e in self.records.engines.items():
            info, load = e.info, e.load
            host = cap.host_pool_blocks - load.pool_blocks if info.role == Role.PREFILL else None
            engines.append(EngineView(name, info.role, info.node_id,
                                      f"{info.role}-node{info.node_id}", load.seq, load.tok,
                                      self._free_kv_tokens(name), host))
        nodes = tuple(NodeView(n, max(0, q))
                      for n, q in sorted(self.ledger.read_queue_tokens.items()))
        return ClusterView(tuple(engines), nodes)

    def _free_kv_tokens(self, name: str) -> int:
        """Tokens of device KV (and prompt buffer) an engine can still admit."""
        cap, load = self.records.capacity, self.records.engines[name].load
        free_buffer_tokens = (cap.buffer_blocks - load.buffer_blocks) * cap.block_size
        return max(0, min(cap.kv_tokens - load.kv_tokens, free_buffer_tokens))

    def enqueue(self, req: RequestState) -> None:
        """Queue a request (new, retried or resumed): in the global scheduler, or to be
        prefilled on the DE where its session is warm (``schedule`` decides which)."""
        req.phase = Phase.QUEUED
        req.unseen.clear()
        req.sent_s.clear()
        req.pe = req.de = ""
        req.path = None
        req.local = False
        if (self.local_prefill_tokens and req.mode == Mode.DUALPATH
                and not req.num_prior_outputs and self._warm_engine(req)):
            self._local.append(req)
            return
        self._submit(req)

    def _submit(self, req: RequestState) -> None:
        self.scheduler.submit(PendingRequest(req.req_id, len(req.kv_ids),
                                             self.ledger.read_tokens(req), req.read_path,
                                             req.mode in (Mode.BASIC, Mode.LAYERWISE),
                                             self._warm_engine(req), req.left_de))

    def cancel(self, req: RequestState) -> None:
        """Take a queued request out of the scheduler."""
        if req in self._local:
            self._local.remove(req)
        else:
            self.scheduler.cancel(req.req_id)

    def schedule(self, out: Effects) -> None:
        """Place what the scheduler can place now (once every role has an engine)."""
        self._place_local(out)
        engines = self.records.engines
        if not len(self.scheduler) or not engines:
            return
        if {e.info.role for e in engines.values()} != set(Role):
            return
        for assignment in self.scheduler.schedule(self.view()):
            self._dispatch(self.records.requests[assignment.req_id], assignment, out)

    def _place_local(self, out: Effects) -> None:
        """Prefill each request of ``_local`` on its warm DE when ``prefill_on_de`` says so
        there now; the rest go to the global scheduler."""
        block = self.records.capacity.block_size
        while self._local:
            req = self._local.popleft()
            de, hit, need = self._warm_engine(req), req.num_hit_blocks * block, len(req.kv_ids)
            if de and prefill_on_de(need, hit, self._free_kv_tokens(de),
                                    self.local_prefill_tokens,
                                    self.records.engines[de].load.tok, self._least_tok(need)):
                req.local = True
                self.num_local += 1
                self._dispatch(req, Assignment(req.req_id, "", de, ReadPath.DE, hit, 0, hit),
                               out)
            else:
                self._submit(req)

    def _least_tok(self, need: int) -> int:
        """The least ``tok`` of the decode engines with room for ``need`` tokens."""
        return min((e.load.tok for name, e in self.records.engines.items()
                    if e.info.role == Role.DECODE and self._free_kv_tokens(name) >= need),
                   default=0)

    def _dispatch(self, req: RequestState, a: Assignment, out: Effects) -> None:
        block = self.records.capacity.block_size
        req.attempts += 1
        req.marks["dispatched"] = self.records.now_s
        req.wire_id, self._next_wire = self._next_wire, self._next_wire + 1
        self.records.by_wire[req.wire_id] = req
        req.pe, req.de = a.prefill, a.decode
        req.path = a.read_path  # scheduler/rules.py: read_plan decided it
        req.num_pe_read_blocks = (a.pe_read_tokens // block
                                  if a.read_path == ReadPath.SPLIT else 0)
        req.phase = Phase.BUFFERING
        req.sent_s[req.de] = self.records.now_s
        self.ledger.hold(req)
        self.decisions.append((req.req_id, req.pe, req.de, req.path, req.num_hit_blocks))
        num_blocks = -(-len(req.kv_ids) // block)
        de_reads = req.num_hit_blocks if req.path != ReadPath.PE and req.reads else 0
        out.send(req.de, AllocBuffer(req.wire_id, req.kv_ids, num_blocks, de_reads,
                                     read_from_block=req.num_pe_read_blocks,
                                     cache_salt=req.cache_salt, local=req.local, **req.warm))
