"""The decode engine's storage side: the host buffer a prompt's KV is read into, and the
persistence of every full block a sequence completes (``decode.py``'s ``DecodeWorker`` mixes
it in; its state is set up in ``DecodeWorker.__init__``).

A buffer is a contiguous run of host slots, read from storage on the DE read path; a full block
is gathered into a staging slot on the KV-save lane and written to storage from there, the
device block held until the gather has read it.
"""

from __future__ import annotations

import queue
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from dualpath.engine.llm_engine import LLMEngine
from dualpath.errors import HostPoolExhaustedError
from dualpath.kv.hashing import extend_block_hashes
from dualpath.kv.host_pool import HostPool
from dualpath.kv.layout import KVLayout
from dualpath.protocol import AllocBuffer, BufferReady, Failed, Finished, Message
from dualpath.request import Sequence
from dualpath.storage.client import StorageClient
from dualpath.traffic.lanes import Lane
from dualpath.traffic.manager import TrafficManager


@dataclass
class ActiveRequest:
    req_id: int
    seq: Sequence
    num_saved_blocks: int  # leading blocks known to be in storage
    persist: bool = True  # oracle requests hold meaningless KV: never store it
    num_streamed: int = 1  # output tokens the router has (the first came from the PE)
    num_saving: int = 0  # its blocks staged or being written


