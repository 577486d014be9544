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
                       workers=config.workers, capacity_bytes=capacity,
                       by_sessions=config.session_retention)
    if config.backend == "memory":
        from dualpath.storage.memory import MemoryStore

        return MemoryStore(layout.full_block_bytes, capacity)
    if config.backend == "mooncake_store":
        return _open_mooncake_store(config, layout)
    raise ValueError(f"unknown storage backend {config.backend!r} (fs, memory, mooncake_store)")


def _open_mooncake_store(config: StorageConfig, layout: KVLayout) -> StorageBackend:
    """A Mooncake Store client; its capacity is the segments' memory, not ``capacity_gb``."""
    if config.capacity_gb is not None:
        raise ValueError("capacity_gb does not apply to mooncake_store: its capacity is the "
                         "memory of its segment holders (the master evicts when they fill)")
    from dualpath.storage.mooncake_store import MooncakeStore

    return MooncakeStore(layout, master=config.mooncake_master,
                         metadata_server=config.mooncake_metadata_server,
                         local_host=config.mooncake_local_host,
                         protocol=config.mooncake_protocol,
                         device_name=config.mooncake_device_name,
                         segment_mb=config.mooncake_segment_mb,
                         local_buffer_mb=config.mooncake_local_buffer_mb,
                         key_prefix=config.mooncake_key_prefix)
