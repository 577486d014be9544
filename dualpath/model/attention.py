"""Attention over a paged KV cache: the batch metadata and the torch reference ops.

The runner hands each layer a cache view of shape ``[num_blocks, block_size, 2, kv_heads,
head_dim]`` (K and V of one token side by side: one row is one token's layer-block bytes) and
an ``AttentionBatch`` that says where each new token's K/V goes and which cache slots each
sequence attends to. New K/V are written first and every sequence then reads its whole context
back from the cache, so a token's attention sees exactly the cached (possibly down-cast) K/V
whether its prefix was computed in this step, an earlier chunk, or loaded from elsewhere.

The functions here are the plain-torch path (and the reference the C kernels of
``model/kernels.py`` and the GPU path of ``model/attention_flex.py`` are tested against); both
read the same metadata. ``upload`` moves a step's host-built index tensors to the device in one
non-blocking copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
import torch.nn.functional as F


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """``[q, k]`` True where a query at ``q_pos`` attends the key at ``k_pos`` (causal, and
    within ``window`` positions when one is set)."""
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return mask


@dataclass
class PrefillSlice:
    """One sequence computing ``q_len`` tokens, rows ``q_start..`` of the step, at positions
    ``pos0..pos0 + q_len`` over its context, whose cache slots are ``slot_ids``."""

    q_start: int
    q_len: int
    slot_ids: torch.Tensor  # [ctx_len] flat cache slots of the whole context, in order
    pos0: int = 0  # position of the first query (the tokens before it are cached)
    window: int | None = None  # sliding-window size, None for full attention

    def mask(self) -> torch.Tensor | None:
        """``[q_len, ctx_len]`` bool, or None when plain causal attention from position 0."""
        ctx = self.slot_ids.shape[0]
        if self.pos0 == 0 and (self.window is None or ctx <= self.window):
            return None
        k_pos = torch.arange(ctx, device=self.slot_ids.device)
        return window_mask(k_pos[self.pos0 :], k_pos, self.window)


@dataclass
class DecodeSlice:
    """Sequences computing one token each: their rows in the step and their paged contexts."""

    token_idx: torch.Tensor  # [B] int64: rows of the flat token batch
    block_table: torch.Tensor  # [B, max_blocks] int32 (padding: block 0)
    ctx_lens: torch.Tensor  # [B] int32: tokens of each context, the new one included
    block_size: int
    window: int | None = None
    # the longest context, known on the host when the slice is built: the reference path sizes
    # its gather with it rather than reading ``ctx_lens.max()`` back from the device each layer
    max_ctx: int | None = None

    @classmethod
    def build(cls, rows: list[int], tables: list[list[int]], ctx_lens: list[int],
              block_size: int, window: int | None) -> DecodeSlice:
        """The slice of sequences whose query is in row ``rows[b]``, with block table
        ``tables[b]`` (at least ``ctx_lens[b]`` tokens' worth)."""
        width = max(-(-n // block_size) for n in ctx_lens)
        padded = [t[:width] + [0] * (width - len(t[:width])) for t in tables]
        return cls(torch.tensor(rows, dtype=torch.long),
                   torch.tensor(padded, dtype=torch.int32),
                   torch.tensor(ctx_lens, dtype=torch.int32), block_size, window, max(ctx_lens))

    def longest(self) -> int:
        """The longest context in tokens (host-known, else read back from the device)."""
        return self.max_ctx if self.max_ctx is not None else int(self.ctx_lens.max())

    def slot_ids(self) -> torch.Tensor:
        """``[B, max_ctx]`` flat cache slot of every context position (padding: slot 0's)."""
        max_ctx = self.longest()
        pos = torch.arange(max_ctx, device=self.block_table.device)
        blocks = self.block_table.long()[:, pos // self.block_size]
        return blocks * self.block_size + pos % self.block_size

    def mask(self) -> torch.Tensor:
        """``[B, max_ctx]`` bool: which keys each query attends (also hides the padding)."""
        k_pos = torch.arange(self.longest(), device=self.ctx_lens.device)
        return window_mask(self.ctx_lens.long() - 1, k_pos, self.window)

    def to(self, device: torch.device) -> DecodeSlice:
        """The same slice with its tensors on ``device``."""
        return DecodeSlice(self.token_idx.to(device), self.block_table.to(device),
                           self.ctx_lens.to(device), self.block_size, self.window, self.max_ctx)


@dataclass(frozen=True)
class KernelMeta:
    """An ``AttentionBatch`` as the C kernels' ``attend`` takes it: addresses and counts,
    with the tensors behind them kept alive (each in the dtype the kernels read, contiguous).
    The counts let the kernels check every index before they write: ``num_tokens`` slots, and
    block tables of ``table_width`` entries."""

    num_tokens: int
    slot_ptr: int
    num_prefills: int
    prefill_ptr: int  # int64 [num_prefills, 5]: q_start, q_len, pos0, ctx, slot_ids address
    num_decodes: int
    rows_ptr: int
    table_ptr: int
    table_stride: int
    table_width: int
    ctx_ptr: int
    keep: tuple[torch.Tensor, ...]


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


@dataclass
class AttentionBatch:
    """Where the step's new K/V go and what each sequence attends to."""

    slot_mapping: torch.Tensor  # [T] flat slot of each new token
    prefills: list[PrefillSlice]
    decode: DecodeSlice | None
    # the GPU path's per-step plan (``attention_flex.plan_for``), built on the first layer
    flex: Any = field(default=None, repr=False, compare=False)

    @cached_property
    def kernel_meta(self) -> KernelMeta:
        """This batch for the C kernels (built once, on the first layer, for every layer)."""
        slots = _as(self.slot_mapping, torch.long)
        contexts = [_as(p.slot_ids, torch.long) for p in self.prefills]
        rows = [[p.q_start, p.q_len, p.pos0, c.shape[0], c.data_ptr()]
                for p, c in zip(self.prefills, contexts, strict=True)]
        prefill = torch.tensor(rows or [[0] * 5], dtype=torch.long)
        d = self.decode
        keep = (slots, prefill, *contexts)
        head = (slots.shape[0], slots.data_ptr(), len(rows), prefill.data_ptr())
        if d is None:
            return KernelMeta(*head, 0, 0, 0, 0, 0, 0, keep)
        token_idx, ctx_lens = _as(d.token_idx, torch.long), _as(d.ctx_lens, torch.int32)
        table = _as(d.block_table, torch.int32)
        if table.dim() != 2 or not table.shape[0] == ctx_lens.shape[0] == token_idx.shape[0]:
            raise ValueError(f"decode slice of {token_idx.shape[0]} rows with block tables "
                             f"{tuple(table.shape)} and {ctx_lens.shape[0]} context lengths")
        return KernelMeta(*head, token_idx.shape[0], token_idx.data_ptr(), table.data_ptr(),
                          table.stride(0), table.shape[1], ctx_lens.data_ptr(),
                          (*keep, token_idx, table, ctx_lens))

    def to(self, device: torch.device) -> AttentionBatch:
        """The same batch with every tensor on ``device``."""
        if self.slot_mapping.device == device:
            return self
        prefills = [PrefillSlice(p.q_start, p.q_len, p.slot_ids.to(device), p.pos0, p.window)
                    for p in self.prefills]
        decode = self.decode and self.decode.to(device)
        return AttentionBatch(self.slot_mapping.to(device), prefills, decode)


def upload(parts: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """1-D int64 host tensors on ``device``: packed into one buffer (pinned where CUDA is),
    copied with one non-blocking transfer, handed back as views of the device copy. On the
    CPU the tensors come back as they are."""
    device = torch.device(device)
    if device.type == "cpu":
        return parts
    sizes = [p.numel() for p in parts]
    host = torch.cat([p.reshape(-1).to(torch.long) for p in parts]) if parts else \
        torch.empty(0, dtype=torch.long)
    if torch.cuda.is_available():
        host = host.pin_memory()
    return list(host.to(device, non_blocking=True).split(sizes))


def write_kv(kv_layer: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Store new keys/values ``[T, kv_heads, head_dim]`` into their cache slots."""
    flat = kv_layer.view(-1, *kv_layer.shape[2:])
    flat.index_copy_(0, slot_mapping, torch.stack((k, v), dim=1).to(flat.dtype))


def paged_attention(q: torch.Tensor, kv_layer: torch.Tensor, batch: AttentionBatch,
                    scale: float) -> torch.Tensor:
    """Attention output ``[T, heads, head_dim]`` for queries ``q`` of the same shape."""
    flat = kv_layer.view(-1, *kv_layer.shape[2:])
    out = torch.empty_like(q)
    for part in batch.prefills:
        rows = slice(part.q_start, part.q_start + part.q_len)
        out[rows] = prefill_reference(q[rows], flat, part, scale)
    if batch.decode is not None:
        idx = batch.decode.token_idx
        out[idx] = decode_reference(q[idx], flat, batch.decode, scale)
    return out


def prefill_reference(q: torch.Tensor, flat: torch.Tensor, part: PrefillSlice,
                      scale: float) -> torch.Tensor:
    """One sequence's queries ``[q_len, heads, head_dim]`` over its context (SDPA)."""
    kv = flat.index_select(0, part.slot_ids).to(q.dtype)  # [ctx, 2, kvh, hd]
    k = kv[:, 0].transpose(0, 1).unsqueeze(0)
    v = kv[:, 1].transpose(0, 1).unsqueeze(0)
    qh = q.transpose(0, 1).unsqueeze(0)
    mask = part.mask()
    if mask is None:
        o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale,
                                           enable_gqa=True)
    else:
        o = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale,
                                           enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)


def decode_reference(q: torch.Tensor, flat: torch.Tensor, part: DecodeSlice,
                     scale: float) -> torch.Tensor:
    """One query per sequence ``[B, heads, head_dim]``: plain matmuls over the gathered,
    padded contexts (CPU SDPA is slow on bf16 with a mask)."""
    slot_ids = part.slot_ids()
    batch, max_ctx = slot_ids.shape
    kv_heads, head_dim = flat.shape[2], flat.shape[3]
    kv = flat.index_select(0, slot_ids.reshape(-1)).to(q.dtype)
    kv = kv.view(batch, max_ctx, 2, kv_heads, head_dim)
    k = kv[:, :, 0].permute(0, 2, 3, 1)  # [B, kvh, hd, L]
    v = kv[:, :, 1].transpose(1, 2)  # [B, kvh, L, hd]
    qg = q.reshape(batch, kv_heads, -1, head_dim)  # query heads grouped by their KV head
    scores = torch.matmul(qg, k).float() * scale
    scores.masked_fill_(~part.mask().view(batch, 1, 1, max_ctx), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, v).view(batch, -1, head_dim)