class DecodeStorage:
    """The DE's prompt buffers (allocation, DE-path reads) and KV persistence."""

    engine: LLMEngine
    host_pool: HostPool
    traffic: TrafficManager
    storage: StorageClient
    staging_blocks: int
    block_size: int
    layout: KVLayout
    _buffers: dict[int, list[int]]
    _allocs: dict[int, AllocBuffer]
    _reading: set[int]
    _orphans: set[int]
    _pending_allocs: deque[AllocBuffer]
    _events: queue.Queue[tuple[str, object]]
    _quarantine: list[tuple[float, list[int]]]
    _staging_in_use: int
    _finishing: dict[int, tuple[ActiveRequest, Finished, float]]
    finish_wait_s: float
    num_finish_waits_cut: int
    num_saves_dropped: int
    num_waits: int

    # -- buffer ---------------------------------------------------------------------------------
    def alloc_buffer(self, msg: AllocBuffer) -> list[Message]:
        """Take a contiguous region (or wait for one); start the DE-path read if asked (reply
        when done).

        Storage holds full blocks, the buffer is layer-major: each block's file is scattered
        straight into its 30-odd layer slices by one vectored read.
        """
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
        space = self.engine.key_space.salted(msg.cache_salt)
        keys = space.keys(msg.prompt_ids)[first : msg.num_read_blocks]
        layers = self._layer_major(slots)  # [layers, n, layer_block_bytes]
        parts = [list(layers[:, b].unbind(0)) for b in range(first, msg.num_read_blocks)]
        self._reading.add(msg.req_id)
        future = self.storage.submit_read(keys, parts)
        # BufferReady only once no read into the buffer can still run: the PE then fills the
        # blocks the deadline gave up on, and no late block can overwrite them
        future.io_done.add_done_callback(
            lambda _, f=future, r=msg.req_id, b=first: self._events.put(("read", (r, b, f))))
        return []

    def _ready(self, req_id: int, num_loaded: int) -> BufferReady:
        slots = self._buffers[req_id]
        return BufferReady(req_id, self.host_pool.address(slots[0]), len(slots), num_loaded)

    def _layer_major(self, slots: list[int]) -> torch.Tensor:
        """A request's buffer region as ``[layers, n, layer_block_bytes]`` bytes (no copy)."""
        n, layout = len(slots), self.layout
        region = self.host_pool.region(slots[0], n)[: n * layout.full_block_bytes]
        return region.view(layout.num_layers, n, layout.layer_block_bytes)

    # -- persistence ----------------------------------------------------------------------------
    def _save_new_blocks(self, active: ActiveRequest) -> None:
        """Write each newly completed full block (still in the cache: blocks of a sequence
        finished in this step are handed out only by a later step, and each gather holds its
        block until it has read it)."""
        seq = active.seq
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= active.num_saved_blocks:
            return
        space = self.engine.key_space.salted(seq.cache_salt)
        hashes = extend_block_hashes(seq.block_hashes, seq.token_ids[: num_full * self.block_size],
                                     self.block_size, space.seed)
        for k in range(active.num_saved_blocks, num_full):
            # a finished sequence's blocks are reused after this step: past the staging share,
            # take any free slot rather than drop them
            full = self._staging_in_use >= self.staging_blocks and not seq.is_finished
            if full or not self.host_pool.num_free:
                if seq.is_finished:  # its blocks are reused after this step: too late
                    self.num_saves_dropped += num_full - k
                    active.num_saved_blocks = num_full
                return  # saved at a later step, when writes have freed staging slots
            slot = self.host_pool.alloc(1)[0]
            self._staging_in_use += 1
            tokens = tuple(seq.token_ids[k * self.block_size:(k + 1) * self.block_size])
            key = space.key(hashes[k], hashes[k - 1] if k else None, token_ids=tokens)
            block = seq.block_table[k]
            # the copy's own reference: however the sequence ends before the copy has run
            # (finish, abort, preemption), the block is not handed out again under it
            self.engine.pool.hold([block])
            copied = self._gather(block, slot)
            active.num_saving += 1
            copied.add_done_callback(
                lambda f, s=slot, key=key, a=active, b=block: self._write_saved(f, s, key, a, b))
            active.num_saved_blocks = k + 1

    def _gather(self, block: int, slot: int) -> Future[None]:
        """Device -> host staging on the KV-save lane, asynchronous (paced by the NIC cap, it
        must not hold up the decode loop); a full block is never written again while its
        sequence runs."""
        data = self.engine.runner.cache.data
        dst = self.host_pool.tensor(slot).view(data.dtype).view(data.shape[0], *data.shape[2:])
        return self.traffic.submit_copy(dst, data[:, block], Lane.KV_SAVE)

    def _write_saved(self, copied: Future[None], slot: int, key: object,
                     active: ActiveRequest, block: int) -> None:
        """Once staged, let the device block go and store the staged copy (runs on the
        traffic manager's thread; the loop drops the block's reference in ``drain_events``)."""
        self._events.put(("gathered", block))
        if copied.exception() is not None:
            self._events.put(("saved", (slot, copied, active)))
            return
        future = self.storage.submit_write([key], [self.host_pool.buffer(slot)])  # type: ignore[list-item]
        future.add_done_callback(lambda f, s=slot: self._events.put(("saved", (s, f, active))))

    def _overdue_finishes(self) -> list[Message]:
        """Answer the finished requests whose writes have taken over ``finish_wait_s``."""
        now = time.monotonic()
        late = [r for r, (_, _, since) in self._finishing.items()
                if now - since > self.finish_wait_s]
        self.num_finish_waits_cut += len(late)
        return [self._finishing.pop(r)[1] for r in late]

    def _one_saved(self, active: ActiveRequest) -> list[Message]:
        """One of ``active``'s blocks is written (or given up): a finished request whose
        last block this was ends now."""
        active.num_saving -= 1
        waiting = self._finishing.get(active.req_id)
        if active.num_saving or waiting is None or waiting[0] is not active:
            return []
        del self._finishing[active.req_id]
        return [waiting[1]]

    # -- completions (``DecodeWorker.drain_events`` runs these) ---------------------------------
    def _end_quarantines(self) -> list[Message]:
        if not self._quarantine:
            return []
        now = time.monotonic()
        for _, slots in (q for q in self._quarantine if q[0] <= now):
            self.host_pool.free(slots)
        self._quarantine = [q for q in self._quarantine if q[0] > now]
        return self._start_allocs()

    def _read_done(self, req_id: int, first: int,
                   future: Future[list[bool]]) -> list[Message]:
        self._reading.discard(req_id)
        if req_id in self._orphans:  # aborted while reading: the slots are free now
            self._orphans.discard(req_id)
            self.host_pool.free(self._buffers.pop(req_id))
            return self._start_allocs()
        ok = future.result() if future.exception() is None else []
        loaded = next((i for i, good in enumerate(ok) if not good), len(ok))
        return [self._ready(req_id, first + loaded)]
