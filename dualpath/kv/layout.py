"""KV block layouts (pure): full blocks for storage, layer blocks for streaming.

A *layer block* is one layer's K and V for ``block_size`` tokens, shape
``[1, tokens, bytes_per_token_per_layer]``; per token the bytes are K (all KV heads) then V.
A *full block* is all layers, ``[layers, tokens, bytes_per_token_per_layer]``, and is exactly
its layer blocks concatenated in layer order — so a full block read from storage is streamed
layer by layer with no conversion, and layer i sits at ``i × layer_block_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.kv.hashing import KeySpace
from dualpath.model.spec import DTYPE_BYTES, ModelSpec, resolve_dtype, resolve_kv_dtype
from dualpath.vocab import EngineKind


@dataclass(frozen=True)
class KVLayout:
    """Sizes and offsets of the KV blocks of one model, dtype and block size."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}")
        if min(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size) <= 0:
            raise ValueError("layout sizes must be positive")

    @classmethod
    def from_spec(cls, spec: ModelSpec, kv_dtype: str, block_size: int) -> KVLayout:
        """The layout of ``spec``'s KV cache."""
        return cls(spec.num_layers, spec.num_kv_heads, spec.head_dim, kv_dtype, block_size)

    @property
    def layout_id(self) -> str:
        """Names the byte layout (part of every storage key)."""
        return (f"kv-{self.dtype}-L{self.num_layers}-kvh{self.num_kv_heads}-hd{self.head_dim}"
                f"-bs{self.block_size}")

    @property
    def vllm_layout_id(self) -> str:
        """vLLM CPU's head-major layout (``LBHNC``: per block and KV head, the keys of every
        token, then the values): what the vLLM connector stores. Same sizes as ours, never the
        same id, so neither side reads the other's bytes. How the keys are packed inside a
        head's run is the attention kernel's choice (vLLM's ``vec`` stores them as
        ``[head_dim, block_size]``; ``amx`` packs them for its tiles), which this id does not
        name: ``store verify`` cannot lay out recomputed KV this way, and says so."""
        return (f"vllm-LBHNC-{self.dtype}-L{self.num_layers}-kvh{self.num_kv_heads}"
                f"-hd{self.head_dim}-bs{self.block_size}")

    @property
    def bytes_per_token_per_layer(self) -> int:
        """K and V of one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def layer_block_bytes(self) -> int:
        """One layer of one block."""
        return self.block_size * self.bytes_per_token_per_layer

    @property
    def full_block_bytes(self) -> int:
        """All layers of one block."""
        return self.num_layers * self.layer_block_bytes

    @property
    def full_block_shape(self) -> tuple[int, int, int]:
        """``[layers, tokens, bytes]``."""
        return (self.num_layers, self.block_size, self.bytes_per_token_per_layer)

    @property
    def layer_block_shape(self) -> tuple[int, int, int]:
        """``[1, tokens, bytes]``."""
        return (1, self.block_size, self.bytes_per_token_per_layer)

    def blocks_in(self, budget_mb: int, resident_layers: int | None = None) -> int:
        """How many blocks fit in ``budget_mb`` MiB (at least one) when ``resident_layers`` of
        the model's layers are held per block (all of them by default)."""
        return self.blocks_for_bytes(budget_mb * 2**20, resident_layers)

    def blocks_for_bytes(self, budget_bytes: int, resident_layers: int | None = None) -> int:
        """How many blocks fit in ``budget_bytes`` (at least one) holding ``resident_layers``
        layers each: a layerwise prefill engine that keeps a window of W layers fits
        ``num_layers / W`` times the blocks of one that keeps them all."""
        layers = self.resident_layers(resident_layers)
        return max(1, budget_bytes // (layers * self.layer_block_bytes))

    def cache_blocks(self, num_kv_blocks: int | None, kv_cache_mb: int,
                     layer_window: int | None = None) -> int:
        """Blocks of a device-KV budget given as ``num_kv_blocks`` full blocks' worth of bytes
        (exactly that many without a window) or else ``kv_cache_mb`` MiB."""
        if num_kv_blocks is not None and layer_window is None:
            return num_kv_blocks
        if num_kv_blocks is not None:
            return self.blocks_for_bytes(num_kv_blocks * self.full_block_bytes, layer_window)
        return self.blocks_in(kv_cache_mb, layer_window)

    def resident_layers(self, window: int | None) -> int:
        """Layers held in device memory for a layer window (None: all of them)."""
        if window is not None and window < 1:
            raise ValueError(f"a layer window holds at least one layer, got {window}")
        return self.num_layers if window is None else min(window, self.num_layers)

    def layer_offset(self, layer_idx: int) -> int:
        """Byte offset of layer ``layer_idx`` inside a full block."""
        if not 0 <= layer_idx < self.num_layers:
            raise IndexError(f"layer {layer_idx} out of range [0, {self.num_layers})")
        return layer_idx * self.layer_block_bytes

    def layer_view(self, full_block: memoryview, layer_idx: int) -> memoryview:
        """Layer ``layer_idx`` of a full-block buffer, without a copy."""
        view = memoryview(full_block).cast("B")
        if view.nbytes != self.full_block_bytes:
            raise ValueError(f"buffer holds {view.nbytes} bytes, a full block "
                             f"{self.full_block_bytes}")
        start = self.layer_offset(layer_idx)
        return view[start : start + self.layer_block_bytes]


    # -- a decode engine's prompt buffer ------------------------------------------------------
    def buffer_shape(self, num_blocks: int) -> tuple[int, int, int]:
        """A prompt buffer of ``num_blocks`` blocks as ``[layers, blocks, layer_block_bytes]``:
        layer-major, so layer i of every block is one stretch (``buffer_offset``)."""
        return self.num_layers, num_blocks, self.layer_block_bytes


# A prompt buffer (the decode engine's, which the prefill side fills): layer ``l`` of block ``j``
# at ``(l × num_blocks + j) × layer_block_bytes``; after the data, at
# ``num_blocks × full_block_bytes``, a seal of SEAL_BYTES the prefill writes last (vLLM's
# connector: ``integrations/vllm/plan.py``). Our engines and the connector both use these.
SEAL_BYTES = 8


def buffer_offset(layer: int, block: int, num_blocks: int, layer_block_bytes: int) -> int:
    """Layer ``layer`` of block ``block`` in a layer-major buffer of ``num_blocks`` blocks."""
    return (layer * num_blocks + block) * layer_block_bytes


def seal_offset(num_blocks: int, full_block_bytes: int) -> int:
    """Where a buffer of ``num_blocks`` blocks keeps its seal, from its start."""
    return num_blocks * full_block_bytes


def engine_layout(spec: ModelSpec, dtype: str, kv_dtype: str, block_size: int,
                  engine_kind: str = EngineKind.DUALPATH) -> KVLayout:
    """The KV layout an engine of ``engine_kind`` keeps ``spec``'s blocks in: the compute dtype
    (``auto``: the checkpoint's half type, else float32), then the KV dtype (``auto``: the
    compute dtype; a vLLM instance's KV always follows its dtype), then the block sizes. The
    router, our engines and the vLLM parts derive it here, so they agree."""
    compute = resolve_dtype(dtype, spec)
    kv = compute if EngineKind(engine_kind) == EngineKind.VLLM else resolve_kv_dtype(kv_dtype,
                                                                                       compute)
    return KVLayout.from_spec(spec, kv, block_size)


def key_space_for(model: str, layout: KVLayout,
                  engine_kind: str = EngineKind.DUALPATH) -> KeySpace:
    """The storage keys of a model (its fingerprint ``model``) in an engine kind's layout: ours
    under ``layout_id``, a vLLM instance's own bytes under ``vllm_layout_id``
    (docs/vllm-connector.md), so neither side reads the other's."""
    layout_id = (layout.vllm_layout_id if EngineKind(engine_kind) == EngineKind.VLLM
                 else layout.layout_id)
    return KeySpace(model, layout_id, layout.block_size)
