"""A decode node's prompt buffers: contiguous runs of host slots a prompt's KV is assembled in,
read from storage on the DE read path (layer-major: every block's file scattered straight into
its layer slices by one vectored read). Both decode workers hold one: ours
(``engine/decode.py``) and the one that drives a vLLM instance
(``integrations/vllm/engines/decode.py``); each says how a finished read reaches its loop
(``read_io_done``).

Nothing waits for room: an ``AllocBuffer`` that finds no contiguous run waits (FIFO) until
earlier buffers are freed. A buffer a PE may still write into (``Abort(fenced=True)``) is
fenced: kept out of the pool until the router's ``Unfence`` says its writer stopped — never
freed on a timer (``server/router/endings.py``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

import torch

from dualpath.errors import HostPoolExhaustedError
from dualpath.kv.hashing import KeySpace
from dualpath.kv.host_pool import HostPool
from dualpath.kv.layout import KVLayout
from dualpath.protocol import AllocBuffer, BufferReady, Failed, Message, Unfence
from dualpath.storage.client import StorageClient
from dualpath.storage.warm import warm_tag

# (req_id, first block read, the read's future): a read's I/O ended, on a storage thread
ReadIoDone = Callable[[int, int, Future[list[bool]]], None]


class PromptBuffers:
    """Buffer allocation, DE-path reads and fences (module docstring); each decode worker
    holds one."""

    def __init__(self, host_pool: HostPool, storage: StorageClient, layout: KVLayout,
                 key_space: KeySpace, read_io_done: ReadIoDone,
                 new_buffer: Callable[[list[int]], None] | None = None) -> None:
        """``read_io_done(req_id, first, future)`` runs on a storage thread when a DE-path
        read's I/O has ended: the worker's loop then calls ``read_done``. ``new_buffer(slots)``
        runs when a buffer was just allocated, before its read starts."""
        self.host_pool = host_pool
        self.storage = storage
        self.layout = layout
        self.key_space = key_space
        self._read_io_done = read_io_done
        self._new_buffer = new_buffer or (lambda slots: None)
        self.slots: dict[int, list[int]] = {}  # req_id -> its buffer's host slots
        self.allocs: dict[int, AllocBuffer] = {}  # req_id -> its tokens and salt, for Decode
        self.reading: set[int] = set()  # req_ids whose DE-path read is in flight
        self.orphans: set[int] = set()  # dropped while reading: free the slots when it ends
        self.pending: deque[AllocBuffer] = deque()  # waiting for a contiguous run
        self.fenced: dict[int, list[int]] = {}  # req_id -> slots a dropped PE may still write
        self.num_waits = 0  # allocations that had to wait for room

    def alloc_buffer(self, msg: AllocBuffer) -> list[Message]:
        """Take a contiguous region (or wait for one); start the DE-path read if asked (reply
        when done)."""
        if msg.num_blocks > self.host_pool.num_slots:
            return [Failed(msg.req_id, f"the prompt needs {msg.num_blocks} host slots, the "
                                       f"pool has {self.host_pool.num_slots}")]
        self.pending.append(msg)
        out = self.start_allocs()
        self.num_waits += msg in self.pending  # it waits for earlier buffers to go
        return out

    def start_allocs(self) -> list[Message]:
        """Allocate the waiting buffers that fit now, in order; their reads start."""
        out: list[Message] = []
        while self.pending:
            msg = self.pending[0]
            try:
                slots = self.host_pool.alloc_run(msg.num_blocks)
            except HostPoolExhaustedError:
                return out
            self.pending.popleft()
            self._new_buffer(slots)
            self.slots[msg.req_id] = slots
            self.allocs[msg.req_id] = msg
            out.extend(self._start_read(msg, slots))
        return out

    def held(self) -> set[int]:
        """Req ids with a buffer, or waiting for one (those read while dropped included)."""
        return {m.req_id for m in self.pending} | set(self.slots)

    def take(self, req_id: int) -> tuple[AllocBuffer, list[int]]:
        """A request's allocation and buffer slots, handed over (its decode starts)."""
        return self.allocs.pop(req_id), self.slots.pop(req_id)

    def drop(self, req_id: int, fenced: bool) -> None:
        """Forget a request: its wait for a buffer, or its buffer — freed when its read ends
        (an orphan), fenced when a PE may still write it (``fenced``), else freed now."""
        self.pending = deque(m for m in self.pending if m.req_id != req_id)
        self.allocs.pop(req_id, None)
        if req_id in self.reading:
            self.orphans.add(req_id)  # the read still fills the slots (nothing announced)
        elif req_id in self.slots:
            self.release(req_id, self.slots.pop(req_id), fenced)

    def _start_read(self, msg: AllocBuffer, slots: list[int]) -> list[Message]:
        """Read hit blocks ``[read_from_block, num_read_blocks)`` (a split read leaves the
        leading ones to the PE) into their places in the buffer."""
        first = msg.read_from_block
        if msg.num_read_blocks <= first:
            return [self.ready(msg.req_id, msg.num_read_blocks)]
        space = self.key_space.salted(msg.cache_salt)
        keys = space.keys(msg.prompt_ids)[first : msg.num_read_blocks]
        parts = self.block_parts(slots, first, first + len(keys))
        self.reading.add(msg.req_id)
        future = self.storage.submit_read(keys, parts,
                                          keep=warm_tag(msg.warm_session, msg.warm_lease_s))
        # BufferReady only once no read into the buffer can still run: the PE then fills the
        # blocks the deadline gave up on, and no late block can overwrite them
        future.io_done.add_done_callback(
            lambda _, f=future, r=msg.req_id, b=first: self._read_io_done(r, b, f))
        return []

    def ready(self, req_id: int, num_loaded: int) -> BufferReady:
        """The answer that a request's buffer is ready, ``num_loaded`` leading blocks read."""
        slots = self.slots[req_id]
        return BufferReady(req_id, self.host_pool.address(slots[0]), len(slots), num_loaded)

    def block_parts(self, slots: list[int], first: int, end: int) -> list[list[torch.Tensor]]:
        """Blocks ``[first, end)`` of a request's buffer, each as its layers' slices in order:
        a stored block's bytes, scattered (a read) or gathered (a write) by one vectored
        call."""
        layers = self.layer_major(slots)  # [layers, n, layer_block_bytes]
        return [list(layers[:, b].unbind(0)) for b in range(first, end)]

    def layer_major(self, slots: list[int]) -> torch.Tensor:
        """A request's buffer region as ``[layers, n, layer_block_bytes]`` bytes (no copy)."""
        n, layout = len(slots), self.layout
        region = self.host_pool.region(slots[0], n)[: n * layout.full_block_bytes]
        return region.view(*layout.buffer_shape(n))

    def read_done(self, req_id: int, first: int,
                  future: Future[list[bool]]) -> list[Message]:
        """The loop's side of a finished read: ``BufferReady`` with the leading blocks that
        loaded, or the slots freed if the request was dropped meanwhile."""
        self.reading.discard(req_id)
        if req_id in self.orphans:  # dropped while reading: the slots are free now
            self.orphans.discard(req_id)
            self.host_pool.free(self.slots.pop(req_id))
            return self.start_allocs()
        ok = future.result() if future.exception() is None else []
        loaded = next((i for i, good in enumerate(ok) if not good), len(ok))
        return [self.ready(req_id, first + loaded)]

    def release(self, req_id: int, slots: list[int], fenced: bool) -> None:
        """A dropped request's buffer: back to the pool, or fenced when a PE may still write
        it."""
        if not slots:
            return
        if fenced:
            self.fenced[req_id] = slots
        else:
            self.host_pool.free(slots)

    def unfence(self, msg: Unfence) -> list[Message]:
        """The writers of these fenced buffers stopped: free them, start the allocations that
        waited (a request this engine does not hold fenced is ignored)."""
        for req_id in msg.req_ids:
            slots = self.fenced.pop(req_id, None)
            if slots is not None:
                self.host_pool.free(slots)
        return self.start_allocs()

    def fenced_requests(self) -> tuple[int, ...]:
        """Req ids whose buffer is fenced (the heartbeat lists them)."""
        return tuple(sorted(self.fenced))
