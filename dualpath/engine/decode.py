"""The decode engine (DE): the host buffer where prompt KV is assembled, decoding, persistence.

``AllocBuffer`` takes host slots for a prompt and, on the DE read path, reads its hit full
blocks from storage into them (through this node's storage NIC); its tokens and salt are kept
for the request's ``Decode``, which does not repeat them. When the PE has filled the rest,
``Decode`` copies the buffer into the paged cache, frees the slots and joins the running
batch. A local ``Decode`` (conditional disaggregation: no PE ran) takes the leading hit
blocks its device KV still held at the ``AllocBuffer`` (referenced since), copies the rest of
the hit in and joins the batch with the rest of its prompt still to prefill, in the decode
steps' token budget; this engine then samples and streams the first token too. Every full block the
sequence completes beyond what storage already holds — the prompt tail and generated tokens — is
gathered into a staging slot and written to storage; a trailing partial block is not stored (the
next turn recomputes it). A gather holds a reference on its device block until it has read it,
so the block is never handed to another request first, even when the capped NIC runs the copy
long after the sequence ended. The buffer's reads and the persistence are
``decode_storage.py``'s ``DecodeStorage``, which ``DecodeWorker`` mixes in.

Nothing here fails for lack of room: an ``AllocBuffer`` that finds no contiguous run, or a
``Decode`` that finds no free KV blocks, waits (FIFO) until earlier requests free theirs; a block
that finds no free staging slot is saved at a later step, or dropped and counted if its sequence
ended. ``abort`` drops a request in any phase; slots a storage read still fills are freed only
when that read ends, and a buffer a PE may still write into (``fenced``) only when the router
says its writer stopped (``Unfence``).
"""

from __future__ import annotations

import logging
import queue
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace

from dualpath.engine.decode_storage import ActiveRequest, DecodeStorage
from dualpath.engine.futures import all_of
from dualpath.engine.llm_engine import LLMEngine
from dualpath.engine.prompt_buffers import PromptBuffers
from dualpath.errors import OutOfBlocksError
from dualpath.kv.host_pool import HostPool
from dualpath.kv.runs import paired_runs
from dualpath.protocol import (
    Abort,
    Aborted,
    AllocBuffer,
    Decode,
    Failed,
    Finished,
    Message,
    Tokens,
    Unfence,
)
from dualpath.request import Sequence
from dualpath.storage.client import StorageClient
from dualpath.storage.warm import WarmTag, warm_tag
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
    warm: WarmTag | None = None  # its AllocBuffer's session (its stored blocks stay warm)
    aborted: bool = False


