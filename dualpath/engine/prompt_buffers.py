"""A decode node's prompt buffers: contiguous runs of host slots a prompt's KV is assembled in,
read from storage on the DE read path (layer-major: every block's file scattered straight into
its layer slices by one vectored read). Both decode workers mix it in: ours
(``engine/decode.py``) and the one that drives a vLLM instance
(``integrations/vllm/engines/decode.py``); each sets up the state named below in its
``__init__`` and says how a finished read reaches its loop (``_read_io_done``).

Nothing waits for room: an ``AllocBuffer`` that finds no contiguous run waits (FIFO) until
earlier buffers are freed. A buffer a PE may still write into (``Abort(fenced=True)``) is
fenced: kept out of the pool until the router's ``Unfence`` says its writer stopped — never
freed on a timer (``server/router/endings.py``).
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future

import torch

from dualpath.errors import HostPoolExhaustedError
from dualpath.kv.hashing import KeySpace
from dualpath.kv.host_pool import HostPool
from dualpath.kv.layout import KVLayout
from dualpath.protocol import AllocBuffer, BufferReady, Failed, Message, Unfence
from dualpath.storage.client import StorageClient


class PromptBuffers:
    """Buffer allocation, DE-path reads and fences (module docstring)."""

    host_pool: HostPool
    storage: StorageClient
    layout: KVLayout
    key_space: KeySpace
    num_waits: int
    _buffers: dict[int, list[int]]  # req_id -> host slots
    _allocs: dict[int, AllocBuffer]  # req_id -> its tokens and salt, for Decode
    _reading: set[int]  # req_ids whose DE-path read is in flight
    _orphans: set[int]  # aborted while reading: free the slots when it ends
    _pending_allocs: deque[AllocBuffer]  # waiting for a contiguous run
    _fenced: dict[int, list[int]]  # req_id -> slots of a dropped buffer a PE may still write

    def _read_io_done(self, req_id: int, first: int, future: Future[list[bool]]) -> None:
        """A read's I/O ended (on a storage thread): have the loop run ``_read_done``."""
        raise NotImplementedError

    def _new_buffer(self, slots: list[int]) -> None:
        """A buffer was just allocated (before its read starts)."""

    def alloc_buffer(self, msg: AllocBuffer) -> list[Message]:
        """Take a contiguous region (or wait for one); start the DE-path read if asked (reply
        when done)."""
        if msg.num_blocks > self.host_pool.num_slots:
            return [Failed(msg.req_id, f"the prompt needs {msg.num_blocks} host slots, the "
                                       f"pool has {self.host_pool.num_slots}")]
        self._pending_allocs.append(msg)
        out = self._start_allocs()
        self.num_waits += msg in self._pending_allocs  # it waits for earlier buffers to go
        return out

    def _start_allocs(self) -> list[Message]:
        out: list[Message] = []
        while self._pending_allocs:
            msg = self._pending_allocs[0]
            try:
                slots = self.host_pool.alloc_run(msg.num_blocks)
            except HostPoolExhaustedError:
                return out
            self._pending_allocs.popleft()
            self._new_buffer(slots)
            self._buffers[msg.req_id] = slots
            self._allocs[msg.req_id] = msg
            out.extend(self._start_read(msg, slots))
        return out

    def _start_read(self, msg: AllocBuffer, slots: list[int]) -> list[Message]:
        """Read hit blocks ``[read_from_block, num_read_blocks)`` (a split read leaves the
        leading ones to the PE) into their places in the buffer."""
        first = msg.read_from_block
        if msg.num_read_blocks <= first:
            return [self._ready(msg.req_id, msg.num_read_blocks)]
        space = self.key_space.salted(msg.cache_salt)
        keys = space.keys(msg.prompt_ids)[first : msg.num_read_blocks]
        parts = self._block_parts(slots, first, first + len(keys))
        self._reading.add(msg.req_id)
        future = self.storage.submit_read(keys, parts)
        # BufferReady only once no read into the buffer can still run: the PE then fills the
        # blocks the deadline gave up on, and no late block can overwrite them
        future.io_done.add_done_callback(
            lambda _, f=future, r=msg.req_id, b=first: self._read_io_done(r, b, f))
        return []

    def _ready(self, req_id: int, num_loaded: int) -> BufferReady:
        slots = self._buffers[req_id]
        return BufferReady(req_id, self.host_pool.address(slots[0]), len(slots), num_loaded)

    def _block_parts(self, slots: list[int], first: int, end: int) -> list[list[torch.Tensor]]:
        """Blocks ``[first, end)`` of a request's buffer, each as its layers' slices in order:
        a stored block's bytes, scattered (a read) or gathered (a write) by one vectored
        call."""
        layers = self._layer_major(slots)  # [layers, n, layer_block_bytes]
        return [list(layers[:, b].unbind(0)) for b in range(first, end)]

    def _layer_major(self, slots: list[int]) -> torch.Tensor:
        """A request's buffer region as ``[layers, n, layer_block_bytes]`` bytes (no copy)."""
        n, layout = len(slots), self.layout
        region = self.host_pool.region(slots[0], n)[: n * layout.full_block_bytes]
        return region.view(*layout.buffer_shape(n))

    def _read_done(self, req_id: int, first: int,
                   future: Future[list[bool]]) -> list[Message]:
        """The loop's side of a finished read: ``BufferReady`` with the leading blocks that
        loaded, or the slots freed if the request was aborted meanwhile."""
        self._reading.discard(req_id)
        if req_id in self._orphans:  # aborted while reading: the slots are free now
            self._orphans.discard(req_id)
            self.host_pool.free(self._buffers.pop(req_id))
            return self._start_allocs()
        ok = future.result() if future.exception() is None else []
        loaded = next((i for i, good in enumerate(ok) if not good), len(ok))
        return [self._ready(req_id, first + loaded)]

    def _release_buffer(self, req_id: int, slots: list[int], fenced: bool) -> None:
        """A dropped request's buffer: back to the pool, or fenced when a PE may still write
        it."""
        if not slots:
            return
        if fenced:
            self._fenced[req_id] = slots
        else:
            self.host_pool.free(slots)

    def unfence(self, msg: Unfence) -> list[Message]:
        """The writers of these fenced buffers stopped: free them, start the allocations that
        waited (a request this engine does not hold fenced is ignored)."""
        for req_id in msg.req_ids:
            slots = self._fenced.pop(req_id, None)
            if slots is not None:
                self.host_pool.free(slots)
        return self._start_allocs()

    def fenced_requests(self) -> tuple[int, ...]:
        """Req ids whose buffer is fenced (the heartbeat lists them)."""
        return tuple(sorted(self._fenced))
