"""Layerwise KV movement on the prefill engine, hung on the model's layer hooks.

Before layer i computes, its context KV is resident in the PE's device cache: the hit blocks
copied from the PE host buffer (PE read path) or pulled from the DE host buffer over the compute
network (DE read path), and, for a later chunk of a chunked prompt, the blocks earlier chunks
already sent to the DE buffer. After layer i its new KV goes to the DE buffer: every block on
the PE path (hit + miss), only the miss blocks on the DE path. A split read (docs/design.md §9)
loads the leading hit blocks from the PE host buffer and the rest from the DE buffer, and forwards
the PE-read blocks plus the miss blocks.

**Overlap.** Every move is asynchronous, through the traffic manager's lanes: while layer i
computes, the loads of layers i+1 .. i+W-1 (as many as the window has slots for) and layer
i-1's send are in flight (on a CPU engine the traffic manager's dispatcher threads do the
copies; on CUDA a copy stream with events, and the compute stream is never synchronized: see
``PrefillHooks``).

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
from typing import Any

import torch

from dualpath.engine.cuda_events import EventWatcher, shared_watcher, stream_wait
from dualpath.engine.futures import all_of
from dualpath.kv.block_plan import BlockPlan
from dualpath.kv.cache import PagedKVCache
from dualpath.kv.host_pool import HostPool
from dualpath.kv.layer_groups import group_of, layers_per_move
from dualpath.kv.layout import buffer_offset
from dualpath.kv.runs import paired_runs
from dualpath.model.hooks import LayerHooks
from dualpath.traffic.copies import CopyIssue
from dualpath.traffic.lanes import Lane
from dualpath.traffic.manager import TrafficManager
from dualpath.vocab import PrefillMode, ReadPath


@dataclass(frozen=True)
class LayerPlan:
    """Where one request's KV blocks live during one prefill forward."""

    pe_blocks: list[int]  # PE paged-cache block of each prompt block
    num_hit_blocks: int
    read_path: ReadPath  # pe | de | split
    mode: PrefillMode
    de_endpoint: str
    de_buffer_addr: int  # the DE's layer-major buffer of this request
    pe_slots: list[int]  # PE host-pool slots holding the PE-read hit blocks
    load_hit: bool = True  # this forward loads the hit KV (the request's first chunk)
    forward_from: int | None = None  # first prompt block sent after each layer (None: default)
    forward_to: int | None = None  # one past the last (None: every prompt block)
    reload_blocks: int = 0  # a later chunk under a window: leading blocks to pull from the DE
    num_pe_read_blocks: int | None = None  # split read: leading hit blocks the PE read

    @property
    def blocks(self) -> BlockPlan:
        """The request's loads, pulls and pushes by read path (``kv/block_plan.py``)."""
        return BlockPlan(self.read_path, self.num_hit_blocks, len(self.pe_blocks),
                         self.num_pe_read_blocks or 0)

    @property
    def pe_read_blocks(self) -> int:
        """Leading hit blocks that sit in this PE's host buffer."""
        return self.blocks.num_load_blocks

    def host_loads(self) -> range:
        """Prompt blocks loaded from the PE host buffer before each layer."""
        return self.blocks.loads() if self.load_hit else range(0)

    def de_loads(self) -> range:
        """Prompt blocks pulled from the DE buffer before each layer."""
        return self.blocks.pulls() if self.load_hit else range(self.reload_blocks)

    def forward_blocks(self) -> list[int]:
        """Prompt blocks whose KV this forward sends to the DE buffer after each layer.

        By default every block the DE does not hold yet: the PE-read hit blocks and the miss
        blocks (the DE read the rest itself). A later chunk sends its own blocks.
        """
        if self.forward_from is not None:
            stop = len(self.pe_blocks) if self.forward_to is None else self.forward_to
            return list(range(self.forward_from, stop))
        return self.blocks.pushes(self.forward_to)

    def de_layer_block(self, layer_idx: int, block: int, layer_block_bytes: int) -> int:
        """Address of layer ``layer_idx`` of prompt block ``block`` in the DE buffer."""
        return self.de_buffer_addr + buffer_offset(layer_idx, block, len(self.pe_blocks),
                                                   layer_block_bytes)


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


@dataclass
class _Load:
    """One layer's loads: what the compute waits for, and when every byte has landed."""

    host: list[Future[None]]  # waited on the host before the layer (reads, CPU copies)
    issued: list[Future[list[Any]]]  # CUDA copies: their copy-stream events, once issued
    landed: Future[None]  # every byte is in the cache (the sources may be reused after)


