"""The vLLM connector's worker side: the bytes each step moves (``vllm_plan.StepPlan``) between
vLLM's paged KV cache, our store, and a decode engine's layer-major buffer.

- **Store loads** (PE path, and a lone instance): one thread reads the hit's full blocks through
  the ``StorageClient`` (checksummed, with its deadline) and copies them into the paged cache
  layer by layer, setting one event per layer.
- **Pulls** (DE path): one Mooncake read per layer on the ``KV_LOAD`` lane, all queued at the
  start of the step in layer order, straight from the decode engine's buffer into the layer's
  vLLM blocks.
- **Pushes** (prefill role): after layer i's attention, one Mooncake write of layer i of every
  block the buffer lacks on the ``KV_FORWARD`` lane, straight from the paged cache (in basic
  mode: every layer after the forward). The step ends once they have landed; then each request
  whose prompt is complete and whose moves all succeeded gets its seal written
  (``vllm_plan.seal_of``).
- **Copies** (decode role): a thread copies a sealed buffer out of the decode engine's
  shared-memory file into the allocated blocks; an unsealed one is a load error (vLLM
  recomputes the prompt).

``wait_layer(i)`` waits for layer i's store copy and pull only. Every failure is reported
through ``take_errors`` as vLLM block ids (a request's first bad block and every later one) and
poisons the request: it gets no seal and nothing more of it is saved.
"""

from __future__ import annotations

import json
import logging
import mmap
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from dualpath.integrations.vllm.plan import Remote, StepPlan, seal_of, shared_pool_path
from dualpath.kv.hashing import KeySpace
from dualpath.kv.layout import SEAL_BYTES, KVLayout, buffer_offset, seal_offset
from dualpath.kv.shm_files import map_readonly
from dualpath.storage.client import StorageClient
from dualpath.traffic.lanes import Lane
from dualpath.traffic.manager import TrafficManager

log = logging.getLogger("vllm.dualpath")


