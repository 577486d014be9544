"""What the router's state records, and what each request holds (pure: no sockets, no clock).

The base of :class:`~dualpath.server.router.state.RouterState`: its records (engines, requests,
node read queues, the latest placements) and the accounting of one request's :class:`Holds` —
taken when it is placed, given back on every terminal path — with the rules that say whether a
request can ever fit an engine.
"""

from __future__ import annotations

from collections import deque

from dualpath.scheduler.global_scheduler import GlobalScheduler
from dualpath.server.router.types import Capacity, EngineState, Fence, Holds, Load, RequestState
from dualpath.vocab import ReadPath, Role

DECISIONS_KEPT = 10_000


class RouterLedger:
    """Requests, engines, nodes and reservations, and what each request holds of them."""

    def __init__(self, scheduler: GlobalScheduler, capacity: Capacity,
                 engine_timeout_s: float, heartbeat_s: float | None = None) -> None:
        self.scheduler = scheduler
        self.capacity = capacity
        self.engine_timeout_s = engine_timeout_s
        self.heartbeat_s = engine_timeout_s / 10 if heartbeat_s is None else heartbeat_s
        self.engines: dict[str, EngineState] = {}
        # engines declared lost (they hear so when they beat again), the latest MAX_LOST, with
        # the incarnation each was
        self.lost: dict[str, str] = {}
        # attempts taken back while their PE may still write their DE buffer (wire id -> fence)
        self.fences: dict[int, Fence] = {}
        self.roles_seen: set[Role] = set()  # roles that had an engine once
        self.role_gone_s: dict[Role, float] = {}  # role -> since when it has no live engine
        self.stuck: dict[str, int] = {}  # engine -> times it was declared stuck (registered)
        self.read_queue_tokens: dict[int, int] = {}  # node -> tokens being read for us
        self.requests: dict[int, RequestState] = {}  # every request not yet completed
        self.draining: dict[int, RequestState] = {}  # completed, the PE not yet let go
        # the latest placements (req, pe, de, path, hit), bounded: a server runs for days
        self.decisions: deque[tuple[int, str, str, str, int]] = deque(maxlen=DECISIONS_KEPT)
        self.dropped_messages = 0  # late, duplicated or unknown messages ignored
        self.drift: dict[str, int] = {}  # engine -> requests it and the router disagree on
        self.corrected = 0  # requests an engine lost track of, placed again or failed
        self.moved = 0  # streams moved off a lost or failing decode engine
        self._by_wire: dict[int, RequestState] = {}
        self._next_wire = 1
        self._members_changed = False  # an engine joined or left during this call: send Peers
        self._now_s = 0.0  # the time of the input being applied (requests' timeline marks)

    # -- holds ----------------------------------------------------------------------------------
    def _hold(self, req: RequestState) -> None:
        h, pe, de = req.holds, self.engines[req.pe].load, self.engines[req.de].load
        count(pe, req, +1)
        count(de, req, +1)
        h.pe_load = h.de_load = True
        h.de_kv_tokens = len(req.prompt_ids) + req.params.max_tokens
        h.de_buffer_blocks = -(-len(req.kv_ids) // self.capacity.block_size)
        de.kv_tokens += h.de_kv_tokens
        de.buffer_blocks += h.de_buffer_blocks
        if req.path == ReadPath.PE and req.reads:
            h.pe_pool_blocks = req.num_hit_blocks
        h.pe_pool_blocks += req.num_pe_read_blocks
        pe.pool_blocks += h.pe_pool_blocks
        if req.path == ReadPath.SPLIT:
            block = self.capacity.block_size
            h.read_node = self.engines[req.pe].info.node_id
            h.read_tokens = req.num_pe_read_blocks * block
            h.de_read_node = self.engines[req.de].info.node_id
            h.de_read_tokens = self._read_tokens(req) - h.read_tokens
            self.read_queue_tokens[h.read_node] += h.read_tokens
            self.read_queue_tokens[h.de_read_node] += h.de_read_tokens
        elif req.reads:
            reader = self.engines[req.pe if req.path == ReadPath.PE else req.de]
            h.read_node, h.read_tokens = reader.info.node_id, self._read_tokens(req)
            self.read_queue_tokens[h.read_node] += h.read_tokens

    def _release(self, req: RequestState) -> None:
        """Give back every hold of the current attempt (on engines still registered)."""
        h = req.holds
        self._release_read(req)
        pe, de = self.engines.get(req.pe), self.engines.get(req.de)
        if pe is not None:
            if h.pe_load:
                count(pe.load, req, -1)
            pe.load.pool_blocks -= h.pe_pool_blocks
        if de is not None:
            if h.de_load:
                count(de.load, req, -1)
            de.load.kv_tokens -= h.de_kv_tokens
            de.load.buffer_blocks -= h.de_buffer_blocks
        req.holds = Holds()

    def _release_read(self, req: RequestState) -> None:
        h = req.holds
        self._release_de_read(req)
        if h.read_node is not None:
            self.read_queue_tokens[h.read_node] -= h.read_tokens
            h.read_node, h.read_tokens = None, 0

    def _release_de_read(self, req: RequestState) -> None:
        """A split read's DE part is done (or dropped)."""
        h = req.holds
        if h.de_read_node is not None:
            self.read_queue_tokens[h.de_read_node] -= h.de_read_tokens
            h.de_read_node, h.de_read_tokens = None, 0

    # -- rules ----------------------------------------------------------------------------------
    def _never_fits(self, req: RequestState) -> str | None:
        """Why no engine could ever take ``req`` (its KV to assemble: the prompt, plus the
        outputs of a moved stream), or None."""
        cap, n = self.capacity, len(req.kv_ids)
        if n == 0:
            return "the prompt is empty"
        prompt = len(req.prompt_ids)  # max_tokens counts a moved stream's outputs
        if prompt + req.params.max_tokens > cap.kv_tokens:
            return (f"prompt ({prompt} tokens) + max_tokens ({req.params.max_tokens}) exceeds "
                    f"an engine's KV cache ({cap.kv_tokens} tokens)")
        blocks = -(-n // cap.block_size)
        pe_tokens = cap.kv_tokens if cap.prefill_kv_tokens is None else cap.prefill_kv_tokens
        if blocks * cap.block_size > pe_tokens:
            return (f"the prompt needs {blocks} KV blocks of {cap.block_size} tokens; a prefill "
                    f"engine's device KV holds {pe_tokens} tokens")
        if blocks > cap.buffer_blocks:
            return (f"the prompt needs {blocks} host-buffer blocks; a decode engine has "
                    f"{cap.buffer_blocks} for prompts")
        return None

    def _read_tokens(self, req: RequestState) -> int:
        return req.num_hit_blocks * self.capacity.block_size if req.reads else 0


def count(load: Load, req: RequestState, sign: int) -> None:
    """Count ``req`` on an engine's ``load`` (``sign`` +1) or take it off (-1)."""
    load.seq += sign
    load.tok += sign * len(req.kv_ids)
