"""The paged KV cache in device memory (HBM on CUDA, RAM on the CPU).

One tensor ``[layers, num_blocks, block_size, 2, kv_heads, head_dim]``: for each layer and
block, one row per token holding its K and V side by side, so layer i of block b is one
contiguous *layer block* of ``block_size × bytes_per_token_per_layer`` bytes.
"""

from __future__ import annotations

import torch

from dualpath.kv.layout import KVLayout
from dualpath.model.spec import DTYPE_BYTES, ModelSpec

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def blocks_for_budget(spec: ModelSpec, block_size: int, kv_dtype: str, budget_mb: int) -> int:
    """How many blocks fit in ``budget_mb`` MiB."""
    return KVLayout.from_spec(spec, kv_dtype, block_size).blocks_in(budget_mb)


class PagedKVCache:
    """Device storage for ``num_blocks`` blocks of every layer."""

    def __init__(self, spec: ModelSpec, num_blocks: int, block_size: int, kv_dtype: str,
                 device: str | torch.device = "cpu") -> None:
        if kv_dtype not in DTYPE_BYTES:
            raise ValueError(f"unsupported kv dtype {kv_dtype!r}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.data = torch.zeros(
            spec.num_layers, num_blocks, block_size, 2, spec.num_kv_heads, spec.head_dim,
            dtype=TORCH_DTYPES[kv_dtype], device=device,
        )

    def layer(self, layer_idx: int) -> torch.Tensor:
        """View ``[num_blocks, block_size, 2, kv_heads, head_dim]`` of one layer."""
        return self.data[layer_idx]

    def layers(self) -> list[torch.Tensor]:
        """Per-layer views, in layer order (what the model's forward takes)."""
        return list(self.data.unbind(0))
