"""Frozen configuration dataclasses, one per component."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    """How one engine runs its model and sizes its paged KV cache."""

    block_size: int = 64
    kv_cache_mb: int = 512  # device memory for the paged KV cache
    num_kv_blocks: int | None = None  # overrides kv_cache_mb when set
    max_num_seqs: int = 64  # running sequences per step
    max_num_batched_tokens: int = 512  # tokens per step; longer prompts are chunked
    dtype: str = "auto"  # compute dtype: auto (bf16 on CPU with bf16 weights), float32, ...
    kv_dtype: str = "auto"  # KV cache dtype; auto follows the compute dtype
    enable_prefix_caching: bool = True
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N"
    threads: int = 1  # torch intra-op threads (one per engine process, see README)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0:
            raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must be > 0")


@dataclass(frozen=True)
class StorageConfig:
    """Where full KV blocks persist and how this node's storage NIC is emulated."""

    backend: str = "fs"  # fs | memory
    root: str = ".cache/kv-store"  # a local disk or a shared POSIX mount
    capacity_gb: float | None = None  # LRU-evict whole suffixes beyond this
    fsync: bool = False  # fsync each block (and its directory) before it counts as written
    o_direct: bool = False  # read with O_DIRECT into aligned buffers (bypass the page cache)
    workers: int = 4  # parallel reads/writes per client
    read_cap_mb_s: float | None = None  # storage-NIC read cap (MB/s); None = uncapped
    write_cap_mb_s: float | None = None  # storage-NIC write cap (MB/s); None = uncapped