class DecodeWorker(DecodeStorage):
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
        self.buffers = PromptBuffers(host_pool, storage, engine.layout, engine.key_space,
                                     self._read_io_done)
        self._pending_decodes: deque[Decode] = deque()  # waiting for device KV blocks
        # a local request's leading hit blocks this engine's prefix cache still held at its
        # AllocBuffer (referenced: never handed out meanwhile), req_id -> block ids
        self._cached: dict[int, list[int]] = {}
        self.num_cached_hit_blocks = 0  # hit blocks local prefills took from the device KV
        self._copying: list[_CopyIn] = []  # prompt KV moving buffer -> cache (async, paced)
        self._active: dict[int, ActiveRequest] = {}  # seq_id -> request
        self._events: queue.Queue[tuple[str, object]] = queue.Queue()
        self._staging_in_use = 0
        # finished requests whose last blocks are still being written: their Finished waits,
        # so that an agent's next turn, sent the moment this one returns, finds its context;
        # req_id -> (request, answer, since)
        self._finishing: dict[int, tuple[ActiveRequest, Finished, float]] = {}
        # a write that hangs must not hold the answer: past this, it goes without the write
        self.finish_wait_s = FINISH_WAIT_S
        self.num_finish_waits_cut = 0
        self.num_saved_blocks = 0
        self.num_saves_dropped = 0  # full blocks not persisted (no staging room, or a failure)
        self.num_waits = 0  # decodes that had to wait for device blocks
        self.num_steps = 0
        self.step_s_total = 0.0  # wall time of decode steps, the step hook included
        # Called inside each step with its token count, e.g. the EP traffic generator's
        # exchange (the step waits for it, as MoE dispatch/combine would).
        self.on_step: Callable[[int], None] = lambda num_tokens: None
        self.abandon: Callable[[], bool] = lambda: False  # a decode step is short: not polled
        self.name = ""

    def handle(self, msg: Message) -> list[Message]:
        """A request message from the router: ``AllocBuffer``, ``Decode``, ``Abort`` or
        ``Unfence``; returns the answers."""
        if isinstance(msg, AllocBuffer):
            out = self.buffers.alloc_buffer(self._take_cached(msg))
            if any(isinstance(m, Failed) for m in out):  # refused: it holds nothing
                self.engine.pool.free(self._cached.pop(msg.req_id, []))
            return out
        if isinstance(msg, Decode):
            return self.start_decode(msg)
        if isinstance(msg, Abort):
            return self.abort(msg.req_id, msg.fenced)
        if isinstance(msg, Unfence):
            return self.buffers.unfence(msg)
        raise ValueError(f"a decode engine cannot handle {msg.type!r}")

    def liveness(self) -> tuple[float, float]:
        """When a layer of a step last finished, and how long the one under way should take."""
        clock = self.engine.runner.clock
        return clock.progress_s, clock.budget_s()

    @property
    def read_queue_tokens(self) -> int:
        """The storage client's unfinished reads."""
        return self.storage.read_queue_tokens

    def close(self) -> None:
        """Nothing of its own to stop: the storage client and traffic manager are the
        process's."""

    def settled(self) -> bool:
        """A decode engine writes into no other engine's memory (its EP traffic lands in the
        peers' own EP buffers only)."""
        return True

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
                "num_cached_hit_blocks": self.num_cached_hit_blocks,
                "num_saves_dropped": self.num_saves_dropped,
                "num_finish_waits_cut": self.num_finish_waits_cut,
                "num_waits": self.num_waits + self.buffers.num_waits,
                "num_steps": self.num_steps, "step_s_total": self.step_s_total}

    def abort(self, req_id: int, fenced: bool = False) -> list[Message]:
        """Drop a request in any phase and free what it holds — its prompt buffer only once
        the router unfences it when a PE may still be writing into it (``fenced``); answers
        ``Aborted``."""
        self._pending_decodes = deque(m for m in self._pending_decodes if m.req_id != req_id)
        self.buffers.drop(req_id, fenced)
        self.engine.pool.free(self._cached.pop(req_id, []))
        for seq_id, active in list(self._active.items()):
            if active.req_id == req_id:
                self.engine.abort(active.seq)
                del self._active[seq_id]
        self._finishing.pop(req_id, None)  # its writes still end; nobody waits for them
        for copy in self._copying:
            if copy.msg.req_id == req_id:
                copy.aborted = True  # its slots and blocks are freed when the copies end
        return [Aborted(req_id), *self.buffers.start_allocs()]

    def held_requests(self) -> tuple[int, ...]:
        """Req ids this engine holds in any phase."""
        ids = self.buffers.held() | {m.req_id for m in self._pending_decodes}
        ids |= {a.req_id for a in self._active.values()} | set(self._finishing)
        ids |= {c.msg.req_id for c in self._copying if not c.aborted}
        return tuple(sorted(ids - self.buffers.orphans))

    def fenced_requests(self) -> tuple[int, ...]:
        """Req ids whose buffer is fenced (``PromptBuffers``)."""
        return self.buffers.fenced_requests()

    # -- decode ---------------------------------------------------------------------------------
    def _take_cached(self, msg: AllocBuffer) -> AllocBuffer:
        """A local request's allocation: the leading hit blocks the device KV still holds
        are taken (referenced) now and not read; the buffer reads the rest."""
        if not msg.local or msg.req_id in self._cached:
            return msg
        blocks = self.engine.cached_prefix(msg.prompt_ids, msg.num_read_blocks, msg.cache_salt)
        if not blocks:
            return msg
        self._cached[msg.req_id] = blocks
        return replace(msg, read_from_block=len(blocks))

    def start_decode(self, msg: Decode) -> list[Message]:
        """Move the assembled prompt KV into the cache and start decoding (or wait for room)."""
        alloc = self.buffers.allocs.get(msg.req_id)  # gone with its buffer (or when aborted)
        if alloc is None:
            return [Failed(msg.req_id, "no prompt buffer for this request")]
        if not 0 <= msg.num_prior_outputs < len(alloc.prompt_ids):
            return [Failed(msg.req_id, f"{msg.num_prior_outputs} prior outputs of "
                                       f"{len(alloc.prompt_ids)} tokens")]
        if msg.local and (msg.num_prior_outputs or msg.oracle or msg.num_stored_blocks
                          * self.block_size >= len(alloc.prompt_ids)):
            return [Failed(msg.req_id, f"a local prefill of {len(alloc.prompt_ids)} tokens "
                                       f"from {msg.num_stored_blocks} stored blocks")]
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
            alloc = self.buffers.allocs[msg.req_id]
            tokens = alloc.prompt_ids
            num_prompt = len(tokens) - msg.num_prior_outputs  # the rest: moved outputs
            cached = self._cached.get(msg.req_id, [])[: msg.num_stored_blocks]
            try:
                seq = self.engine.reserve_prefilled(list(tokens[:num_prompt]), msg.params,
                                                    list(tokens[num_prompt:]), alloc.cache_salt,
                                                    cached)
            except OutOfBlocksError:
                break  # running sequences free blocks as they finish
            self._pending_decodes.popleft()
            self.engine.pool.free(self._cached.pop(msg.req_id, [])[len(cached):])  # unused
            self.num_cached_hit_blocks += len(cached)
            log.info("request %d: decode started (%d prompt tokens)", msg.req_id, len(tokens))
            _, slots = self.buffers.take(msg.req_id)
            num_loaded = msg.num_stored_blocks if msg.local else len(slots)  # the rest: empty
            copies = all_of(self._copy_in(slots, seq.block_table, len(cached), num_loaded)
                            if num_loaded > len(cached) and not msg.oracle else [])
            self._copying.append(_CopyIn(msg, seq, slots, copies,
                                         warm_tag(alloc.warm_session, alloc.warm_lease_s)))
        return self._end_copies()

    def _copy_in(self, slots: list[int], table: list[int], first: int,
                 end: int) -> list[Future[None]]:
        """The buffer's blocks ``[first, end)`` -> the same blocks of ``table`` in the device
        cache, in one submission, on the NIC's KV-load lane: a copy per run of consecutive
        cache blocks (``kv/runs.py``). The buffer is layer-major over all its ``slots``, so
        its view takes them all."""
        data = self.engine.runner.cache.data
        layer_major = self.buffers.layer_major(slots).view(data.dtype)
        layer_major = layer_major.view(data.shape[0], len(slots), *data.shape[2:])
        pairs = [(data[:, block : block + n], layer_major[:, b : b + n])
                 for block, b, n in paired_runs(table[first:end], range(first, end))]
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
            if copy.msg.local:  # the batcher prefills the rest; this engine streams it all
                self.engine.start_partly_prefilled(seq, copy.msg.num_stored_blocks
                                                   * self.block_size)
                num_streamed = 0
            else:
                self.engine.start_prefilled(seq, copy.msg.first_token)
                # the router streamed the PE's first token itself, except for a moved stream:
                # then this engine streams from it on (or drops it, see ``start_prefilled``)
                num_streamed = copy.msg.num_prior_outputs or 1
            self._active[seq.seq_id] = ActiveRequest(req_id, seq, copy.msg.num_stored_blocks,
                                                     persist=not copy.msg.oracle,
                                                     num_streamed=num_streamed, warm=copy.warm)
            out.extend(self._after_step([seq] if seq.is_finished else []))
        return out + self.buffers.start_allocs()

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

    # -- completions from storage threads --------------------------------------------------------
    def drain_events(self) -> list[Message]:
        """Handle finished storage reads and writes; returns messages to send."""
        out: list[Message] = self._end_copies() + self._overdue_finishes()
        while True:
            try:
                kind, payload = self._events.get_nowait()
            except queue.Empty:
                return out
            if kind == "read":
                req_id, first, future = payload  # type: ignore[misc]
                out.extend(self.buffers.read_done(req_id, first, future))
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
                out.extend(self.buffers.start_allocs())
