"""The paged KV cache in device memory (HBM on CUDA, RAM on the CPU).

One tensor ``[layers, num_blocks, block_size, 2, kv_heads, head_dim]``: for each layer and
block, one row per token holding its K and V side by side, so layer i of block b is one
contiguous *layer block* of ``block_size × bytes_per_token_per_layer`` bytes.

A layerwise prefill engine holds a *window* of W layers instead (docs/design.md §9): the tensor is
``[W, num_blocks, ...]`` and layer i lives in window slot ``i mod W``, reused by layer i+W once
layer i's KV has left for the decode side. The same device bytes then hold ``layers / W``
times the blocks.
"""

from __future__ import annotations

import torch

from dualpath.kv.layout import KVLayout
from dualpath.model.spec import DTYPE_BYTES, ModelSpec

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PagedKVCache:
    """Device storage for ``num_blocks`` blocks of every layer (or of a window of layers)."""

    def __init__(self, spec: ModelSpec, num_blocks: int, block_size: int, kv_dtype: str,
                 device: str | torch.device = "cpu", layer_window: int | None = None) -> None:
        if kv_dtype not in DTYPE_BYTES:
            raise ValueError(f"unsupported kv dtype {kv_dtype!r}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_layers = spec.num_layers
        self.resident_layers = KVLayout.from_spec(spec, kv_dtype, block_size).resident_layers(
            layer_window)
        self.data = torch.zeros(
            self.resident_layers, num_blocks, block_size, 2, spec.num_kv_heads, spec.head_dim,
            dtype=TORCH_DTYPES[kv_dtype], device=device,
        )

    @property
    def is_window(self) -> bool:
        """True when fewer layers than the model's are resident."""
        return self.resident_layers < self.num_layers

    def layer_slot(self, layer_idx: int) -> int:
        """The resident slot that holds layer ``layer_idx``."""
        return layer_idx % self.resident_layers

    def layer(self, layer_idx: int) -> torch.Tensor:
        """View ``[num_blocks, block_size, 2, kv_heads, head_dim]`` of one layer."""
        return self.data[self.layer_slot(layer_idx)]

    def layers(self) -> list[torch.Tensor]:
        """Per-layer views, in layer order (what the model's forward takes); with a window,
        layers i and i+W share a slot."""
        return [self.layer(i) for i in range(self.num_layers)]
