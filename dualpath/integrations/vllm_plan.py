"""The vLLM connector's scheduler side: what each step moves, by role (no vLLM import at run
time, no torch: plain values that cross from vLLM's scheduler process to its workers).

A request's ``kv_transfer_params["dualpath"]`` (set by dualpath's engine processes, see
``dualpath/integrations/vllm_workers.py``) says what our router chose for it:

- **prefill** role: ``read_path`` (``pe``: the hit's blocks come from the store through this
  node; ``de``: they are pulled from the decode engine's buffer; ``split``: the first
  ``num_pe_read_blocks`` from the store, the rest pulled), ``num_hit_blocks``, ``de_endpoint``,
  ``de_buffer_addr``, ``num_blocks`` (the buffer's), ``mode`` (``layerwise`` | ``basic``). Every
  prompt block the buffer lacks is pushed into it: the PE path's loaded ones and everything
  the forward computes.
- **decode** role: ``shm_path``, ``buffer_offset``, ``num_blocks``, ``num_tokens`` (prompt
  tokens whose KV the buffer holds), ``num_stored_blocks`` (leading blocks already in storage).

The buffer is layer-major: layer ``l`` of buffer block ``j`` sits at
``buffer + (l × num_blocks + j) × layer_block_bytes``; after the data, at
``buffer + num_blocks × full_block_bytes``, an 8-byte seal the prefill writes last (``seal_of``)
once every push of the request has landed. The decode side copies only a sealed buffer, so a
push that failed is a recompute there, never a wrong token.
"""

from __future__ import annotations

import logging
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dualpath.vocab import PrefillMode, ReadPath

SEAL_BYTES = 8
PARAMS_KEY = "dualpath"
SHARED_POOL_PREFIX = "dualpath-"  # a decode engine's pool file (vllm_instance.shm_path_for)
FENCE_PREFIX = "dualpath-fence-"  # a prefill engine's fence table (vllm_fence.py)
log = logging.getLogger("vllm.dualpath")


def seal_of(req_id: int) -> bytes:
    """The seal that marks request ``req_id``'s buffer complete (never all zero bytes: a
    buffer's seal is zeroed when it is allocated)."""
    return struct.pack("<Q", (req_id & (2**63 - 1)) | 2**63)  # the top bit: never zero


def seal_offset(num_blocks: int, full_block_bytes: int) -> int:
    """Where a buffer of ``num_blocks`` blocks keeps its seal, from its start."""
    return num_blocks * full_block_bytes


def buffer_offset(layer: int, block: int, num_blocks: int, layer_block_bytes: int) -> int:
    """Layer ``layer`` of block ``block`` in a layer-major buffer of ``num_blocks`` blocks."""
    return (layer * num_blocks + block) * layer_block_bytes


def shared_pool_path(path: str) -> str:
    """``path`` when it names a decode engine's shared pool (``dualpath-*`` in /dev/shm, or in
    the temporary folder where there is none); ``ValueError`` otherwise: a request's
    parameters never make the connector map another file."""
    where = Path(path)
    folders = {Path("/dev/shm"), Path(tempfile.gettempdir())}
    if where.parent not in folders or not where.name.startswith(SHARED_POOL_PREFIX):
        raise ValueError(f"{path!r} is not a dualpath decode engine's shared pool")
    return path


def fence_table_path(path: str) -> str:
    """``path`` when empty or naming a prefill engine's fence table (``dualpath-fence-*`` in
    /dev/shm, or the temporary folder where there is none); ``ValueError`` otherwise."""
    if not path:
        return path
    where = Path(path)
    folders = {Path("/dev/shm"), Path(tempfile.gettempdir())}
    if where.parent not in folders or not where.name.startswith(FENCE_PREFIX):
        raise ValueError(f"{path!r} is not a dualpath prefill engine's fence table")
    return path


def parsed(kind: type[PrefillParams] | type[DecodeParams],
           params: dict[str, Any] | None) -> Any:
    """``kind.parse(params)``, or None (logged) when they are malformed: whoever can post to
    the instance can send ``kv_transfer_params``, and a bad one costs that request its
    transfer (it is computed), never the instance."""
    try:
        return kind.parse(params)
    except (KeyError, TypeError, ValueError) as exc:
        log.warning("dualpath connector: ignoring malformed kv_transfer_params (%r): %s",
                    params, exc)
        return None


@dataclass
class Remote:
    """Blocks of one request that move between this instance's paged cache and a decode
    engine's buffer: ``pairs`` of (buffer block index, vLLM block id)."""

    req_id: int
    endpoint: str  # the buffer owner's Mooncake session (prefill) or shm file (decode)
    buffer: int  # the buffer's address (prefill: in the peer) or offset (decode: in the file)
    num_blocks: int
    pairs: list[tuple[int, int]]
    vllm_req_id: str = ""
    seal: bool = False  # push: the request's last; write the seal after it has landed


