"""Layerwise KV movement on the prefill engine, hung on the model's layer hooks.

Before layer i computes, its context KV is resident in the PE's device cache: the hit blocks
copied from the PE host buffer (PE read path) or pulled from the DE host buffer over the compute
network (DE read path), and, for a later chunk of a chunked prompt, the blocks earlier chunks
already sent to the DE buffer. After layer i its new KV goes to the DE buffer: every block on
the PE path (hit + miss), only the miss blocks on the DE path. A split read (DESIGN §9) loads
the leading hit blocks from the PE host buffer and the rest from the DE buffer, and forwards
the PE-read blocks plus the miss blocks.

**Overlap.** Every move is asynchronous, through the traffic manager's lanes: while layer i
computes, the loads of layers i+1 .. i+W-1 (as many as the window has slots for) and layer
i-1's send are in flight (on a CPU engine the traffic manager's dispatcher threads do the
copies; on CUDA a copy stream with events).

**Device-memory window.** A layerwise PE keeps only W layers of a forward's KV resident
(``PagedKVCache`` with a layer window, default W = 2: the layer computing and the one loading);
layer i lives in slot ``i mod W``. Layer j's load — and, with nothing to load, its compute —
waits until layer j-W, the slot's previous tenant, has left for the DE. ``basic`` keeps every
layer resident (the paper's baseline): it loads all layers before the forward and sends them
all after it. ``oracle`` moves nothing (an upper bound for timing; its tokens are meaningless).

Addresses: the paged cache ``[slots, blocks, tokens, 2, kv_heads, head_dim]`` holds layer i of
block b at ``base + (slot(i) × num_blocks + b) × layer_block_bytes``, and the DE buffer of a
request holds layer i of prompt block b at ``buffer + (i × n + b) × layer_block_bytes``. The PE
uses contiguous cache blocks for a request, so on both sides a layer of a request is contiguous
and the traffic manager coalesces its layer blocks into one segment on the wire. A PE host slot
holds a full block ``[layers, tokens, bytes]`` (the storage layout).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, wait
from dataclasses import dataclass

import torch

from dualpath.engine.futures import all_of
from dualpath.engine.traffic import TrafficManager
from dualpath.kv.cache import PagedKVCache
from dualpath.kv.host_pool import HostPool
from dualpath.model.hooks import LayerHooks
from dualpath.transfer.lanes import Lane


@dataclass(frozen=True)
class LayerPlan:
    """Where one request's KV blocks live during one prefill forward."""

    pe_blocks: list[int]  # PE paged-cache block of each prompt block
    num_hit_blocks: int
    read_path: str  # "pe" | "de" | "split"
    mode: str  # basic | layerwise | oracle
    de_endpoint: str
    de_buffer_addr: int  # the DE's layer-major buffer of this request
    pe_slots: list[int]  # PE host-pool slots holding the PE-read hit blocks
    load_hit: bool = True  # this forward loads the hit KV (the request's first chunk)
    forward_from: int | None = None  # first prompt block sent after each layer (None: default)
    forward_to: int | None = None  # one past the last (None: every prompt block)
    reload_blocks: int = 0  # a later chunk under a window: leading blocks to pull from the DE
    num_pe_read_blocks: int | None = None  # split read: leading hit blocks the PE read

    @property
    def pe_read_blocks(self) -> int:
        """Leading hit blocks that sit in this PE's host buffer."""
        if self.read_path == "split":
            return min(self.num_pe_read_blocks or 0, self.num_hit_blocks)
        return self.num_hit_blocks if self.read_path == "pe" else 0

    def host_loads(self) -> range:
        """Prompt blocks loaded from the PE host buffer before each layer."""
        return range(self.pe_read_blocks if self.load_hit else 0)

    def de_loads(self) -> range:
        """Prompt blocks pulled from the DE buffer before each layer."""
        if not self.load_hit:
            return range(self.reload_blocks)
        return range(self.pe_read_blocks, self.num_hit_blocks)

    def forward_blocks(self) -> list[int]:
        """Prompt blocks whose KV this forward sends to the DE buffer after each layer.

        By default every block the DE does not hold yet: the PE-read hit blocks and the miss
        blocks (the DE read the rest itself). A later chunk sends its own blocks.
        """
        stop = len(self.pe_blocks) if self.forward_to is None else self.forward_to
        if self.forward_from is not None:
            return list(range(self.forward_from, stop))
        return [*range(self.pe_read_blocks), *range(self.num_hit_blocks, stop)]

    def de_layer_block(self, layer_idx: int, block: int, layer_block_bytes: int) -> int:
        """Address of layer ``layer_idx`` of prompt block ``block`` in the DE buffer."""
        return self.de_buffer_addr + (layer_idx * len(self.pe_blocks) + block) * layer_block_bytes


class CacheAddresses:
    """Byte addresses of layer blocks in a paged cache (with or without a layer window)."""

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache
        self.base = cache.data.data_ptr()
        self.num_blocks = cache.num_blocks
        self.layer_block_bytes = cache.data[0, 0].numel() * cache.data.element_size()

    def layer_block(self, layer_idx: int, block: int) -> int:
        """Address of layer ``layer_idx`` of cache block ``block``."""
        slot = self.cache.layer_slot(layer_idx)
        return self.base + (slot * self.num_blocks + block) * self.layer_block_bytes