class PrefillHooks(LayerHooks):
    """Loads each layer's context KV ahead of it and forwards its new KV after it.

    On CUDA nothing synchronizes the compute stream: the compute stream waits on the events of
    the host→device copies of a layer before computing it, and a layer's send chains on an
    event recorded after its compute (``cuda_events``), so the compute thread keeps launching
    later layers while earlier ones move. Reads over the compute network complete on the host
    (the transfer engine reports them there), so the compute thread waits for those before it
    launches the layer that needs them, and for a slot's previous tenant to have left.
    """

    def __init__(self, plan: LayerPlan, cache: PagedKVCache, traffic: TrafficManager,
                 host_pool: HostPool | None = None, watcher: EventWatcher | None = None,
                 stream_ordered: bool | None = None, group_bytes: int = 0) -> None:
        """``stream_ordered`` (default: the cache is on CUDA) runs the CUDA pipeline above;
        ``watcher`` turns compute events into futures (default: the device's shared one);
        ``group_bytes``: each load and forward carries consecutive layers up to that size
        where the window allows (``kv/layer_groups.py``; 0: one layer per move)."""
        if plan.mode == PrefillMode.BASIC and cache.is_window:
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
        self._loads: dict[int, _Load] = {}
        self._landed: list[Future[None]] = []
        self._sends: dict[int, Future[None]] = {}
        self._computed: dict[int, Future[None]] = {}  # CUDA: the device finished layer i
        self._moves = plan.mode != PrefillMode.ORACLE
        self._has_loads = self._moves and bool(plan.host_loads() or plan.de_loads())
        self._on_cuda = cache.data.is_cuda if stream_ordered is None else stream_ordered
        self._watcher = watcher if watcher is not None or not self._on_cuda \
            else shared_watcher(cache.data.device)
        layer_blocks = max(len(plan.host_loads()) + len(plan.de_loads()),
                           len(plan.forward_blocks()))
        self.group = layers_per_move(layer_blocks * self.lb, group_bytes, self.window,
                                     self.num_layers)  # layers per load and per forward
        self.wait_s = 0.0  # the forward's time blocked on this request's loads and sends
        self.num_stream_waits = 0  # CUDA: copy events the compute stream waited on

    # -- hooks --------------------------------------------------------------------------------
    def before_layer(self, layer_idx: int) -> None:
        if self.plan.mode == PrefillMode.BASIC:
            if layer_idx == 0 and self._has_loads:
                for load in [self._start_load(layers) for layers in self._groups()]:
                    self._await_load(load)
            return
        if self._has_loads:
            # prefetch: every later group the window has slots for loads while this layer
            # computes (a slot's load starts once its tenant's send has left)
            for ahead in range(layer_idx, min(layer_idx + self.window, self.num_layers)):
                layers = group_of(ahead, self.group, self.num_layers)
                if ahead in self._loads or layers.stop > layer_idx + self.window:
                    continue  # started already, or its last slot still holds this layer
                load = self._start_load(layers)
                self._loads.update(dict.fromkeys(layers, load))
            self._await_load(self._loads.pop(layer_idx))
        self._wait_slot_free(layer_idx)  # the compute writes into the slot

    def after_layer(self, layer_idx: int) -> None:
        if self.plan.mode == PrefillMode.BASIC or not self._moves:
            return
        computed = self._device_done()
        if computed is not None and self.cache.is_window:
            self._computed[layer_idx] = computed
        layers = group_of(layer_idx, self.group, self.num_layers)
        if self.plan.forward_blocks() and layer_idx == layers[-1]:  # the group's last layer
            self._sends.update(dict.fromkeys(layers, self._start_forward(layers, computed)))

    def finish(self) -> None:
        if self.plan.mode == PrefillMode.BASIC and self._moves and self.plan.forward_blocks():
            computed = self._device_done()
            for layers in self._groups():
                self._sends.update(dict.fromkeys(layers, self._start_forward(layers, computed)))
        errors = []
        for future in {id(f): f for f in [*self._sends.values(), *self._landed]}.values():
            if (exc := self._wait(future, raises=False)) is not None:
                errors.append(exc)
        self._sends.clear()
        self._landed.clear()
        self._computed.clear()
        if errors:
            raise errors[0]

    def settle(self) -> None:
        """After a failed forward: wait until no load or send of it can still touch the cache
        (their errors are the caller's business already)."""
        wait([*self._landed, *self._sends.values(), *self._computed.values()])
        self._loads.clear()
        self._landed.clear()
        self._sends.clear()
        self._computed.clear()

    # -- moves --------------------------------------------------------------------------------
    def _groups(self) -> list[range]:
        """Every layer, in the groups that move together."""
        return [group_of(i, self.group, self.num_layers)
                for i in range(0, self.num_layers, self.group)]

    def _group_tenants(self, layers: range) -> Future[None] | None:
        """What must settle before ``layers`` may take their slots (see ``_slot_tenant``)."""
        tenants = {id(f): f for i in layers if (f := self._slot_tenant(i)) is not None}
        if len(tenants) <= 1:
            return next(iter(tenants.values()), None)
        return all_of(list(tenants.values()))

    def _slot_tenant(self, layer_idx: int) -> Future[None] | None:
        """What must settle before ``layer_idx`` may take its slot: the send of the layer that
        held the slot before it, or on CUDA with nothing to send, that layer's compute."""
        tenant = layer_idx - self.window
        return self._sends.get(tenant) or self._computed.get(tenant)

    def _wait_slot_free(self, layer_idx: int) -> None:
        tenant = self._slot_tenant(layer_idx)
        if tenant is not None:
            self._wait(tenant)

    def _await_load(self, load: _Load) -> None:
        """Make ``load`` visible to the layer about to compute: host waits for what completes
        on the host, a device-side wait for what a copy stream will complete."""
        for future in load.host:
            self._wait(future)
        for issued in load.issued:
            events = self._wait(issued)
            self.num_stream_waits += stream_wait(events, self._compute_stream())

    def _wait(self, future: Future[Any], raises: bool = True) -> Any:
        """Block until ``future`` settles, counting the time in ``wait_s``; its result (or,
        not ``raises``, its error)."""
        if not future.done():
            started_s = time.perf_counter()
            wait([future])
            self.wait_s += time.perf_counter() - started_s
        if not raises:
            return future.exception()
        return future.result()

    def _device_done(self) -> Future[None] | None:
        """On CUDA, a future that completes once the device has run everything launched so
        far (an event on the compute stream); None on a CPU, where that is already so."""
        if not self._on_cuda:
            return None
        event = torch.cuda.Event()
        event.record(self._compute_stream())
        assert self._watcher is not None
        return self._watcher.watch(event)

    def _compute_stream(self) -> Any:
        return torch.cuda.current_stream(self.cache.data.device)

    def _start_load(self, layers: range) -> _Load:
        """The context KV of ``layers`` into their slots, once the slots' tenants have left:
        one submission per source for the whole group."""
        plan, after = self.plan, self._group_tenants(layers)
        load_host: list[Future[None]] = []
        issued: list[Future[list[Any]]] = []
        landed: list[Future[None]] = []
        host = plan.host_loads()
        if host:  # PE host buffer -> device (CNIC-assisted copies, one submission a group)
            assert self.host_pool is not None
            pairs = [pair for i in layers for pair in self._host_pairs(i, host)]
            if self._on_cuda:  # the compute stream waits for the copy stream's events
                issue = CopyIssue()
                copied = self.traffic.submit_copies(pairs, Lane.KV_LOAD, "h2d", after=after,
                                                    issue=issue)
                issued.append(issue.future)
            else:
                copied = self.traffic.submit_copies(pairs, Lane.KV_LOAD, "h2d", after=after)
                load_host.append(copied)
            landed.append(copied)
        remote = plan.de_loads()
        if remote:  # DE host buffer -> device over the compute network
            segments = [(self.addrs.layer_block(i, plan.pe_blocks[j]),
                         plan.de_layer_block(i, j, self.lb), self.lb)
                        for i in layers for j in remote]
            read = self.traffic.submit("read", plan.de_endpoint, segments, Lane.KV_LOAD,
                                       after=after)
            landed.append(read)
            load_host.append(read)
        load = _Load(load_host, issued, landed[0] if len(landed) == 1 else all_of(landed))
        self._landed.append(load.landed)
        return load

    def _start_forward(self, layers: range, computed: Future[None] | None) -> Future[None]:
        """The new KV of ``layers`` to the DE buffer in one submission, once ``computed`` (if
        any) is done."""
        plan, blocks = self.plan, self.plan.forward_blocks()
        segments = [(self.addrs.layer_block(i, plan.pe_blocks[j]),
                     plan.de_layer_block(i, j, self.lb), self.lb)
                    for i in layers for j in blocks]
        return self.traffic.submit("write", plan.de_endpoint, segments, Lane.KV_FORWARD,
                                   after=computed)

    def _host_pairs(self, layer_idx: int, host: range) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(cache, host) views of layer ``layer_idx`` of the ``host`` prompt blocks, one pair
        per run of consecutive cache blocks in consecutive slots (``[n, layer block bytes]``)."""
        assert self.host_pool is not None
        plan, layer = self.plan, self.cache.layer(layer_idx)
        blocks = [plan.pe_blocks[j] for j in host]
        slots = [plan.pe_slots[j] for j in host]
        runs = [(layer[block : block + n].view(n, -1).view(torch.uint8),
                 self.host_pool.columns(slot, n, layer_idx * self.lb, self.lb))
                for block, slot, n in paired_runs(blocks, slots)]
        if self._on_cuda:  # a strided pinned source would be staged by torch: block by block
            return [(dst[i], src[i]) for dst, src in runs for i in range(len(dst))]
        return runs

