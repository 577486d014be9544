"""A vLLM KV connector that gives one vLLM instance dualpath's storage tier (issue 36, PE path).

Loaded by vLLM from ``kv_connector_module_path="dualpath.integrations.vllm"`` with
``kv_connector="DualPathConnector"`` (see ``transfer_config``); the design is
docs/vllm-connector.md. This first slice is the prefill instance's PE read path and the
persistence of full blocks; the DE path, the layerwise push to a decode instance and
``serve --engine vllm`` are not built.

- **Keys** are our chained ``BlockKey``s (``dualpath.kv.hashing.KeySpace``) over the prompt's
  token ids, seeded with the checkpoint's ``model_id`` (config and every weight byte), the
  request's ``cache_salt`` and a layout id naming vLLM's CPU layout (``vllm-LBHNC-...``): our
  own engines' token-major ``kv-...`` ids never match it, so neither side reads the other's
  bytes. vLLM's ``request.block_hashes`` are not used.
- **Block size rule**: our key block size *is* vLLM's ``cache_config.block_size``; one stored
  block is one vLLM block.
- **Stored bytes**: a block is its layers in layer order, each layer exactly vLLM's CPU cache
  block ``(kv_heads, block_size, 2 × head_dim)`` (head-major; per head K then V), so a layer of
  a stored block is one contiguous run that copies straight into ``kv_cache[layer][block_id]``.
- **Loads** are synchronous in vLLM's sense (``get_num_new_matched_tokens`` returns ``False``)
  so they run inside the step that consumes them: ``start_load_kv`` starts a thread that reads
  the hit blocks through a ``StorageClient`` into a staging area and copies them into the paged
  cache one layer at a time, setting an event per layer; ``wait_for_layer_load(name)`` waits
  only for that layer's event, so layer i+1's copy runs while layer i computes.
- **Saves** are whole blocks at the end of the step: ``wait_for_save`` gathers every block that
  became full in this step (all layers, from the paged cache, into a staging copy) and writes
  them in chain order, waiting for the store, so a process that exits after a request leaves
  its blocks stored (turn 2 of a chat, in a new process, hits turn 1's KV).
- **Failures**: a block that is missing, fails its checksum or misses the read deadline is
  not copied; it and every later block of the request are reported by
  ``get_block_ids_with_load_errors``, and with ``kv_load_failure_policy="recompute"`` (set by
  ``transfer_config``) vLLM recomputes them: a miss, never a wrong token.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from dualpath.integrations.vllm_setup import (
    LAYER_INDEX,
    BlockTransfer,
    key_space,
    log,
    storage_config,
    vllm_layout,
)
from dualpath.kv.hashing import extend_block_hashes
from dualpath.storage import open_store
from dualpath.storage.client import StorageClient

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

@dataclass
class DualPathMeta(KVConnectorMetadata):
    """One step's work: blocks to load before the forward and blocks to save after it."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


@dataclass
class _Tracked:
    """The scheduler side's view of one request: its chain and what is loaded or saved."""

    request: Request
    hashes: list[bytes] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0  # leading blocks stored or loaded (never saved again)
    load_from: int = 0  # the pending load: blocks [load_from, load_to)
    load_to: int = 0
    local: int = 0  # tokens vLLM holds itself (its prefix cache), at the last lookup


