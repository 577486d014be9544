"""dualpath's KV connector for vLLM: our store, both read paths and the layerwise PD transfer
under vLLM instances (issue 36; design in docs/vllm-connector.md).

Loaded by vLLM from ``kv_connector_module_path="dualpath.integrations.vllm.connector"`` with
``kv_connector="DualPathConnector"`` (``vllm_launch.transfer_config`` writes that config). One
class, three roles (``kv_connector_extra_config["role"]``):

- ``both``: a lone instance on the store: hits are the store's, loaded through a
  ``StorageClient`` layer by layer; every block that becomes full is stored.
- ``prefill``: the instance a dualpath prefill engine drives. The router's choice rides in the
  request's ``kv_transfer_params`` (``vllm_plan.PrefillParams``): the hit is read from the store
  (PE path) or pulled from the decode engine's buffer over Mooncake (DE path), layer by layer;
  after each layer's attention its KV goes to the decode engine's buffer (``vllm_moves``);
  the last step seals the buffer. Nothing is stored here: the decode side persists.
- ``decode``: the instance a dualpath decode engine drives: the prompt's KV is copied out of
  the (sealed) buffer the engine shares with it, asynchronously in vLLM's sense; the decode
  then runs, and every block that becomes full (the prompt's new blocks, generated tokens) is
  stored.

**Keys** are our chained ``BlockKey``s over the token ids, seeded with the checkpoint's
``model_id``, the request's salt (``vllm_plan.key_salt``: ours, of which vLLM's ``cache_salt``
is the digest) and vLLM's layout id (``KVLayout.vllm_layout_id``):
our engines' ids never match it. One stored block is one vLLM block (our key block size *is*
vLLM's ``block_size``), its layers in order, each exactly vLLM's CPU cache block.

**Fences**: a prefill engine that gives up on a request (an abort, a failed or timed-out call)
revokes it in its fence table (``vllm/fence.py``, named by ``fence_path`` in the request's
params); the worker side counts each step it binds, never pushes or seals a revoked request after
that, and marks a step done once its moves have all ended, so the engine knows when no write of
the request can still land in the decode engine's buffer.

**Failures** never give a wrong token: a block missing, corrupt, late or not pulled is
reported by ``get_block_ids_with_load_errors`` (vLLM, with ``kv_load_failure_policy=
"recompute"``, recomputes from it) and the request is poisoned (no seal, nothing more saved);
an unsealed buffer is a recompute of the prompt on the decode instance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from dualpath.integrations.vllm.engines.launch import BOTH
from dualpath.integrations.vllm.fence import FenceTableError, WorkerFence
from dualpath.integrations.vllm.moves import Moves
from dualpath.integrations.vllm.plan import (
    Bounds,
    DecodeParams,
    PrefillParams,
    PrefillPlan,
    Remote,
    StepPlan,
    key_salt,
    parsed,
)
from dualpath.integrations.vllm.setup import (
    LAYER_INDEX,
    BlockTransfer,
    key_space,
    log,
    prefill_traffic,
    storage_config,
    vllm_layout,
)
from dualpath.kv.hashing import extend_block_hashes
from dualpath.storage import open_store
from dualpath.storage.client import StorageClient
from dualpath.vocab import PrefillMode, Role

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


@dataclass
class DualPathMeta(KVConnectorMetadata):
    """One step's moves (``vllm_plan.StepPlan``), as vLLM's connector metadata."""

    plan: StepPlan = field(default_factory=StepPlan)


@dataclass
class _Tracked:
    """The scheduler side's view of one request: its chain and what is loaded or saved."""

    request: Request
    hashes: list[bytes] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0  # leading blocks stored or loaded (never saved again)
    load_from: int = 0  # the pending store load: blocks [load_from, load_to)
    load_to: int = 0
    local: int = 0  # tokens vLLM holds itself (its prefix cache), at the last lookup
    prefill: PrefillPlan | None = None  # prefill role: what the router chose
    decode: DecodeParams | None = None  # decode role: where its prompt's KV waits
    sealed: bool = False
    copied: bool = False  # decode role: its buffer was copied in (or failed to be): once


