"""The decode engine (DE): the host buffer where prompt KV is assembled, decoding, persistence.

``AllocBuffer`` takes host slots for a prompt and, on the DE read path, reads its hit full
blocks from storage into them (through this node's storage NIC); its tokens and salt are kept
for the request's ``Decode``, which does not repeat them. When the PE has filled the rest,
``Decode`` copies the buffer into the paged cache, frees the slots and joins the running
batch. Every full block the sequence completes beyond what storage already holds — the prompt
tail and generated tokens — is gathered into a staging slot and written to storage; a trailing
partial block is not stored (the next turn recomputes it). A gather holds a reference on its
device block until it has read it, so the block is never handed to another request first, even
when the capped NIC runs the copy long after the sequence ended.

Nothing here fails for lack of room: an ``AllocBuffer`` that finds no contiguous run, or a
``Decode`` that finds no free KV blocks, waits (FIFO) until earlier requests free theirs; a block
that finds no free staging slot is saved at a later step, or dropped and counted if its sequence
ended. ``abort`` drops a request in any phase; slots a storage read still fills are freed only
when that read ends, and a buffer a PE may still write into only after a quarantine.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from dualpath.engine.futures import all_of
from dualpath.engine.llm_engine import LLMEngine
from dualpath.errors import HostPoolExhaustedError, OutOfBlocksError
from dualpath.kv.hashing import extend_block_hashes
from dualpath.kv.host_pool import HostPool
from dualpath.protocol import (
    Abort,
    Aborted,
    AllocBuffer,
    BufferReady,
    Decode,
    Failed,
    Finished,
    Message,
    Tokens,
)
from dualpath.request import Sequence
from dualpath.storage.client import StorageClient
from dualpath.traffic.lanes import Lane
from dualpath.traffic.manager import TrafficManager

log = logging.getLogger("dualpath.decode")

FINISH_WAIT_S = 5.0  # longest a finished request waits for its last blocks' writes


@dataclass
class _CopyIn:
    """A request whose prompt KV is on its way from the buffer into its reserved blocks."""

    msg: Decode
    seq: Sequence
    slots: list[int]
    copies: Future[None]
    aborted: bool = False


@dataclass
class _Active:
    req_id: int
    seq: Sequence
    num_saved_blocks: int  # leading blocks known to be in storage
    persist: bool = True  # oracle requests hold meaningless KV: never store it
    num_streamed: int = 1  # output tokens the router has (the first came from the PE)
    num_saving: int = 0  # its blocks staged or being written


class DecodeWorker:
    """Host buffer management, continuous-batching decode and KV persistence."""

    def __init__(self, engine: LLMEngine, host_pool: HostPool, traffic: TrafficManager,
                 storage: StorageClient, staging_blocks: int = 8) -> None:
        self.engine = engine
        self.host_pool = host_pool
        self.traffic = traffic
        self.storage = storage
        self.staging_blocks = staging_blocks  # most slots in flight to storage at once
        self.block_size = engine.config.block_size
        self.layout = engine.layout
        self._buffers: dict[int, list[int]] = {}  # req_id -> host slots
        self._allocs: dict[int, AllocBuffer] = {}  # req_id -> its tokens and salt, for Decode
        self._reading: set[int] = set()  # req_ids whose DE-path read is in flight
        self._orphans: set[int] = set()  # aborted while reading: free the slots when it ends
        self._pending_allocs: deque[AllocBuffer] = deque()  # waiting for a contiguous run
        self._pending_decodes: deque[Decode] = deque()  # waiting for device KV blocks
        self._copying: list[_CopyIn] = []  # prompt KV moving buffer -> cache (async, paced)
        self._active: dict[int, _Active] = {}  # seq_id -> request
        self._events: queue.Queue[tuple[str, object]] = queue.Queue()
        self._quarantine: list[tuple[float, list[int]]] = []  # (free at, slots) of dropped buffers
        self._staging_in_use = 0
        # finished requests whose last blocks are still being written: their Finished waits,
        # so that an agent's next turn, sent the moment this one returns, finds its context
        self._finishing: dict[int, tuple[_Active, Finished, float]] = {}  # -> (.., answer, since)
        # a write that hangs must not hold the answer: past this, it goes without the write
        self.finish_wait_s = FINISH_WAIT_S
        self.num_finish_waits_cut = 0
        self.num_saved_blocks = 0
        self.num_saves_dropped = 0  # full blocks not persisted (no staging room, or a failure)
        self.num_waits = 0  # allocations and decodes that had to wait for room
        self.num_steps = 0
        self.step_s_total = 0.0  # wall time of decode steps, the step hook included
        # Called inside each step with its token count, e.g. the EP traffic generator's
        # exchange (the step waits for it, as MoE dispatch/combine would).
        self.on_step: Callable[[int], None] = lambda num_tokens: None

    def handle(self, msg: Message) -> list[Message]:
        """A request message from the router: ``AllocBuffer``, ``Decode`` or ``Abort``; returns
        the answers."""
        if isinstance(msg, AllocBuffer):
            return self.alloc_buffer(msg)
        if isinstance(msg, Decode):
            return self.start_decode(msg)
        if isinstance(msg, Abort):
            return self.abort(msg.req_id, msg.quarantine_s)
        raise ValueError(f"a decode engine cannot handle {msg.type!r}")

    def work(self) -> list[Message]:
        """Handle finished storage reads and writes, then run one decode step if sequences
        run; returns the messages to send."""
        out = self.drain_events()
        if self.has_work:
            out += self.step()
        return out

    def metrics(self) -> dict[str, object]:
        """This worker's counters."""
        return {"num_saved_blocks": self.num_saved_blocks,
                "num_saves_dropped": self.num_saves_dropped,
                "num_finish_waits_cut": self.num_finish_waits_cut, "num_waits": self.num_waits,
                "num_steps": self.num_steps, "step_s_total": self.step_s_total}

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

    def abort(self, req_id: int, quarantine_s: float = 0.0) -> list[Message]:
        """Drop a request in any phase and free what it holds — its prompt buffer only after
        ``quarantine_s`` when a PE may still be writing into it; answers ``Aborted``."""
        self._pending_allocs = deque(m for m in self._pending_allocs if m.req_id != req_id)
        self._pending_decodes = deque(m for m in self._pending_decodes if m.req_id != req_id)
        self._allocs.pop(req_id, None)
        if req_id in self._reading:
            self._orphans.add(req_id)  # the read still fills the slots
        elif req_id in self._buffers and quarantine_s > 0:
            self._quarantine.append((time.monotonic() + quarantine_s, self._buffers.pop(req_id)))
        elif req_id in self._buffers:
            self.host_pool.free(self._buffers.pop(req_id))
        for seq_id, active in list(self._active.items()):
            if active.req_id == req_id:
                self.engine.abort(active.seq)
                del self._active[seq_id]
        self._finishing.pop(req_id, None)  # its writes still end; nobody waits for them
        for copy in self._copying:
            if copy.msg.req_id == req_id:
                copy.aborted = True  # its slots and blocks are freed when the copies end
        return [Aborted(req_id), *self._start_allocs()]

    def held_requests(self) -> tuple[int, ...]:
        """Req ids this engine holds in any phase."""
        ids = {m.req_id for m in self._pending_allocs} | set(self._buffers)
        ids |= {m.req_id for m in self._pending_decodes}
        ids |= {a.req_id for a in self._active.values()} | set(self._finishing)
        ids |= {c.msg.req_id for c in self._copying if not c.aborted}
        return tuple(sorted(ids - self._orphans))

    def _ready(self, req_id: int, num_loaded: int) -> BufferReady:
        slots = self._buffers[req_id]
        return BufferReady(req_id, self.host_pool.address(slots[0]), len(slots), num_loaded)

    def _layer_major(self, slots: list[int]) -> torch.Tensor:
        """A request's buffer region as ``[layers, n, layer_block_bytes]`` bytes (no copy)."""
        n, layout = len(slots), self.layout
        region = self.host_pool.region(slots[0], n)[: n * layout.full_block_bytes]
        return region.view(layout.num_layers, n, layout.layer_block_bytes)

    # -- decode ---------------------------------------------------------------------------------
    def start_decode(self, msg: Decode) -> list[Message]:
        """Move the assembled prompt KV into the cache and start decoding (or wait for room)."""
        alloc = self._allocs.get(msg.req_id)  # gone with its buffer (or when aborted)
        if alloc is None:
            return [Failed(msg.req_id, "no prompt buffer for this request")]
        if not 0 <= msg.num_prior_outputs < len(alloc.prompt_ids):
            return [Failed(msg.req_id, f"{msg.num_prior_outputs} prior outputs of "
                                       f"{len(alloc.prompt_ids)} tokens")]
        self._pending_decodes.append(msg)
        out = self._start_decodes()
        self.num_waits += msg in self._pending_decodes  # it waits for device KV blocks
        return out

    def _start_decodes(self) -> list[Message]:
        """Reserve device blocks for waiting decodes (FIFO) and start their copy-in; the
        sequences run once their KV has landed (``_end_copies``), so decoding never stalls
        on a copy."""
        while self._pending_decodes:
            msg = self._pending_decodes[0]
            alloc = self._allocs[msg.req_id]
            tokens = alloc.prompt_ids
            num_prompt = len(tokens) - msg.num_prior_outputs  # the rest: moved outputs
            try:
                seq = self.engine.reserve_prefilled(list(tokens[:num_prompt]), msg.params,
                                                    list(tokens[num_prompt:]), alloc.cache_salt)
            except OutOfBlocksError:
                break  # running sequences free blocks as they finish
            self._pending_decodes.popleft()
            log.info("request %d: decode started (%d prompt tokens)", msg.req_id, len(tokens))
            del self._allocs[msg.req_id]
            slots = self._buffers.pop(msg.req_id)
            copies = all_of([] if msg.oracle else self._copy_in(slots, seq.block_table))
            self._copying.append(_CopyIn(msg, seq, slots, copies))
        return self._end_copies()

    def _copy_in(self, slots: list[int], table: list[int]) -> list[Future[None]]:
        """Host buffer -> device cache, every block in one submission, on the NIC's KV-load
        lane."""
        data = self.engine.runner.cache.data
        layer_major = self._layer_major(slots).view(data.dtype)
        layer_major = layer_major.view(data.shape[0], len(slots), *data.shape[2:])
        pairs = [(data[:, block], layer_major[:, b])
                 for b, block in enumerate(table[: len(slots)])]  # the table has room to grow
        return [self.traffic.submit_copies(pairs, Lane.KV_LOAD)]

    def _end_copies(self) -> list[Message]:
        """Start the sequences whose copy-in ended; free their buffers."""
        out: list[Message] = []
        for copy in [c for c in self._copying if c.copies.done()]:
            self._copying.remove(copy)
            self.host_pool.free(copy.slots)
            req_id, error = copy.msg.req_id, copy.copies.exception()
            if copy.aborted or error is not None:
                self.engine.release_reserved(copy.seq)
                if not copy.aborted:
                    out.append(Failed(req_id, f"copy-in failed: {type(error).__name__}: {error}"))
                continue
            seq = copy.seq
            self.engine.start_prefilled(seq, copy.msg.first_token)
            # the router streamed the PE's first token itself, except for a moved stream:
            # then this engine streams from it on (or drops it, see ``start_prefilled``)
            num_streamed = copy.msg.num_prior_outputs or 1
            self._active[seq.seq_id] = _Active(req_id, seq, copy.msg.num_stored_blocks,
                                               persist=not copy.msg.oracle,
                                               num_streamed=num_streamed)
            out.extend(self._after_step([seq] if seq.is_finished else []))
        return out + self._start_allocs()

    @property
    def free_kv_blocks(self) -> int:
        """Device KV blocks not in use."""
        return self.engine.pool.num_free_blocks

    @property
    def has_work(self) -> bool:
        """True while sequences decode (a copy-in in flight is picked up by ``drain_events``,
        which the loop runs at least every idle poll)."""
        return self.engine.has_unfinished

    def step(self) -> list[Message]:
        """One decode step of every running sequence; returns Finished messages (and, when
        the step itself fails, a Failed for every running request)."""
        started_s = time.monotonic()
        try:
            num_tokens = len(self.engine.batcher.running)
            finished = self.engine.step()
            self.on_step(num_tokens)
        except Exception as exc:  # a broken step must not leave requests waiting forever
            return self._fail_all(f"decode step failed: {type(exc).__name__}: {exc}")
        finally:
            self.num_steps += 1
            self.step_s_total += time.monotonic() - started_s
        return self._after_step(finished) + self._start_decodes()

    def _fail_all(self, error: str) -> list[Message]:
        out: list[Message] = []
        for active in list(self._active.values()):
            out.extend(m for m in self.abort(active.req_id) if not isinstance(m, Aborted))
            out.append(Failed(active.req_id, error))
        return out

    def _after_step(self, finished: list[Sequence]) -> list[Message]:
        """Persist new full blocks, stream the step's new tokens (one message), end the
        finished requests."""
        for active in list(self._active.values()):
            if active.persist:
                self._save_new_blocks(active)
        out: list[Message] = self._new_tokens()
        for seq in finished:
            active = self._active.pop(seq.seq_id)
            done = Finished(active.req_id, tuple(seq.output_ids), seq.finish_reason or "")
            if active.num_saving:
                self._finishing[active.req_id] = (active, done, time.monotonic())
            else:
                out.append(done)
        return out

    def _new_tokens(self) -> list[Message]:
        items = []
        for active in self._active.values():
            output = active.seq.output_ids
            if len(output) > active.num_streamed:
                items.append((active.req_id, active.num_streamed,
                              tuple(output[active.num_streamed:])))
                active.num_streamed = len(output)
        return [Tokens(tuple(items))] if items else []

    # -- persistence ----------------------------------------------------------------------------
    def _save_new_blocks(self, active: _Active) -> None:
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
                     active: _Active, block: int) -> None:
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

    def _one_saved(self, active: _Active) -> list[Message]:
        """One of ``active``'s blocks is written (or given up): a finished request whose
        last block this was ends now."""
        active.num_saving -= 1
        waiting = self._finishing.get(active.req_id)
        if active.num_saving or waiting is None or waiting[0] is not active:
            return []
        del self._finishing[active.req_id]
        return [waiting[1]]

    # -- completions from storage threads --------------------------------------------------------
    def drain_events(self) -> list[Message]:
        """Handle finished storage reads and writes and ended quarantines; returns messages
        to send."""
        out: list[Message] = (self._end_quarantines() + self._end_copies()
                              + self._overdue_finishes())
        while True:
            try:
                kind, payload = self._events.get_nowait()
            except queue.Empty:
                return out
            if kind == "read":
                req_id, first, future = payload  # type: ignore[misc]
                out.extend(self._read_done(req_id, first, future))
            elif kind == "gathered":  # a save has read its device block
                self.engine.pool.free([payload])  # type: ignore[list-item]
                out.extend(self._start_decodes())
            else:
                slot, future, active = payload  # type: ignore[misc]
                self.host_pool.free([slot])
                self._staging_in_use -= 1
                out.extend(self._one_saved(active))
                if future.exception() is None and all(future.result()):
                    self.num_saved_blocks += 1
                else:
                    self.num_saves_dropped += 1
                out.extend(self._start_allocs())

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