class DualPathConnector(KVConnectorBase_V1):
    """dualpath's storage tier under one vLLM instance: PE-path loads, layer by layer, and
    full-block saves (module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.layout = vllm_layout(vllm_config)
        self.space = key_space(vllm_config, extra)
        if self.space.block_size != vllm_config.cache_config.block_size:
            raise ValueError("our key block size must equal vLLM's block size")
        self.block_size = self.space.block_size
        config = storage_config(extra)
        self.client = StorageClient(open_store(config, self.layout), self.block_size, config)
        # scheduler side
        self._tracked: dict[str, _Tracked] = {}
        # worker side
        self._layers: list[tuple[str, torch.Tensor]] = []
        self._layer_events: dict[str, threading.Event] = {}
        self._load_thread: threading.Thread | None = None
        self._load_errors: set[int] = set()
        # Requests a load failed for: the steps until vLLM has recomputed the bad blocks may
        # compute on them, so nothing more of such a request is saved (a miss, never wrong KV).
        self._poisoned: set[str] = set()
        self._errors_lock = threading.Lock()
        self.loaded_tokens = 0
        self.saved_blocks = 0
        log.info("dualpath connector (%s): key space %s/%s bs%d, store %s at %s",
                 role.name, self.space.model_id, self.space.layout_id, self.block_size,
                 config.backend, config.root)

    # --- scheduler side -------------------------------------------------------------------

    def _track(self, request: Request) -> _Tracked:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            tracked = self._tracked[request.request_id] = _Tracked(request)
        return tracked

    def _extend(self, tracked: _Tracked, num_tokens: int) -> None:
        """Hash the chain's full blocks up to ``num_tokens`` tokens (known ones only)."""
        request = tracked.request
        tokens = request.all_token_ids[:num_tokens]
        seed = self.space.salted(request.cache_salt or "").seed
        extend_block_hashes(tracked.hashes, tokens, self.block_size, seed)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """Prompt tokens beyond ``num_computed_tokens`` whose blocks our store holds; at
        least one prompt token is left to compute. Synchronous (``False``): layerwise."""
        tracked = self._track(request)
        tracked.local = num_computed_tokens
        prompt = request.prompt_token_ids or []
        self._extend(tracked, len(prompt) - 1)
        usable = min(len(tracked.hashes), (len(prompt) - 1) // self.block_size)
        space = self.space.salted(request.cache_salt or "")
        try:
            hit = self.client.exists_prefix(space.keys_for_hashes(tracked.hashes[:usable]))
        except Exception as exc:  # a store that cannot answer is a miss
            log.warning("dualpath connector: exists_prefix failed (%s): a miss", exc)
            hit = 0
        return max(0, hit * self.block_size - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Note the blocks to load (after vLLM's own prefix hit) for the next step."""
        tracked = self._track(request)
        computed = tracked.local if num_external_tokens else request.num_computed_tokens
        tracked.load_from = computed // self.block_size
        tracked.load_to = (computed + num_external_tokens) // self.block_size
        tracked.saved = max(tracked.saved, tracked.load_to)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads (hit blocks) and saves (blocks that become full this step)."""
        meta = DualPathMeta()
        steps: list[tuple[str, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = list(new.block_ids[0])
                steps.append((new.req_id, new.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and new_ids is not None:
                tracked.block_ids = list(new_ids[0])
            elif new_ids is not None:
                tracked.block_ids.extend(new_ids[0])
            steps.append((req_id, cached.num_computed_tokens[i]))
        for req_id, computed in steps:
            tracked = self._tracked[req_id]
            if tracked.load_to > tracked.load_from:
                self._extend(tracked, tracked.load_to * self.block_size)
                meta.loads.append(self._transfer(tracked, tracked.load_from, tracked.load_to))
                tracked.load_from = tracked.load_to = 0
            done = computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            self._extend(tracked, done)
            full = min(len(tracked.hashes), done // self.block_size, len(tracked.block_ids))
            if full > tracked.saved:
                meta.saves.append(self._transfer(tracked, tracked.saved, full))
                tracked.saved = full
        return meta

    def _transfer(self, tracked: _Tracked, start: int, stop: int) -> BlockTransfer:
        request, bs = tracked.request, self.block_size
        parents = [tracked.hashes[k - 1] if k else None for k in range(start, stop)]
        tokens = request.all_token_ids
        return BlockTransfer(request.request_id, request.cache_salt or "",
                             tracked.block_ids[start:stop], tracked.hashes[start:stop], parents,
                             [list(tokens[k * bs:(k + 1) * bs]) for k in range(start, stop)])

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; saves are synchronous, so vLLM may free its blocks now."""
        self._tracked.pop(request.request_id, None)
        return False, None

    # --- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep vLLM's per-layer paged caches in layer order; check one block's size."""
        def index(name: str) -> int:
            found = LAYER_INDEX.search(name)
            return int(found.group(1)) if found else 0

        self._layers = sorted(kv_caches.items(), key=lambda item: index(item[0]))
        if len(self._layers) != self.layout.num_layers:
            raise ValueError(f"{len(self._layers)} KV caches for {self.layout.num_layers} layers")
        for name, cache in self._layers:
            block = cache[0]
            if block.numel() * block.element_size() != self.layout.layer_block_bytes or \
                    not block.is_contiguous():
                raise ValueError(f"layer {name}: block of shape {tuple(block.shape)} is not "
                                 f"{self.layout.layer_block_bytes} contiguous bytes")
        self._layer_events = {name: threading.Event() for name, _ in self._layers}
        for event in self._layer_events.values():
            event.set()

    def _staging(self, count: int) -> torch.Tensor:
        """Room for ``count`` full blocks as bytes (the store's buffers)."""
        return torch.empty((count, self.layout.full_block_bytes), dtype=torch.uint8)

    def _layer_view(self, staging: torch.Tensor, layer: int, like: torch.Tensor) -> torch.Tensor:
        """Layer ``layer`` of every staged block (a view), shaped and typed as ``like``'s
        blocks."""
        count = staging.shape[0]
        part = staging.view(count, self.layout.num_layers, self.layout.layer_block_bytes)[:, layer]
        return part.view(like.dtype).unflatten(1, like.shape[1:])

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start this step's loads on a thread; layers become ready one at a time."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, DualPathMeta)
        if not meta.loads or not self._layers:
            return
        for event in self._layer_events.values():
            event.clear()
        self._load_thread = threading.Thread(target=self._load, args=(meta.loads,),
                                             name="dualpath-load", daemon=True)
        self._load_thread.start()

    def _load(self, loads: list[BlockTransfer]) -> None:
        """Read every hit block, then copy the good ones in, layer by layer."""
        try:
            keys = [key for t in loads for key in t.keys(self.space)]
            staging = self._staging(len(keys))
            ok = self.client.read(keys, list(staging))
            poisoned: set[str] = set()  # requests with a failed block: saved no more
            good: list[int] = []  # staging rows to copy in
            targets: list[int] = []  # their vLLM block ids
            bad: set[int] = set()
            row = 0
            for transfer in loads:
                failed = False
                for block_id in transfer.block_ids:
                    failed = failed or not ok[row]  # a chain is as good as its first bad block
                    if failed:
                        poisoned.add(transfer.req_id)
                        bad.add(block_id)
                    else:
                        good.append(row)
                        targets.append(block_id)
                    row += 1
            with self._errors_lock:  # the worker's main thread reads both
                self._load_errors |= bad
                self._poisoned |= poisoned
            rows = torch.tensor(good, dtype=torch.long)
            ids = torch.tensor(targets, dtype=torch.long)
            for layer, (name, cache) in enumerate(self._layers):
                if good:
                    cache.index_copy_(0, ids, self._layer_view(staging, layer, cache)[rows])
                self._layer_events[name].set()
            self.loaded_tokens += len(good) * self.block_size
            log.info("dualpath connector: loaded %d blocks (%d tokens), %d failed; "
                     "loaded_tokens_total=%d", len(good), len(good) * self.block_size, len(bad),
                     self.loaded_tokens)
        except Exception:
            log.exception("dualpath connector: load failed; every block is recomputed")
            with self._errors_lock:
                self._load_errors |= {b for t in loads for b in t.block_ids}
                self._poisoned |= {t.req_id for t in loads}
        finally:
            for event in self._layer_events.values():
                event.set()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Wait for this layer's copy only."""
        event = self._layer_events.get(layer_name)
        if event is not None:
            event.wait()

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Nothing per layer: whole blocks are saved at the end of the step."""

    def wait_for_save(self) -> None:
        """Store every block that became full this step (all layers), in chain order."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, DualPathMeta)
        if self._load_thread is not None:  # a step's loads end before its saves read
            self._load_thread.join()
            self._load_thread = None
        saves = [t for t in meta.saves if t.req_id not in self._poisoned]
        if not saves or not self._layers:
            return
        keys = [key for t in saves for key in t.keys(self.space)]
        ids = torch.tensor([b for t in saves for b in t.block_ids], dtype=torch.long)
        staging = self._staging(len(keys))
        for layer, (_, cache) in enumerate(self._layers):
            self._layer_view(staging, layer, cache).copy_(cache.index_select(0, ids))
        stored = self.client.write(keys, list(staging))
        self.saved_blocks += sum(stored)
        log.info("dualpath connector: saved %d of %d blocks; saved_blocks_total=%d",
                 sum(stored), len(keys), self.saved_blocks)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM blocks whose load failed since the last call (vLLM recomputes them)."""
        with self._errors_lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                set[str] | None]:
        """Nothing is asynchronous; forget finished requests."""
        with self._errors_lock:
            self._poisoned -= finished_req_ids
        return None, None

    def shutdown(self) -> None:
        """Close the store client."""
        self.client.close()