class DualPathConnector(KVConnectorBase_V1):
    """dualpath's storage tier and PD transfers under one vLLM instance (module docstring);
    the role comes from ``kv_connector_extra_config["role"]``."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.kind = str(extra.get("role", BOTH))
        if self.kind not in (BOTH, Role.PREFILL, Role.DECODE):
            raise ValueError(f"kv_connector_extra_config role {self.kind!r}: prefill, decode "
                             "or both")
        self.layout = vllm_layout(vllm_config)
        self.space = key_space(vllm_config, extra)
        if self.space.block_size != vllm_config.cache_config.block_size:
            raise ValueError("our key block size must equal vLLM's block size")
        self.block_size = self.space.block_size
        config = storage_config(extra)
        self.client = StorageClient(open_store(config, self.layout), self.block_size, config)
        self._tracked: dict[str, _Tracked] = {}  # scheduler side
        self._fence_path = ""  # scheduler side: the prefill engine's fence table, once named
        self.fence = WorkerFence()  # worker side
        self._pending_copies: list[Remote] = []  # decode role: allocated, copied next step
        self._layer_of: dict[str, int] = {}  # worker side
        traffic = None
        if role == KVConnectorRole.WORKER and self.kind == Role.PREFILL:
            traffic = prefill_traffic(extra)
        self.moves = Moves(self.layout, self.space, self.client, traffic,
                           str(extra.get("trace_path", "")))
        self.saved_blocks = 0
        log.info("dualpath connector (%s, %s): key space %s/%s bs%d, store %s at %s",
                 role.name, self.kind, self.space.model_id, self.space.layout_id,
                 self.block_size, config.backend, config.root)

    # --- scheduler side -------------------------------------------------------------------

    def _track(self, request: Request) -> _Tracked:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            tracked = self._tracked[request.request_id] = _Tracked(request)
            bounds = Bounds(len(request.prompt_token_ids or []), self.block_size,
                            self.layout.full_block_bytes)  # what the params are checked against
            if self.kind == Role.PREFILL:
                params = parsed(PrefillParams, request.kv_transfer_params, bounds)
                if params is not None:
                    tracked.prefill = PrefillPlan(params, len(request.prompt_token_ids or []))
                    self._fence_path = params.fence_path or self._fence_path
            elif self.kind == Role.DECODE:
                tracked.decode = parsed(DecodeParams, request.kv_transfer_params, bounds)
                tracked.saved = tracked.decode.num_stored_blocks if tracked.decode else 0
        return tracked

    def _extend(self, tracked: _Tracked, num_tokens: int) -> None:
        """Hash the chain's full blocks up to ``num_tokens`` tokens (known ones only)."""
        request = tracked.request
        tokens = request.all_token_ids[:num_tokens]
        seed = self.space.salted(key_salt(request.cache_salt, request.kv_transfer_params)).seed
        extend_block_hashes(tracked.hashes, tokens, self.block_size, seed)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` this connector can load. Prefill and lone
        instances load synchronously (``False``, so layer by layer): the router's hit, or the
        store's; at least one prompt token is left to compute. A decode instance loads the
        prompt's KV from its buffer asynchronously (``True``)."""
        tracked = self._track(request)
        tracked.local = num_computed_tokens
        prompt = request.prompt_token_ids or []
        if self.kind == Role.DECODE:
            # once only: after a failed copy (vLLM then recomputes) or a preemption the buffer
            # may be gone, and asking again would load it again, forever
            params = tracked.decode
            extra = params.num_tokens - num_computed_tokens if params else 0
            return (extra, True) if extra > 0 and not tracked.copied else (0, False)
        usable = (len(prompt) - 1) // self.block_size
        if self.kind == Role.PREFILL:
            hit = min(tracked.prefill.params.num_hit_blocks, usable) if tracked.prefill else 0
        else:
            hit = self._store_hit(tracked, usable)
        return max(0, hit * self.block_size - num_computed_tokens), False

    def _store_hit(self, tracked: _Tracked, usable: int) -> int:
        request = tracked.request
        self._extend(tracked, usable * self.block_size)
        space = self.space.salted(key_salt(request.cache_salt, request.kv_transfer_params))
        try:
            return self.client.exists_prefix(space.keys_for_hashes(tracked.hashes[:usable]))
        except Exception as exc:  # a store that cannot answer is a miss
            log.warning("dualpath connector: exists_prefix failed (%s): a miss", exc)
            return 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Note the blocks to load (after vLLM's own prefix hit) for the next step."""
        tracked = self._track(request)
        computed = tracked.local if num_external_tokens else request.num_computed_tokens
        first = computed // self.block_size
        if self.kind == Role.DECODE:
            params = tracked.decode
            if params is not None and num_external_tokens > 0:
                tracked.copied = True
                ids = blocks.get_block_ids()[0]
                last = -(-(computed + num_external_tokens) // self.block_size)
                self._pending_copies.append(Remote(
                    params.req_id, params.shm_path, params.buffer_offset, params.num_blocks,
                    [(j, ids[j]) for j in range(first, last)], request.request_id))
            return
        last = (computed + num_external_tokens) // self.block_size
        if tracked.prefill is not None:
            tracked.prefill.pending_load = (first, last)
        else:
            tracked.load_from, tracked.load_to = first, last
        tracked.saved = max(tracked.saved, last)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's moves: loads, pulls, pushes, copies and saves (``StepPlan``)."""
        plan = StepPlan(copies=self._pending_copies, fence_path=self._fence_path)
        self._pending_copies = []
        for req_id, computed in self._scheduled(scheduler_output):
            tracked = self._tracked[req_id]
            done = computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if tracked.prefill is not None:
                self._plan_prefill(tracked, done, plan)
                continue
            if tracked.load_to > tracked.load_from:
                self._extend(tracked, tracked.load_to * self.block_size)
                plan.store_loads.append(self._transfer(tracked, tracked.load_from,
                                                       tracked.load_to))
                tracked.load_from = tracked.load_to = 0
            if self.kind != Role.PREFILL:
                self._plan_saves(tracked, done, plan)
        return DualPathMeta(plan)

    def _scheduled(self, scheduler_output: SchedulerOutput) -> list[tuple[str, int]]:
        """(request id, tokens computed before this step) of each tracked scheduled request,
        its block ids brought up to date."""
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
        return steps

    def _plan_prefill(self, tracked: _Tracked, done: int, plan: StepPlan) -> None:
        """A prefill request's loads (store and pulls), pushes and, once its prompt is
        complete, its seal."""
        prefill = tracked.prefill
        assert prefill is not None
        params, ids = prefill.params, tracked.block_ids
        (s0, s1), (p0, p1) = prefill.loads()
        if s1 > s0:
            self._extend(tracked, s1 * self.block_size)
            plan.store_loads.append(self._transfer(tracked, s0, s1))
        remote = partial(Remote, params.req_id, params.de_endpoint, params.de_buffer_addr,
                         params.num_blocks, vllm_req_id=tracked.request.request_id)
        if p1 > p0:
            plan.pulls.append(remote([(j, ids[j]) for j in range(p0, p1)]))
        prompt_done = min(done, prefill.num_prompt_tokens)
        blocks = prefill.pushes(prompt_done, self.block_size)
        seal = prompt_done >= prefill.num_prompt_tokens and not tracked.sealed
        tracked.sealed |= seal
        if blocks or seal:
            plan.pushes.append(remote([(j, ids[j]) for j in blocks], seal=seal))
        plan.basic |= params.mode == PrefillMode.BASIC

    def _plan_saves(self, tracked: _Tracked, done: int, plan: StepPlan) -> None:
        """The blocks that become full this step, to store."""
        self._extend(tracked, done)
        full = min(len(tracked.hashes), done // self.block_size, len(tracked.block_ids))
        if full > tracked.saved:
            plan.saves.append(self._transfer(tracked, tracked.saved, full))
            tracked.saved = full

    def _transfer(self, tracked: _Tracked, start: int, stop: int) -> BlockTransfer:
        request, bs = tracked.request, self.block_size
        parents = [tracked.hashes[k - 1] if k else None for k in range(start, stop)]
        tokens = request.all_token_ids
        return BlockTransfer(request.request_id,
                             key_salt(request.cache_salt, request.kv_transfer_params),
                             tracked.block_ids[start:stop], tracked.hashes[start:stop], parents,
                             [list(tokens[k * bs:(k + 1) * bs]) for k in range(start, stop)])

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; every move ends within its step, so vLLM may free its blocks
        now."""
        self._tracked.pop(request.request_id, None)
        return False, None

    # --- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep vLLM's per-layer paged caches in layer order; check one block's size."""
        def index(name: str) -> int:
            found = LAYER_INDEX.search(name)
            return int(found.group(1)) if found else 0

        layers = sorted(kv_caches.items(), key=lambda item: index(item[0]))
        if len(layers) != self.layout.num_layers:
            raise ValueError(f"{len(layers)} KV caches for {self.layout.num_layers} layers")
        for name, cache in layers:
            block = cache[0]
            if block.numel() * block.element_size() != self.layout.layer_block_bytes or \
                    not block.is_contiguous() or not cache.is_contiguous():
                raise ValueError(f"layer {name}: block of shape {tuple(block.shape)} is not "
                                 f"{self.layout.layer_block_bytes} contiguous bytes")
        self._layer_of = {name: i for i, (name, _) in enumerate(layers)}
        self.moves.register([cache for _, cache in layers])

    def _plan(self) -> StepPlan:
        meta = self._get_connector_metadata()
        assert isinstance(meta, DualPathMeta)
        return meta.plan

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """A step begins: count it in the fence table and drop the pushes (and seals) of the
        requests the prefill engine has revoked. A table that cannot be opened drops every
        push of the step (the decode side then recomputes): never a push the engine could not
        fence."""
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, DualPathMeta)
        plan = connector_metadata.plan
        try:
            self.fence.begin(plan.fence_path)
        except FenceTableError as exc:
            log.error("dualpath connector: %s: this step pushes nothing", exc)
            plan.pushes = []
            return
        plan.pushes = [r for r in plan.pushes if not self.fence.revoked(r.req_id)]

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start this step's loads and pulls (layers become ready one at a time) and its
        copies out of the buffer (decode role)."""
        if self.moves.layers:
            self.moves.start(self._plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Wait for this layer's loads only."""
        layer = self._layer_of.get(layer_name)
        if layer is not None:
            self.moves.wait_layer(layer)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Prefill role, layerwise: queue this layer's pushes to the decode engine's buffer."""
        layer = self._layer_of.get(layer_name)
        if layer is not None:
            self.moves.push_layer(layer, self._plan())

    def wait_for_save(self) -> None:
        """End the step's moves (pushes landed, seals written), then store every block that
        became full this step, in chain order."""
        plan = self._plan()
        self.moves.finish(plan)
        self.fence.end()  # no push of this step can still land
        saves = [t for t in plan.saves if not self.moves.poisoned(t.req_id)]
        if not saves or not self.moves.layers:
            return
        keys = [key for t in saves for key in t.keys(self.space)]
        ids = torch.tensor([b for t in saves for b in t.block_ids], dtype=torch.long)
        staging = torch.empty((len(keys), self.layout.full_block_bytes), dtype=torch.uint8)
        for layer, cache in enumerate(self.moves.layers):
            self.moves.staged_layer(staging, layer, cache).copy_(cache.index_select(0, ids))
        stored = self.client.write(keys, list(staging))
        self.saved_blocks += sum(stored)
        log.info("dualpath connector: saved %d of %d blocks; saved_blocks_total=%d",
                 sum(stored), len(keys), self.saved_blocks)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM blocks whose load failed since the last call (vLLM recomputes them)."""
        return self.moves.take_errors()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                set[str] | None]:
        """Decode role: the requests whose copy-in ended (failed ones' blocks are load
        errors in the same step); forget finished requests."""
        self.moves.forget(finished_req_ids)
        received = self.moves.take_received()
        return None, (received or None)

    def shutdown(self) -> None:
        """Close the store client, the transfer engine and the fence table."""
        self.moves.close()
        self.client.close()
        self.fence.close()
