"""The vLLM connector's scheduler side: what each step moves, by role (no vLLM import at run
time, no torch: plain values that cross from vLLM's scheduler process to its workers).

A request's ``kv_transfer_params["dualpath"]`` (set by dualpath's engine processes, see
``dualpath/integrations/vllm/engines/prefill.py``) says what our router chose for it:

- **prefill** role: ``read_path`` (``pe``: the hit's blocks come from the store through this
  node; ``de``: they are pulled from the decode engine's buffer; ``split``: the first
  ``num_pe_read_blocks`` from the store, the rest pulled), ``num_hit_blocks``, ``de_endpoint``,
  ``de_buffer_addr``, ``num_blocks`` (the buffer's), ``mode`` (``layerwise`` | ``basic``). Every
  prompt block the buffer lacks is pushed into it: the PE path's loaded ones and everything
  the forward computes.
- **decode** role: ``shm_path``, ``buffer_offset``, ``num_blocks``, ``num_tokens`` (prompt
  tokens whose KV the buffer holds), ``num_stored_blocks`` (leading blocks already in storage).

The buffer is our decode engines' layer-major one (``kv/layout.py``: ``buffer_offset``,
``seal_offset``): layer by layer, then a seal the prefill writes last (``seal_of``) once every
push of the request has landed. The decode side copies only a sealed buffer, so a
push that failed is a recompute there, never a wrong token.

Whoever can post to an instance can send ``kv_transfer_params``, so every field is checked, by
type (integers that are integers, short strings) and against what the connector knows
(``Bounds``: the request's prompt, the block size, a block's bytes) and the pool file: a
prefill's ``num_blocks`` is the prompt's, its hit no more than that, its endpoint a
``host:port``, its buffer inside the address space; a decode's ``num_tokens`` leaves a prompt
token to compute (vLLM asserts as much and would end the instance), its ``num_blocks`` covers
exactly those tokens, and its buffer and seal lie inside the pool file. Parameters that fail a
check are ignored (``parsed``): that request is computed, nothing moves.

**Salts.** vLLM takes a ``cache_salt`` of at most 128 characters without ``@``, ``/``, a
backslash or NUL; ours may be any text, so an engine sends vLLM the salt's digest
(``vllm_salt``) and the salt itself in ``kv_transfer_params`` (``cache_salt``); the connector
keys blocks with the salt whose digest vLLM holds (``key_salt``), so its keys are the ones our
engines and router derive.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dualpath.kv.block_plan import BlockPlan, load_blocks
from dualpath.kv.layout import SEAL_BYTES, seal_offset  # the buffer's layout
from dualpath.vocab import PrefillMode, ReadPath

PARAMS_KEY = "dualpath"
SHARED_POOL_PREFIX = "dualpath-"  # a decode engine's pool file (vllm_instance.shm_path_for)
FENCE_PREFIX = "dualpath-fence-"  # a prefill engine's fence table (vllm/fence.py)
MAX_COUNT = 2**63 - 1  # integers in the parameters (ids, counts, offsets)
MAX_ADDRESS = 2**64  # a buffer ends inside the 64-bit address space
MAX_TEXT = 4096  # strings in the parameters (paths, endpoints)
log = logging.getLogger("vllm.dualpath")


@dataclass(frozen=True)
class Bounds:
    """What the connector knows of a request, to check its parameters against."""

    num_prompt_tokens: int
    block_size: int
    block_bytes: int  # one block, every layer (``KVLayout.full_block_bytes``)

    def blocks(self, num_tokens: int) -> int:
        """Blocks that ``num_tokens`` tokens take."""
        return -(-num_tokens // self.block_size)


def vllm_salt(salt: str) -> str:
    """What vLLM gets as ``cache_salt`` for our ``salt``: its hex BLAKE2b digest (64
    characters of ``0-9a-f``; vLLM refuses ``@``, ``/``, a backslash, NUL and more than 128)."""
    return hashlib.blake2b(salt.encode(), digest_size=32).hexdigest()


def key_salt(cache_salt: str | None, params: dict[str, Any] | None) -> str:
    """The salt a request's block keys use: ``kv_transfer_params``' ``cache_salt`` when vLLM's
    ``cache_salt`` is its digest (what our engines send), else vLLM's own (a plain client's)."""
    mine = (params or {}).get(PARAMS_KEY)
    ours = mine.get("cache_salt") if isinstance(mine, dict) else None
    if isinstance(ours, str) and ours and cache_salt == vllm_salt(ours):
        return ours
    return cache_salt or ""


def _ours(params: dict[str, Any] | None) -> dict[str, Any] | None:
    """Our part of ``kv_transfer_params`` (None without one); ``TypeError`` unless a map."""
    mine = (params or {}).get(PARAMS_KEY)
    if not mine:
        return None
    if not isinstance(mine, dict):
        raise TypeError(f"{PARAMS_KEY} must be a map")
    return mine


def _count(mine: dict[str, Any], key: str, default: int | None = None) -> int:
    """``mine[key]``: an integer in 0..MAX_COUNT (a bool or a float is none)."""
    value = mine.get(key, default)
    if type(value) is not int or not 0 <= value <= MAX_COUNT:
        raise ValueError(f"{key} must be an integer in 0..{MAX_COUNT}, got {value!r}")
    return value


def _text(mine: dict[str, Any], key: str, default: str | None = None) -> str:
    """``mine[key]``: a string of at most MAX_TEXT characters."""
    value = mine.get(key, default)
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise ValueError(f"{key} must be a string of at most {MAX_TEXT} characters")
    return value


def check_endpoint(endpoint: str) -> str:
    """``endpoint`` if it is a Mooncake session name ``host:port`` (``[v6]:port``) with a port
    in 1..65535 and a host of letters, digits and ``.-:_``; ``ValueError`` otherwise."""
    host, sep, port = endpoint.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    valid_host = 0 < len(host) <= 255 and all(c.isascii() and (c.isalnum() or c in ".-:_")
                                              for c in host)
    if not sep or not valid_host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{endpoint!r} is not a host:port endpoint")
    return endpoint


def pool_file_bytes(path: str) -> int:
    """The size of a decode engine's pool file (a regular file, never through a symlink);
    ``ValueError`` when there is none."""
    try:
        info = os.lstat(shared_pool_path(path))
    except OSError as exc:
        raise ValueError(f"no pool file {path!r}: {exc}") from exc
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{path!r} is not a regular file")
    return info.st_size


def seal_of(req_id: int) -> bytes:
    """The seal that marks request ``req_id``'s buffer complete (never all zero bytes: a
    buffer's seal is zeroed when it is allocated)."""
    return struct.pack("<Q", (req_id & (2**63 - 1)) | 2**63)  # the top bit: never zero


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


