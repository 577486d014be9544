"""The decode engine (DE): the host buffer where prompt KV is assembled, decoding, persistence.

``AllocBuffer`` takes host slots for a prompt and, on the DE read path, reads its hit full
blocks from storage into them (through this node's storage NIC). When the PE has filled the
rest, ``Decode`` copies the buffer into the paged cache, frees the slots and joins the running
batch. Every full block the sequence completes beyond what storage already holds — the prompt
tail and generated tokens — is gathered into a staging slot and written to storage; a trailing
partial block is not stored (the next turn recomputes it).
"""

from __future__ import annotations

import queue
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from dualpath.engine.llm_engine import LLMEngine
from dualpath.engine.traffic import TrafficManager
from dualpath.kv.hashing import extend_block_hashes
from dualpath.kv.host_pool import HostPool
from dualpath.protocol import AllocBuffer, BufferReady, Decode, Finished, Message
from dualpath.request import SamplingParams, Sequence
from dualpath.storage.client import StorageClient
from dualpath.transfer.lanes import Lane


@dataclass
class _Active:
    req_id: int
    seq: Sequence
    num_saved_blocks: int  # leading blocks known to be in storage
    persist: bool = True  # oracle requests hold meaningless KV: never store it


class DecodeWorker:
    """Host buffer management, continuous-batching decode and KV persistence."""

    def __init__(self, engine: LLMEngine, host_pool: HostPool, traffic: TrafficManager,
                 storage: StorageClient) -> None:
        self.engine = engine
        self.host_pool = host_pool
        self.traffic = traffic
        self.storage = storage
        self.block_size = engine.config.block_size
        self.layout = engine.layout
        self._buffers: dict[int, list[int]] = {}  # req_id -> host slots
        self._active: dict[int, _Active] = {}  # seq_id -> request
        self._events: queue.Queue[tuple[str, object]] = queue.Queue()
        self.num_saved_blocks = 0

    # -- buffer ---------------------------------------------------------------------------------
    def alloc_buffer(self, msg: AllocBuffer) -> list[Message]:
        """Take a contiguous region; start the DE-path read if asked (reply when done).

        Storage holds full blocks, the buffer is layer-major: each block's file is scattered
        straight into its 30-odd layer slices by one vectored read.
        """
        slots = self.host_pool.alloc_run(msg.num_blocks)
        self._buffers[msg.req_id] = slots
        if msg.num_read_blocks == 0:
            return [self._ready(msg.req_id, 0)]
        keys = self.engine.key_space.keys(msg.prompt_ids)[: msg.num_read_blocks]
        layers = self._layer_major(slots)  # [layers, n, layer_block_bytes]
        parts = [list(layers[:, b].unbind(0)) for b in range(msg.num_read_blocks)]
        future = self.storage.submit_read(keys, parts)
        future.add_done_callback(lambda f, r=msg.req_id: self._events.put(("read", (r, f))))
        return []

    def release(self, req_id: int) -> None:
        """Free a request's slots (its prefill failed)."""
        self.host_pool.free(self._buffers.pop(req_id, []))

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
        """Move the assembled prompt KV into the cache and start decoding."""
        slots = self._buffers.pop(msg.req_id)
        params = SamplingParams(max_tokens=msg.max_tokens, temperature=msg.temperature,
                                top_p=msg.top_p, seed=msg.seed, ignore_eos=msg.ignore_eos,
                                stop=tuple(msg.stop))
        fill = (lambda table: None) if msg.oracle else (lambda table: self._copy_in(slots, table))
        try:
            seq = self.engine.add_prefilled(list(msg.prompt_ids), msg.first_token, params, fill)
        finally:
            self.host_pool.free(slots)
        self._active[seq.seq_id] = _Active(msg.req_id, seq, msg.num_stored_blocks,
                                           persist=not msg.oracle)
        return self._after_step([seq] if seq.is_finished else [])

    def _copy_in(self, slots: list[int], table: list[int]) -> None:
        data = self.engine.runner.cache.data
        layer_major = self._layer_major(slots).view(data.dtype)
        layer_major = layer_major.view(data.shape[0], len(slots), *data.shape[2:])
        for b, block in enumerate(table[: len(slots)]):  # the table has room to grow
            self.traffic.copy(data[:, block], layer_major[:, b], Lane.KV_LOAD)  # host -> device

    @property
    def has_work(self) -> bool:
        """True while sequences decode."""
        return self.engine.has_unfinished

    def step(self) -> list[Message]:
        """One decode step of every running sequence; returns Finished messages."""
        return self._after_step(self.engine.step())

    def _after_step(self, finished: list[Sequence]) -> list[Message]:
        for active in list(self._active.values()):
            if active.persist:
                self._save_new_blocks(active)
        out: list[Message] = []
        for seq in finished:
            active = self._active.pop(seq.seq_id)
            out.append(Finished(active.req_id, tuple(seq.output_ids), seq.finish_reason or ""))
        return out

    # -- persistence ----------------------------------------------------------------------------
    def _save_new_blocks(self, active: _Active) -> None:
        """Write each newly completed full block (still in the cache: blocks of a sequence
        finished in this step are reused only by a later step)."""
        seq = active.seq
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= active.num_saved_blocks:
            return
        space = self.engine.key_space
        hashes = extend_block_hashes(seq.block_hashes, seq.token_ids[: num_full * self.block_size],
                                     self.block_size, space.seed)
        for k in range(active.num_saved_blocks, num_full):
            slot = self.host_pool.alloc(1)[0]
            self._gather(seq.block_table[k], slot)
            key = space.key(hashes[k], hashes[k - 1] if k else None)
            future = self.storage.submit_write([key], [self.host_pool.buffer(slot)])
            future.add_done_callback(lambda f, s=slot: self._events.put(("saved", (s, f))))
        active.num_saved_blocks = num_full

    def _gather(self, block: int, slot: int) -> None:
        data = self.engine.runner.cache.data
        dst = self.host_pool.tensor(slot).view(data.dtype).view(data.shape[0], *data.shape[2:])
        self.traffic.copy(dst, data[:, block], Lane.KV_SAVE)  # device -> host staging

    # -- completions from storage threads --------------------------------------------------------
    def drain_events(self) -> list[Message]:
        """Handle finished storage reads and writes; returns messages to send."""
        out: list[Message] = []
        while True:
            try:
                kind, payload = self._events.get_nowait()
            except queue.Empty:
                return out
            if kind == "read":
                req_id, future = payload  # type: ignore[misc]
                out.append(self._read_done(req_id, future))
            else:
                slot, future = payload  # type: ignore[misc]
                self.host_pool.free([slot])
                if future.exception() is None and all(future.result()):
                    self.num_saved_blocks += 1

    def _read_done(self, req_id: int, future: Future[list[bool]]) -> BufferReady:
        ok = future.result() if future.exception() is None else []
        loaded = next((i for i, good in enumerate(ok) if not good), len(ok))
        return self._ready(req_id, loaded)


