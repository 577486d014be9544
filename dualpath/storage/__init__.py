"""KV storage: full blocks in a durable store, behind a batch-first interface.

Backends import lazily, so ``import dualpath.storage`` needs no optional package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dualpath.config import StorageConfig
    from dualpath.kv.layout import KVLayout
    from dualpath.storage.base import StorageBackend


def open_store(config: StorageConfig, layout: KVLayout) -> StorageBackend:
    """The backend ``config.backend`` names, set up for ``layout``'s full blocks."""
    capacity = None if config.capacity_gb is None else round(config.capacity_gb * 1e9)
    if config.backend == "fs":
        from dualpath.storage.fs import FsStore

        return FsStore(config.root, layout, fsync=config.fsync, o_direct=config.o_direct,
                       workers=config.workers, capacity_bytes=capacity)
    if config.backend == "memory":
        from dualpath.storage.memory import MemoryStore

        return MemoryStore(layout.full_block_bytes, capacity)
    raise ValueError(f"unknown storage backend {config.backend!r} (fs, memory)")
