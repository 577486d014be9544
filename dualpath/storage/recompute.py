"""Recomputing stored KV for an audit: the model prefills a chain's tokens into a cache of its own.

Block k of the chain lands in cache block k, so a stored full block compares directly with
``cache.data[:, k]`` (the bytes ``decode.py``'s ``_gather`` stages for a save). Consecutive
chains that share leading blocks reuse them: only the tokens after the shared prefix run.
The model is loaded once per compute dtype and the cache once per KV layout, whatever the
number of chains.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from dualpath.kv.cache import TORCH_DTYPES, PagedKVCache
from dualpath.kv.layout import KVLayout
from dualpath.model.attention import AttentionBatch, PrefillSlice
from dualpath.model.kernels import load_kernels
from dualpath.model.llama import LlamaForCausalLM
from dualpath.model.loader import load_model
from dualpath.model.spec import ModelSpec


class Recomputer:
    """One model on one device, and a cache that holds a chain of ``num_blocks`` blocks."""

    def __init__(self, model: LlamaForCausalLM, spec: ModelSpec, layout: KVLayout,
                 num_blocks: int, device: str = "cpu", chunk_tokens: int = 512) -> None:
        self.model = model
        self.spec = spec
        self.layout = layout
        self.chunk_tokens = max(layout.block_size, chunk_tokens // layout.block_size
                                * layout.block_size)
        self.cache = PagedKVCache(spec, num_blocks, layout.block_size, layout.dtype, device)
        self._layers = self.cache.layers()
        self._resident: list[bytes] = []  # the hashes of the chain whose KV the cache holds

    @torch.inference_mode()
    def prefill(self, hashes: Sequence[bytes], token_ids: Sequence[int]) -> None:
        """Compute the KV of a chain (its block hashes and all its tokens) into cache blocks
        0, 1, ...; blocks shared with the previous chain are kept, not recomputed."""
        if len(hashes) > self.cache.num_blocks:
            raise ValueError(f"a chain of {len(hashes)} blocks, the cache holds "
                             f"{self.cache.num_blocks}")
        keep = 0
        while keep < min(len(hashes), len(self._resident)) and \
                hashes[keep] == self._resident[keep]:
            keep += 1
        self._resident = []  # until this chain is in
        device = self.cache.data.device
        bs = self.layout.block_size
        ids = torch.tensor(list(token_ids), dtype=torch.long)
        for start in range(keep * bs, len(ids), self.chunk_tokens):
            end = min(len(ids), start + self.chunk_tokens)
            slots = torch.arange(end, dtype=torch.long)  # block k of the chain is cache block k
            batch = AttentionBatch(slots[start:], [PrefillSlice(0, end - start, slots, start,
                                                                self.spec.sliding_window)], None)
            self.model(ids[start:end].to(device), slots[start:].to(device), batch.to(device),
                       self._layers)
        self._resident = list(hashes)

    def block(self, k: int) -> torch.Tensor:
        """Block k of the last chain as stored: ``[layers, tokens, bytes per token per layer]``
        in the KV dtype (a view of the cache)."""
        data = self.cache.data[:, k]
        return data.reshape(data.shape[0], data.shape[1], -1)


def load_for_audit(model_dir: str | Path, spec: ModelSpec, dtype: str, kv_dtype: str,
                   device: str = "cpu", cpu_kernels: bool = True) -> LlamaForCausalLM:
    """The model in compute ``dtype``, on the CPU fast path where the engines take it (packed
    weights; the C kernels when they write the KV dtype, as ``LLMEngine`` decides)."""
    model = load_model(model_dir, TORCH_DTYPES[dtype], spec, device)
    if cpu_kernels and torch.device(device).type == "cpu":
        model.pack_weights()
        if kv_dtype == dtype:
            model.use_kernels(load_kernels())
    return model


def relative_error(stored: torch.Tensor, recomputed: torch.Tensor) -> tuple[float, int]:
    """The largest ``||stored - recomputed|| / ||recomputed||`` over the block's layers (each
    norm over one layer's K and V of every token of the block), with its layer.

    Per layer rather than per token: in bfloat16 a few single rows differ by up to 0.27 from
    the float32 KV (and by up to 0.57 between the C kernels and the torch ops) at contexts of
    2-2.5K tokens on SmolLM2, while every layer stays within 0.045 of it; another block's KV
    differs by 1.07 or more per layer (``verify.py``'s measurements).
    """
    a, b = stored.float().flatten(1), recomputed.float().flatten(1)
    err = torch.nan_to_num((a - b).norm(dim=1) / b.norm(dim=1).clamp_min(1e-12),
                           nan=float("inf"))
    layer = int(err.argmax())
    return float(err[layer]), layer


def token_error(stored: torch.Tensor, recomputed: torch.Tensor,
                parts: int = 2) -> tuple[float, int, int]:
    """The largest error of one token's K or V in the block, with its layer and token: per
    layer, token and part (``parts`` equal runs of a token's bytes: K, then V), the norm of the
    difference over ``max(||recomputed||, the part's RMS norm over the block's tokens)``.

    The per-layer norm of ``relative_error`` dilutes one token among the block's (a token's K
    overwritten is 1/sqrt(2 x tokens) of its layer's norm); this does not. The floor keeps a row
    of small norm from turning rounding into a large relative error, and still counts a small
    row overwritten by a typical one (or the reverse) as a whole token's error.
    """
    layers, tokens = recomputed.shape[0], recomputed.shape[1]
    a = stored.float().reshape(layers, tokens, parts, -1)
    b = recomputed.float().reshape(layers, tokens, parts, -1)
    norms = b.norm(dim=3)
    floor = norms.pow(2).mean(dim=1, keepdim=True).sqrt()
    err = torch.nan_to_num((a - b).norm(dim=3) / torch.maximum(norms, floor).clamp_min(1e-12),
                           nan=float("inf"))
    flat = int(err.argmax())
    layer, token = divmod(flat // parts, tokens)
    return float(err.flatten()[flat]), layer, token