class Moves:
    """One vLLM worker's KV movement (module docstring)."""

    def __init__(self, layout: KVLayout, space: KeySpace, client: StorageClient,
                 traffic: TrafficManager | None = None, trace_path: str = "") -> None:
        """``trace_path``: append each step's hook and transfer times there as JSON lines
        (the hook-order test reads them; off when empty)."""
        self.layout = layout
        self.space = space
        self.client = client
        self.traffic = traffic
        self.layers: list[torch.Tensor] = []
        self._store_ready: list[threading.Event] = []
        self._pulls: list[list[tuple[Future[None], Remote]]] = []
        self._pushes: list[tuple[Future[None], Remote]] = []
        self._threads: list[threading.Thread] = []
        self._errors: set[int] = set()
        self._poisoned: set[str] = set()  # vLLM ids of requests a move failed for
        self._received: set[str] = set()  # decode role: vLLM ids whose copy is done
        self._lock = threading.Lock()
        self._maps: dict[str, mmap.mmap] = {}
        self._seal = torch.zeros(4096, dtype=torch.uint8)
        self.loaded_tokens = self.pulled_blocks = self.pushed_blocks = 0
        self.copied_blocks = self.num_sealed = self.num_unsealed = 0
        self.trace_path = trace_path
        self._trace: list[tuple[float, str, int]] = []

    # --- setup -------------------------------------------------------------------------

    def register(self, layers: list[torch.Tensor]) -> None:
        """vLLM's paged caches, in layer order; each registered for Mooncake transfers."""
        self.layers = layers
        self._store_ready = [threading.Event() for _ in layers]
        for event in self._store_ready:
            event.set()
        self._pulls = [[] for _ in layers]
        if self.traffic is not None:
            for cache in layers:
                self.traffic.register(cache.data_ptr(), cache.numel() * cache.element_size())
            self.traffic.register(self._seal.data_ptr(), self._seal.numel())

    def _block_addr(self, layer: int, block_id: int) -> int:
        return self.layers[layer].data_ptr() + block_id * self.layout.layer_block_bytes

    def _segments(self, layer: int, remote: Remote) -> list[tuple[int, int, int]]:
        size = self.layout.layer_block_bytes
        return [(self._block_addr(layer, b),
                 remote.buffer + buffer_offset(layer, j, remote.num_blocks, size), size)
                for j, b in remote.pairs]

    # --- a step --------------------------------------------------------------------------

    def start(self, plan: StepPlan) -> None:
        """Start the step's store loads, pulls and copies; in basic mode wait for them."""
        if plan.store_loads:
            for event in self._store_ready:
                event.clear()
            self._spawn(self._load_store, plan.store_loads)
        if plan.pulls:
            self._need_traffic()
            for layer in range(len(self.layers)):
                self._pulls[layer] = [
                    (self._traced(self.traffic.submit(  # type: ignore[union-attr]
                        "read", r.endpoint, self._segments(layer, r), Lane.KV_LOAD),
                        "pull", layer), r)
                    for r in plan.pulls]
        if plan.copies:  # a memcpy per layer: done here, reported by take_received
            self._copy_in(plan.copies)
        if plan.basic:
            for layer in range(len(self.layers)):
                self.wait_layer(layer)

    def wait_layer(self, layer: int) -> None:
        """Block until layer ``layer``'s loads are in the paged cache (or failed)."""
        self._store_ready[layer].wait()
        pulls, self._pulls[layer] = self._pulls[layer], []
        self._mark("wait", layer)
        for future, remote in pulls:
            try:
                future.result()
                self.pulled_blocks += len(remote.pairs) * (layer == 0)
            except Exception as exc:  # any failure is a recompute
                log.warning("dualpath connector: pull of layer %d for request %d failed: %s",
                            layer, remote.req_id, exc)
                self._fail(remote.vllm_req_id, [b for _, b in remote.pairs])
        self._mark("attention", layer)

    def push_layer(self, layer: int, plan: StepPlan) -> None:
        """Queue layer ``layer`` of every push (after its attention has written it)."""
        self._mark("computed", layer)
        if not plan.pushes or plan.basic:
            return
        self._submit_pushes(plan.pushes, [layer])

    def finish(self, plan: StepPlan) -> None:
        """End the step: loads joined, pushes landed (basic mode: pushed now), seals written."""
        for thread in self._threads:
            thread.join()
        self._threads = []
        for layer in range(len(self.layers)):  # a layer vLLM never waited for: its pulls
            if self._pulls[layer]:             # write into blocks vLLM may reuse next step
                self.wait_layer(layer)
        if plan.pushes and plan.basic:
            self._submit_pushes(plan.pushes, range(len(self.layers)))
        failed: set[str] = set()
        for future, remote in self._pushes:
            try:
                future.result()
            except Exception as exc:  # the request gets no seal
                log.warning("dualpath connector: push for request %d failed: %s",
                            remote.req_id, exc)
                failed.add(remote.vllm_req_id)
        self._pushes = []
        for remote in plan.pushes:
            self.pushed_blocks += len(remote.pairs)
            if remote.seal:
                self._write_seal(remote, ok=remote.vllm_req_id not in failed | self._poisoned)
        if plan.pulls or plan.pushes:
            log.info("dualpath connector: pulled %d, pushed %d blocks (%d layers each); "
                     "pulled_blocks_total=%d pushed_blocks_total=%d sealed_total=%d",
                     sum(len(r.pairs) for r in plan.pulls),
                     sum(len(r.pairs) for r in plan.pushes), len(self.layers),
                     self.pulled_blocks, self.pushed_blocks, self.num_sealed)
        self._flush_trace()

    def _submit_pushes(self, pushes: list[Remote], layers: Any) -> None:
        self._need_traffic()
        for layer in layers:
            for remote in pushes:
                if remote.pairs:
                    future = self.traffic.submit(  # type: ignore[union-attr]
                        "write", remote.endpoint, self._segments(layer, remote),
                        Lane.KV_FORWARD)
                    self._pushes.append((self._traced(future, "push", layer), remote))

    def _write_seal(self, remote: Remote, ok: bool) -> None:
        if not ok:
            self.num_unsealed += 1
            log.warning("dualpath connector: request %d not sealed (a load or push failed); "
                        "the decode engine recomputes it", remote.req_id)
            return
        self._seal[:SEAL_BYTES] = torch.frombuffer(bytearray(seal_of(remote.req_id)),
                                                   dtype=torch.uint8)
        where = remote.buffer + seal_offset(remote.num_blocks, self.layout.full_block_bytes)
        try:
            self.traffic.write(remote.endpoint,  # type: ignore[union-attr]
                               [(self._seal.data_ptr(), where, SEAL_BYTES)], Lane.KV_FORWARD)
            self.num_sealed += 1
        except Exception as exc:  # unsealed: the decode side recomputes
            self.num_unsealed += 1
            log.warning("dualpath connector: seal of request %d failed: %s", remote.req_id, exc)

    # --- store loads (thread) ------------------------------------------------------------

    def _load_store(self, loads: list[Any]) -> None:
        """Read every hit block, then copy the good ones in, layer by layer."""
        try:
            keys = [key for t in loads for key in t.keys(self.space)]
            staging = torch.empty((len(keys), self.layout.full_block_bytes), dtype=torch.uint8)
            ok = self.client.read(keys, list(staging))
            rows: list[int] = []
            targets: list[int] = []
            row = 0
            for transfer in loads:
                bad = next((i for i in range(len(transfer.block_ids)) if not ok[row + i]), None)
                if bad is not None:
                    self._fail(transfer.req_id, transfer.block_ids[bad:])
                good = len(transfer.block_ids) if bad is None else bad
                rows += range(row, row + good)
                targets += transfer.block_ids[:good]
                row += len(transfer.block_ids)
            index = torch.tensor(rows, dtype=torch.long)
            ids = torch.tensor(targets, dtype=torch.long)
            for layer, cache in enumerate(self.layers):
                if rows:
                    cache.index_copy_(0, ids, self.staged_layer(staging, layer, cache)[index])
                self._store_ready[layer].set()
            self.loaded_tokens += len(rows) * self.layout.block_size
            log.info("dualpath connector: loaded %d blocks (%d tokens), %d failed; "
                     "loaded_tokens_total=%d", len(rows), len(rows) * self.layout.block_size,
                     len(keys) - len(rows), self.loaded_tokens)
        except Exception:
            log.exception("dualpath connector: load failed; every block is recomputed")
            for transfer in loads:
                self._fail(transfer.req_id, transfer.block_ids)
        finally:
            for event in self._store_ready:
                event.set()

    def staged_layer(self, staging: torch.Tensor, layer: int, like: torch.Tensor) -> torch.Tensor:
        """Layer ``layer`` of every staged full block (a view), shaped and typed as ``like``'s
        blocks."""
        count = staging.shape[0]
        part = staging.view(count, self.layout.num_layers, self.layout.layer_block_bytes)[:, layer]
        return part.view(like.dtype).unflatten(1, like.shape[1:])

    # --- decode role: copies out of the buffer (thread) ----------------------------------

    def _copy_in(self, copies: list[Remote]) -> None:
        for remote in copies:
            try:
                view = self._buffer(remote)
                seal = bytes(view[seal_offset(remote.num_blocks, self.layout.full_block_bytes):]
                             [:SEAL_BYTES].tolist())
                if seal != seal_of(remote.req_id):
                    raise ValueError("the buffer is not sealed (a push did not land)")
                self._copy_layers(view, remote)
                self.copied_blocks += len(remote.pairs)
            except Exception as exc:  # a recompute on this instance
                log.warning("dualpath connector: copy-in of request %d failed: %s",
                            remote.req_id, exc)
                self._fail(remote.vllm_req_id, [b for _, b in remote.pairs])
            with self._lock:
                self._received.add(remote.vllm_req_id)

    def _buffer(self, remote: Remote) -> torch.Tensor:
        """The request's buffer (data and seal) in the decode engine's shared file."""
        mapped = self._maps.get(remote.endpoint)
        if mapped is None:
            # a regular, owner-only file of this user, never through a symlink
            mapped = self._maps[remote.endpoint] = map_readonly(shared_pool_path(remote.endpoint))
        size = seal_offset(remote.num_blocks, self.layout.full_block_bytes) + SEAL_BYTES
        if remote.buffer + size > len(mapped):
            raise ValueError(f"buffer [{remote.buffer}, +{size}) is outside {remote.endpoint}")
        whole = torch.frombuffer(mapped, dtype=torch.uint8)  # read-only memory: never written
        return whole[remote.buffer : remote.buffer + size]

    def _copy_layers(self, view: torch.Tensor, remote: Remote) -> None:
        n = remote.num_blocks
        data = view[: n * self.layout.full_block_bytes].view(*self.layout.buffer_shape(n))
        js = torch.tensor([j for j, _ in remote.pairs], dtype=torch.long)
        ids = torch.tensor([b for _, b in remote.pairs], dtype=torch.long)
        for layer, cache in enumerate(self.layers):
            rows = data[layer].index_select(0, js)
            cache.index_copy_(0, ids, rows.view(cache.dtype).unflatten(1, cache.shape[1:]))

    # --- the hook-order trace --------------------------------------------------------------

    def _mark(self, event: str, layer: int) -> None:
        if self.trace_path:
            self._trace.append((time.monotonic(), event, layer))

    def _traced(self, future: Future[None], what: str, layer: int) -> Future[None]:
        """``future``, its submission and completion marked (``what``-queued/-landed)."""
        if self.trace_path:
            self._mark(f"{what}-queued", layer)
            future.add_done_callback(lambda _: self._mark(f"{what}-landed", layer))
        return future

    def _flush_trace(self) -> None:
        if self.trace_path and self._trace:
            events, self._trace = self._trace, []
            with Path(self.trace_path).open("a") as file:
                file.write(json.dumps(sorted(events)) + "\n")

    # --- outcomes ------------------------------------------------------------------------

    def _fail(self, vllm_req_id: str, block_ids: list[int]) -> None:
        with self._lock:
            self._errors |= set(block_ids)
            self._poisoned.add(vllm_req_id)

    def poisoned(self, vllm_req_id: str) -> bool:
        """True once a move of this request failed: it gets no seal and no more saves."""
        with self._lock:
            return vllm_req_id in self._poisoned

    def forget(self, vllm_req_ids: set[str]) -> None:
        """Requests vLLM finished: drop their poison marks."""
        with self._lock:
            self._poisoned -= vllm_req_ids

    def take_errors(self) -> set[int]:
        """vLLM block ids whose load failed since the last call."""
        with self._lock:
            errors, self._errors = self._errors, set()
        return errors

    def take_received(self) -> set[str]:
        """Decode role: vLLM request ids whose copy-in ended since the last call."""
        with self._lock:
            done, self._received = self._received, set()
        return done

    def _spawn(self, target: Any, work: Any) -> None:
        thread = threading.Thread(target=target, args=(work,), name="dualpath-kv", daemon=True)
        thread.start()
        self._threads.append(thread)

    def _need_traffic(self) -> None:
        if self.traffic is None:
            raise RuntimeError("this connector has no transfer engine (role both)")

    def close(self) -> None:
        """Stop transfers, unmap buffers."""
        if self.traffic is not None:
            self.traffic.close()
        for mapped in self._maps.values():
            mapped.close()
