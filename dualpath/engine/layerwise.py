"""Layerwise KV movement on the prefill engine, hung on the model's layer hooks.

Before layer i the hit KV of layer i is made resident in the PE's paged cache — copied from
the PE host buffer (PE read path) or pulled from the DE host buffer over the compute network
(DE read path) — and layer i+1 is fetched ahead so the load overlaps compute. After layer i
the layer's KV goes to the DE buffer: every block on the PE path (hit + miss), only the miss
blocks on the DE path. Modes: ``basic`` loads all layers before the forward and sends them all
after it; ``oracle`` moves nothing (an upper bound for timing; its tokens are meaningless).

Addresses: the paged cache ``[layers, blocks, tokens, 2, kv_heads, head_dim]`` holds layer i of
block b at ``base + (i × num_blocks + b) × layer_block_bytes``, and the DE buffer of a request
holds layer i of prompt block b at ``buffer + (i × n + b) × layer_block_bytes``. The PE uses
cache blocks 0..n-1 for a request, so on both sides a layer of a request is contiguous and the
traffic manager coalesces its layer blocks into one segment on the wire. A PE host slot holds a
full block ``[layers, tokens, bytes]`` (the storage layout).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import torch

from dualpath.engine.traffic import TrafficManager
from dualpath.kv.cache import PagedKVCache
from dualpath.kv.host_pool import HostPool
from dualpath.model.hooks import LayerHooks
from dualpath.transfer.lanes import Lane


@dataclass(frozen=True)
class LayerPlan:
    """Where one request's KV blocks live during its prefill."""

    pe_blocks: list[int]  # PE paged-cache block of each prompt block
    num_hit_blocks: int
    read_path: str  # "pe" | "de"
    mode: str  # basic | layerwise | oracle
    de_endpoint: str
    de_buffer_addr: int  # the DE's layer-major buffer of this request
    pe_slots: list[int]  # PE host-pool slots holding the hit blocks (PE read path)
    load_hit: bool = True  # this forward loads the hit KV (the request's first chunk)
    forward_from: int | None = None  # first prompt block sent after each layer (None: default)
    forward_to: int | None = None  # one past the last (None: every prompt block)

    def forward_range(self) -> range:
        """Prompt blocks whose KV this forward sends to the DE buffer.

        By default: every block on the PE path (hit + miss), only the miss blocks on the DE
        path (the DE already holds the hit blocks it read).
        """
        default_from = self.num_hit_blocks if self.read_path == "de" else 0
        start = default_from if self.forward_from is None else self.forward_from
        stop = len(self.pe_blocks) if self.forward_to is None else self.forward_to
        return range(start, stop)

    def de_layer_block(self, layer_idx: int, block: int, layer_block_bytes: int) -> int:
        """Address of layer ``layer_idx`` of prompt block ``block`` in the DE buffer."""
        return self.de_buffer_addr + (layer_idx * len(self.pe_blocks) + block) * layer_block_bytes


class CacheAddresses:
    """Byte addresses of layer blocks in a paged cache."""

    def __init__(self, cache: PagedKVCache) -> None:
        self.base = cache.data.data_ptr()
        self.num_blocks = cache.num_blocks
        self.layer_block_bytes = cache.data[0, 0].numel() * cache.data.element_size()

    def layer_block(self, layer_idx: int, block: int) -> int:
        """Address of layer ``layer_idx`` of cache block ``block``."""
        return self.base + (layer_idx * self.num_blocks + block) * self.layer_block_bytes


class PrefillHooks(LayerHooks):
    """Loads hit KV before each layer and forwards KV to the DE after it."""

    def __init__(self, plan: LayerPlan, cache: PagedKVCache, traffic: TrafficManager,
                 host_pool: HostPool | None = None) -> None:
        self.plan = plan
        self.cache = cache
        self.traffic = traffic
        self.addrs = CacheAddresses(cache)
        self.num_layers = cache.data.shape[0]
        self.lb = self.addrs.layer_block_bytes
        self.host_pool = host_pool
        self._loads: dict[int, Future[None] | None] = {}
        self._sends: list[Future[None]] = []

    # -- hooks --------------------------------------------------------------------------------
    def before_layer(self, layer_idx: int) -> None:
        plan = self.plan
        if plan.mode == "oracle" or plan.num_hit_blocks == 0 or not plan.load_hit:
            return
        if self.plan.mode == "basic":
            if layer_idx == 0:
                for i in range(self.num_layers):
                    self._wait(self._start_load(i))
            return
        if layer_idx == 0:
            self._loads[0] = self._start_load(0)
        if layer_idx + 1 < self.num_layers:
            self._loads[layer_idx + 1] = self._start_load(layer_idx + 1)  # prefetch
        self._wait(self._loads.pop(layer_idx))

    def after_layer(self, layer_idx: int) -> None:
        if self.plan.mode == "layerwise" and self.plan.forward_range():
            self._sends.append(self._start_forward(layer_idx))

    def finish(self) -> None:
        if self.plan.mode == "basic" and self.plan.forward_range():
            self._sends.extend(self._start_forward(i) for i in range(self.num_layers))
        for future in self._sends:
            future.result()
        self._sends.clear()

    # -- moves --------------------------------------------------------------------------------
    def _start_load(self, layer_idx: int) -> Future[None] | None:
        plan = self.plan
        hit = range(plan.num_hit_blocks)
        if plan.read_path == "de":
            segments = [(self.addrs.layer_block(layer_idx, plan.pe_blocks[j]),
                         plan.de_layer_block(layer_idx, j, self.lb), self.lb) for j in hit]
            return self.traffic.submit("read", plan.de_endpoint, segments, Lane.KV_LOAD)
        for j in hit:  # PE read path: host buffer -> device cache (H2D)
            self.traffic.copy(self._cache_view(layer_idx, plan.pe_blocks[j]),
                              self._host_view(plan.pe_slots[j], layer_idx), Lane.KV_LOAD)
        return None

    def _start_forward(self, layer_idx: int) -> Future[None]:
        plan = self.plan
        blocks = plan.forward_range()
        segments = [(self.addrs.layer_block(layer_idx, plan.pe_blocks[j]),
                     plan.de_layer_block(layer_idx, j, self.lb), self.lb) for j in blocks]
        return self.traffic.submit("write", plan.de_endpoint, segments, Lane.KV_FORWARD)

    def _cache_view(self, layer_idx: int, block: int) -> torch.Tensor:
        return self.cache.data[layer_idx, block].view(-1).view(torch.uint8)

    def _host_view(self, slot: int, layer_idx: int) -> torch.Tensor:
        assert self.host_pool is not None
        return self.host_pool.tensor(slot)[layer_idx * self.lb : (layer_idx + 1) * self.lb]

    @staticmethod
    def _wait(future: Future[None] | None) -> None:
        if future is not None:
            future.result()

