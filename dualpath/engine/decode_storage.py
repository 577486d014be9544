"""The decode engine's storage side: the host buffer a prompt's KV is read into, and the
persistence of every full block a sequence completes (``decode.py``'s ``DecodeWorker`` mixes
it in; its state, the ``PromptBuffers`` included, is set up in ``DecodeWorker.__init__``).

A buffer is a contiguous run of host slots, read from storage on the DE read path
(``prompt_buffers.py``); a full block is gathered into a staging slot on the KV-save lane and
written to storage from there, the device block held until the gather has read it.
"""

from __future__ import annotations

import queue
import time
from concurrent.futures import Future
from dataclasses import dataclass

from dualpath.engine.llm_engine import LLMEngine
from dualpath.engine.prompt_buffers import PromptBuffers
from dualpath.kv.hashing import extend_block_hashes
from dualpath.kv.host_pool import HostPool
from dualpath.protocol import Finished, Message
from dualpath.request import Sequence
from dualpath.storage.client import StorageClient
from dualpath.storage.warm import WarmTag
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
    warm: WarmTag | None = None  # an agent session's: its stored blocks stay warm too


class DecodeStorage:
    """The DE's prompt buffers (``PromptBuffers``: allocation, DE-path reads) and KV
    persistence."""

    buffers: PromptBuffers
    host_pool: HostPool
    storage: StorageClient
    engine: LLMEngine
    traffic: TrafficManager
    staging_blocks: int
    block_size: int
    _events: queue.Queue[tuple[str, object]]
    _staging_in_use: int
    _finishing: dict[int, tuple[ActiveRequest, Finished, float]]
    finish_wait_s: float
    num_finish_waits_cut: int
    num_saves_dropped: int

    def _read_io_done(self, req_id: int, first: int, future: Future[list[bool]]) -> None:
        """A DE-path read's I/O ended: ``DecodeWorker.drain_events`` runs the buffers'
        ``read_done``."""
        self._events.put(("read", (req_id, first, future)))

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
        future = self.storage.submit_write([key], [self.host_pool.buffer(slot)],  # type: ignore[list-item]
                                           keep=active.warm)
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
