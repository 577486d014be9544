"""What each router request holds, and the node read queues it holds tokens of (pure: no sockets,
no clock).

A request's :class:`Holds` — engine load, the DE's KV and buffer reservations, the PE's host-pool
slots, its node's read-queue tokens — are taken when it is placed and given back on every
terminal path. The :class:`Ledger` owns the read queues and does that accounting, with the rules
that say whether a request can ever fit an engine.
"""

from __future__ import annotations

from dualpath.server.router.types import Holds, Load, Records, RequestState
from dualpath.vocab import ReadPath


class Ledger:
    """The node read queues, and what each request holds of engines and queues."""

    def __init__(self, records: Records) -> None:
        self.records = records
        self.capacity = records.capacity
        self.read_queue_tokens: dict[int, int] = {}  # node -> tokens being read for us

    def add_node(self, node_id: int) -> None:
        """A node has a registered engine: its read queue starts empty."""
        self.read_queue_tokens.setdefault(node_id, 0)

    def hold(self, req: RequestState) -> None:
        """Count a just-placed attempt on its engines and its reading nodes' queues."""
        engines = self.records.engines
        h, de = req.holds, engines[req.de].load
        pe = engines[req.pe].load if req.pe else Load()  # a local prefill holds no PE
        count(pe, req, +1)
        count(de, req, +1)
        h.pe_load, h.de_load = bool(req.pe), True
        h.de_kv_tokens = len(req.prompt_ids) + req.params.max_tokens
        h.de_buffer_blocks = -(-len(req.kv_ids) // self.capacity.block_size)
        de.kv_tokens += h.de_kv_tokens
        de.buffer_blocks += h.de_buffer_blocks
        if req.path == ReadPath.PE and req.reads:
            h.pe_pool_blocks = req.num_hit_blocks
        h.pe_pool_blocks += req.num_pe_read_blocks
        pe.pool_blocks += h.pe_pool_blocks
        if req.path == ReadPath.SPLIT:
            h.read_node = engines[req.pe].info.node_id
            h.read_tokens = req.num_pe_read_blocks * self.capacity.block_size
            h.de_read_node = engines[req.de].info.node_id
            h.de_read_tokens = self.read_tokens(req) - h.read_tokens
            self.read_queue_tokens[h.read_node] += h.read_tokens
            self.read_queue_tokens[h.de_read_node] += h.de_read_tokens
        elif req.reads:
            reader = engines[req.pe if req.path == ReadPath.PE else req.de]
            h.read_node, h.read_tokens = reader.info.node_id, self.read_tokens(req)
            self.read_queue_tokens[h.read_node] += h.read_tokens

    def release(self, req: RequestState) -> None:
        """Give back every hold of the current attempt (on engines still registered)."""
        h = req.holds
        self.release_read(req)
        pe, de = self.records.engines.get(req.pe), self.records.engines.get(req.de)
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

    def release_prefill(self, req: RequestState) -> None:
        """The PE is done with the attempt (or a local prefill's buffer is ready) and its DE
        starts: give back the PE's load and pool slots, the read, and the DE's prompt buffer
        (it frees the buffer now)."""
        h, de = req.holds, self.records.engines[req.de].load
        pe = self.records.engines.get(req.pe)
        self.release_read(req)
        if pe is not None and h.pe_load:
            count(pe.load, req, -1)
            pe.load.pool_blocks -= h.pe_pool_blocks
        de.buffer_blocks -= h.de_buffer_blocks
        h.pe_load, h.pe_pool_blocks, h.de_buffer_blocks = False, 0, 0

    def release_read(self, req: RequestState) -> None:
        """The attempt's reads are done (or dropped): take its tokens off the read queues."""
        h = req.holds
        self.release_de_read(req)
        if h.read_node is not None:
            self.read_queue_tokens[h.read_node] -= h.read_tokens
            h.read_node, h.read_tokens = None, 0

    def release_de_read(self, req: RequestState) -> None:
        """A split read's DE part is done (or dropped)."""
        h = req.holds
        if h.de_read_node is not None:
            self.read_queue_tokens[h.de_read_node] -= h.de_read_tokens
            h.de_read_node, h.de_read_tokens = None, 0

    def never_fits(self, req: RequestState) -> str | None:
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

    def read_tokens(self, req: RequestState) -> int:
        """Tokens of ``req`` to read from storage (its hit, when it reads at all)."""
        return req.num_hit_blocks * self.capacity.block_size if req.reads else 0


def count(load: Load, req: RequestState, sign: int) -> None:
    """Count ``req`` on an engine's ``load`` (``sign`` +1) or take it off (-1)."""
    load.seq += sign
    load.tok += sign * len(req.kv_ids)