class PrefillHooks(LayerHooks):
    """Loads each layer's context KV ahead of it and forwards its new KV after it."""

    def __init__(self, plan: LayerPlan, cache: PagedKVCache, traffic: TrafficManager,
                 host_pool: HostPool | None = None) -> None:
        if plan.mode == "basic" and cache.is_window:
            raise ValueError("basic prefill keeps every layer resident; this cache holds a "
                             f"window of {cache.resident_layers} layers")
        self.plan = plan
        self.cache = cache
        self.traffic = traffic
        self.addrs = CacheAddresses(cache)
        self.num_layers = cache.num_layers
        self.window = cache.resident_layers
        self.lb = self.addrs.layer_block_bytes
        self.host_pool = host_pool
        self._loads: dict[int, Future[None]] = {}
        self._sends: dict[int, Future[None]] = {}
        self._moves = plan.mode != "oracle"
        self._has_loads = self._moves and bool(plan.host_loads() or plan.de_loads())
        self._on_cuda = cache.data.is_cuda
        self.wait_s = 0.0  # the forward's time blocked on this request's loads and sends

    # -- hooks --------------------------------------------------------------------------------
    def before_layer(self, layer_idx: int) -> None:
        if self.plan.mode == "basic":
            if layer_idx == 0 and self._has_loads:
                for future in [self._start_load(i) for i in range(self.num_layers)]:
                    self._wait(future)
            return
        if self._has_loads:
            # prefetch: every later layer the window has a slot for loads while this one
            # computes (a slot's load starts once its tenant's send has left)
            for ahead in range(layer_idx, min(layer_idx + self.window, self.num_layers)):
                if ahead not in self._loads:
                    self._loads[ahead] = self._start_load(ahead)
            self._wait(self._loads.pop(layer_idx))
        self._wait_slot_free(layer_idx)  # the compute writes into the slot

    def after_layer(self, layer_idx: int) -> None:
        if self.plan.mode != "basic" and self._moves and self.plan.forward_blocks():
            self._sync_device()
            self._sends[layer_idx] = self._start_forward(layer_idx)

    def finish(self) -> None:
        if self.plan.mode == "basic" and self._moves and self.plan.forward_blocks():
            self._sync_device()
            for i in range(self.num_layers):
                self._sends[i] = self._start_forward(i)
        errors = []
        for future in self._sends.values():
            if (exc := self._wait(future, raises=False)) is not None:
                errors.append(exc)
        self._sends.clear()
        if errors:
            raise errors[0]

    def settle(self) -> None:
        """After a failed forward: wait until no load or send of it can still touch the cache
        (their errors are the caller's business already)."""
        wait([*self._loads.values(), *self._sends.values()])
        self._loads.clear()
        self._sends.clear()

    # -- moves --------------------------------------------------------------------------------
    def _slot_tenant(self, layer_idx: int) -> Future[None] | None:
        """The send of the layer that held ``layer_idx``'s slot before it (None: no wait)."""
        return self._sends.get(layer_idx - self.window)

    def _wait_slot_free(self, layer_idx: int) -> None:
        tenant = self._slot_tenant(layer_idx)
        if tenant is not None:
            self._wait(tenant)

    def _wait(self, future: Future[None], raises: bool = True) -> BaseException | None:
        """Block until ``future`` settles, counting the time in ``wait_s``; its error raised
        (``raises``) or returned."""
        if not future.done():
            started_s = time.perf_counter()
            wait([future])
            self.wait_s += time.perf_counter() - started_s
        if raises:
            future.result()
        return future.exception()

    def _start_load(self, layer_idx: int) -> Future[None]:
        """Layer ``layer_idx``'s context KV into its slot, once the slot's tenant has left."""
        plan, after = self.plan, self._slot_tenant(layer_idx)
        futures = []
        host = plan.host_loads()
        if host:  # PE host buffer -> device (CNIC-assisted copies, one submission a layer)
            assert self.host_pool is not None
            pairs = [(self._cache_view(layer_idx, plan.pe_blocks[j]),
                      self._host_view(plan.pe_slots[j], layer_idx)) for j in host]
            futures.append(self.traffic.submit_copies(pairs, Lane.KV_LOAD, "h2d", after=after))
        remote = plan.de_loads()
        if remote:  # DE host buffer -> device over the compute network
            segments = [(self.addrs.layer_block(layer_idx, plan.pe_blocks[j]),
                         plan.de_layer_block(layer_idx, j, self.lb), self.lb) for j in remote]
            futures.append(self.traffic.submit("read", plan.de_endpoint, segments,
                                               Lane.KV_LOAD, after=after))
        return futures[0] if len(futures) == 1 else all_of(futures)

    def _start_forward(self, layer_idx: int) -> Future[None]:
        plan = self.plan
        segments = [(self.addrs.layer_block(layer_idx, plan.pe_blocks[j]),
                     plan.de_layer_block(layer_idx, j, self.lb), self.lb)
                    for j in plan.forward_blocks()]
        return self.traffic.submit("write", plan.de_endpoint, segments, Lane.KV_FORWARD)

    def _cache_view(self, layer_idx: int, block: int) -> torch.Tensor:
        return self.cache.layer(layer_idx)[block].view(-1).view(torch.uint8)

    def _host_view(self, slot: int, layer_idx: int) -> torch.Tensor:
        assert self.host_pool is not None
        return self.host_pool.tensor(slot)[layer_idx * self.lb : (layer_idx + 1) * self.lb]

    def _sync_device(self) -> None:
        """On CUDA, the layer's KV must be written before a send reads it."""
        if self._on_cuda:
            torch.cuda.current_stream(self.cache.data.device).synchronize()