def parsed(kind: type[PrefillParams] | type[DecodeParams], params: dict[str, Any] | None,
           bounds: Bounds | None = None) -> Any:
    """``kind.parse(params)`` checked against ``bounds`` (when given), or None (logged) when
    they are malformed or out of bounds: whoever can post to the instance can send
    ``kv_transfer_params``, and a bad one costs that request its transfer (it is computed),
    never the instance."""
    try:
        found = kind.parse(params)
        if found is not None and bounds is not None:
            found.check(bounds)
        return found
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        log.warning("dualpath connector: ignoring malformed kv_transfer_params: %s", exc)
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
    fence_path: str = ""  # the engine's fence table (vllm/fence.py); "" for none
    cache_salt: str = ""  # the request's tenant salt (its keys' salt: ``key_salt``)

    def to_params(self) -> dict[str, Any]:
        """``kv_transfer_params`` that ``parse`` reads back as these (the engine's side)."""
        return {PARAMS_KEY: {
            "role": "prefill", "req_id": self.req_id, "read_path": str(self.read_path),
            "num_hit_blocks": self.num_hit_blocks, "num_pe_read_blocks": self.num_store_blocks,
            "de_endpoint": self.de_endpoint, "de_buffer_addr": self.de_buffer_addr,
            "num_blocks": self.num_blocks, "mode": str(self.mode),
            "cache_salt": self.cache_salt, "fence_path": self.fence_path}}

    @classmethod
    def parse(cls, params: dict[str, Any] | None) -> PrefillParams | None:
        """From ``kv_transfer_params`` (None without ours); ``ValueError`` names a bad field."""
        mine = _ours(params)
        if mine is None:
            return None
        path = ReadPath(_text(mine, "read_path"))
        hit = _count(mine, "num_hit_blocks")
        store = load_blocks(path, hit, _count(mine, "num_pe_read_blocks", 0))
        return cls(_count(mine, "req_id"), path, hit, store,
                   check_endpoint(_text(mine, "de_endpoint")), _count(mine, "de_buffer_addr"),
                   _count(mine, "num_blocks"),
                   PrefillMode(_text(mine, "mode", PrefillMode.LAYERWISE)),
                   fence_table_path(_text(mine, "fence_path", "")),
                   _text(mine, "cache_salt", ""))

    @property
    def blocks(self) -> BlockPlan:
        """The request's loads, pulls and pushes by read path (``kv/block_plan.py``)."""
        return BlockPlan(self.read_path, self.num_hit_blocks, self.num_blocks,
                         self.num_store_blocks)

    def check(self, bounds: Bounds) -> None:
        """``ValueError`` unless the buffer is the prompt's (``num_blocks`` blocks), the hit
        lies inside it and the buffer with its seal inside the address space."""
        want = bounds.blocks(bounds.num_prompt_tokens)
        if self.num_blocks != want:
            raise ValueError(f"num_blocks {self.num_blocks}: the prompt of "
                             f"{bounds.num_prompt_tokens} tokens takes {want}")
        if self.num_hit_blocks > self.num_blocks:
            raise ValueError(f"num_hit_blocks {self.num_hit_blocks} > num_blocks "
                             f"{self.num_blocks}")
        end = self.de_buffer_addr + seal_offset(self.num_blocks, bounds.block_bytes) + SEAL_BYTES
        if self.de_buffer_addr == 0 or end > MAX_ADDRESS:
            raise ValueError(f"de_buffer_addr {self.de_buffer_addr:#x} of {self.num_blocks} "
                             "blocks is outside the address space")