@dataclass
class PrefillParams:
    """What the router chose for a request on a prefill instance."""

    req_id: int
    read_path: ReadPath
    num_hit_blocks: int
    num_store_blocks: int  # leading hit blocks read from the store; the rest are pulled
    de_endpoint: str
    de_buffer_addr: int
    num_blocks: int
    mode: PrefillMode
    fence_path: str = ""  # the engine's fence table (vllm_fence.py); "" for none

    @classmethod
    def parse(cls, params: dict[str, Any] | None) -> PrefillParams | None:
        """From ``kv_transfer_params`` (None without ours); ``ValueError`` names a bad field."""
        mine = (params or {}).get(PARAMS_KEY)
        if not mine:
            return None
        path = ReadPath(mine["read_path"])
        hit = int(mine["num_hit_blocks"])
        store = {ReadPath.PE: hit, ReadPath.DE: 0}.get(path, int(mine.get("num_pe_read_blocks", 0)))
        found = cls(int(mine["req_id"]), path, hit, min(store, hit), str(mine["de_endpoint"]),
                    int(mine["de_buffer_addr"]), int(mine["num_blocks"]),
                    PrefillMode(mine.get("mode", PrefillMode.LAYERWISE)),
                    fence_table_path(str(mine.get("fence_path", ""))))
        if min(found.num_hit_blocks, found.num_blocks, found.req_id) < 0:
            raise ValueError(f"negative sizes in {mine}")
        return found


@dataclass
class DecodeParams:
    """Where a decode instance finds a request's prompt KV."""

    req_id: int
    shm_path: str
    buffer_offset: int
    num_blocks: int
    num_tokens: int
    num_stored_blocks: int

    @classmethod
    def parse(cls, params: dict[str, Any] | None) -> DecodeParams | None:
        """From ``kv_transfer_params`` (None without ours); ``ValueError`` names a bad field."""
        mine = (params or {}).get(PARAMS_KEY)
        if not mine:
            return None
        found = cls(int(mine["req_id"]), str(mine["shm_path"]), int(mine["buffer_offset"]),
                    int(mine["num_blocks"]), int(mine["num_tokens"]),
                    int(mine.get("num_stored_blocks", 0)))
        if min(found.buffer_offset, found.num_blocks, found.num_tokens, found.req_id) < 0:
            raise ValueError(f"negative sizes in {mine}")
        return found


@dataclass
class PrefillPlan:
    """A prefill request's progress: what its buffer has and what is still to push."""

    params: PrefillParams
    num_prompt_tokens: int
    local_tokens: int = 0  # vLLM's own prefix hit at allocation
    pending_load: tuple[int, int] = (0, 0)  # blocks [from, to) to load next step
    pushed: set[int] = field(default_factory=set)  # buffer blocks pushed whole

    def loads(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """The pending load split as (store blocks [a, b), pulled blocks [c, d)); clears it."""
        start, stop = self.pending_load
        self.pending_load = (0, 0)
        cut = max(start, min(stop, self.params.num_store_blocks))
        return (start, cut), (cut, stop)

    def pushes(self, num_done: int, block_size: int) -> list[int]:
        """Buffer blocks to push once ``num_done`` prompt tokens have KV: every block the
        buffer lacks (all but the hit blocks the decode engine read itself) not yet pushed
        whole; a partial last block goes now and again, whole, after the next chunk."""
        params = self.params
        last = min(-(-num_done // block_size), params.num_blocks)
        blocks = [b for b in range(last) if b not in self.pushed
                  and not params.num_store_blocks <= b < params.num_hit_blocks]
        self.pushed.update(b for b in blocks if (b + 1) * block_size <= num_done)
        return blocks


@dataclass
class StepPlan:
    """One step's moves for the workers."""

    store_loads: list[Any] = field(default_factory=list)  # BlockTransfer: store -> cache
    pulls: list[Remote] = field(default_factory=list)  # DE buffer -> cache, per layer
    pushes: list[Remote] = field(default_factory=list)  # cache -> DE buffer, per layer
    copies: list[Remote] = field(default_factory=list)  # shm buffer -> cache (decode role)
    saves: list[Any] = field(default_factory=list)  # BlockTransfer: cache -> store
    basic: bool = False  # a prefill in basic mode: load all before, push all after the forward
    fence_path: str = ""  # the prefill engine's fence table (vllm_fence.py), once known