@dataclass
class DecodeParams:
    """Where a decode instance finds a request's prompt KV."""

    req_id: int
    shm_path: str
    buffer_offset: int
    num_blocks: int
    num_tokens: int
    num_stored_blocks: int
    cache_salt: str = ""  # the request's tenant salt (its keys' salt: ``key_salt``)

    def to_params(self) -> dict[str, Any]:
        """``kv_transfer_params`` that ``parse`` reads back as these (the engine's side)."""
        return {PARAMS_KEY: {
            "role": "decode", "req_id": self.req_id, "shm_path": self.shm_path,
            "buffer_offset": self.buffer_offset, "num_blocks": self.num_blocks,
            "num_tokens": self.num_tokens, "num_stored_blocks": self.num_stored_blocks,
            "cache_salt": self.cache_salt}}

    @classmethod
    def parse(cls, params: dict[str, Any] | None) -> DecodeParams | None:
        """From ``kv_transfer_params`` (None without ours); ``ValueError`` names a bad field."""
        mine = _ours(params)
        if mine is None:
            return None
        return cls(_count(mine, "req_id"), shared_pool_path(_text(mine, "shm_path")),
                   _count(mine, "buffer_offset"), _count(mine, "num_blocks"),
                   _count(mine, "num_tokens"), _count(mine, "num_stored_blocks", 0),
                   _text(mine, "cache_salt", ""))

    def check(self, bounds: Bounds) -> None:
        """``ValueError`` unless the buffer's tokens leave a prompt token to compute, its
        ``num_blocks`` hold exactly them, the stored blocks are prompt blocks, and the buffer
        with its seal lies inside the pool file."""
        if self.num_tokens >= bounds.num_prompt_tokens:
            raise ValueError(f"num_tokens {self.num_tokens} leaves none of the "
                             f"{bounds.num_prompt_tokens} prompt tokens to compute")
        if self.num_blocks != bounds.blocks(self.num_tokens):
            raise ValueError(f"num_blocks {self.num_blocks}: {self.num_tokens} tokens take "
                             f"{bounds.blocks(self.num_tokens)}")
        if self.num_stored_blocks > bounds.num_prompt_tokens // bounds.block_size:
            raise ValueError(f"num_stored_blocks {self.num_stored_blocks} exceeds the prompt's "
                             "full blocks")
        end = self.buffer_offset + seal_offset(self.num_blocks, bounds.block_bytes) + SEAL_BYTES
        size = pool_file_bytes(self.shm_path)
        if end > size:
            raise ValueError(f"the buffer [{self.buffer_offset}, {end}) is outside "
                             f"{self.shm_path} ({size} bytes)")


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
        cut = max(start, min(stop, self.params.blocks.num_load_blocks))
        return (start, cut), (cut, stop)

    def pushes(self, num_done: int, block_size: int) -> list[int]:
        """Buffer blocks to push once ``num_done`` prompt tokens have KV: every block the
        buffer lacks (all but the hit blocks the decode engine read itself) not yet pushed
        whole; a partial last block goes now and again, whole, after the next chunk."""
        plan = self.params.blocks
        last = min(-(-num_done // block_size), plan.num_blocks)
        pulled = plan.pulls()  # the decode engine read them into the buffer itself
        blocks = [b for b in range(last) if b not in self.pushed and b not in pulled]
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
    fence_path: str = ""  # the prefill engine's fence table (vllm/fence.py), once known
