"""Attention over a paged KV cache.

The runner hands each layer a cache view of shape ``[num_blocks, block_size, 2, kv_heads,
head_dim]`` (K and V of one token side by side: one row is one token's layer-block bytes) and
an ``AttentionBatch`` that says where each new token's K/V goes and which cache slots each
sequence attends to. New K/V are written first and every sequence then reads its whole context
back from the cache, so a token's attention sees exactly the cached (possibly down-cast) K/V
whether its prefix was computed in this step, an earlier chunk, or loaded from elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSlice:
    """One sequence computing ``q_len`` tokens that attend over ``slot_ids`` (its context)."""

    q_start: int
    q_len: int
    slot_ids: torch.Tensor  # [ctx_len] flat cache slots of the whole context, in order
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, None when plain causal from 0


@dataclass
class DecodeSlice:
    """Sequences computing one token each, batched with padded contexts."""

    token_idx: torch.Tensor  # [B] rows of the flat token batch
    slot_ids: torch.Tensor  # [B, max_ctx] flat cache slots (padding points at slot 0)
    mask: torch.Tensor  # [B, 1, 1, max_ctx] bool, True where the key is attended


@dataclass
class AttentionBatch:
    """Where the step's new K/V go and what each sequence attends to."""

    slot_mapping: torch.Tensor  # [T] flat slot of each new token
    prefills: list[PrefillSlice]
    decode: DecodeSlice | None

    def to(self, device: torch.device) -> AttentionBatch:
        """The same batch with every tensor on ``device``."""
        if self.slot_mapping.device == device:
            return self
        prefills = [PrefillSlice(p.q_start, p.q_len, p.slot_ids.to(device),
                                 None if p.mask is None else p.mask.to(device))
                    for p in self.prefills]
        decode = self.decode and DecodeSlice(self.decode.token_idx.to(device),
                                             self.decode.slot_ids.to(device),
                                             self.decode.mask.to(device))
        return AttentionBatch(self.slot_mapping.to(device), prefills, decode)


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
        q_part = q[part.q_start : part.q_start + part.q_len]
        out[part.q_start : part.q_start + part.q_len] = _prefill(q_part, flat, part, scale)
    if batch.decode is not None:
        out[batch.decode.token_idx] = _decode(q[batch.decode.token_idx], flat, batch.decode,
                                              scale)
    return out


def _prefill(q: torch.Tensor, flat: torch.Tensor, part: PrefillSlice,
             scale: float) -> torch.Tensor:
    kv = flat.index_select(0, part.slot_ids).to(q.dtype)  # [ctx, 2, kvh, hd]
    k = kv[:, 0].transpose(0, 1).unsqueeze(0)
    v = kv[:, 1].transpose(0, 1).unsqueeze(0)
    qh = q.transpose(0, 1).unsqueeze(0)
    if part.mask is None:
        o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale,
                                           enable_gqa=True)
    else:
        o = F.scaled_dot_product_attention(qh, k, v, attn_mask=part.mask, scale=scale,
                                           enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)


def _decode(q: torch.Tensor, flat: torch.Tensor, part: DecodeSlice,
            scale: float) -> torch.Tensor:
    """One query per sequence: plain matmuls (CPU SDPA is slow on bf16 with a mask)."""
    batch, max_ctx = part.slot_ids.shape
    kv_heads, head_dim = flat.shape[2], flat.shape[3]
    kv = flat.index_select(0, part.slot_ids.reshape(-1)).to(q.dtype)
    kv = kv.view(batch, max_ctx, 2, kv_heads, head_dim)
    k = kv[:, :, 0].permute(0, 2, 3, 1)  # [B, kvh, hd, L]
    v = kv[:, :, 1].transpose(1, 2)  # [B, kvh, L, hd]
    qg = q.view(batch, kv_heads, -1, head_dim)  # query heads grouped by their KV head
    scores = torch.matmul(qg, k).float() * scale
    scores.masked_fill_(~part.mask.view(batch, 1, 1, max_ctx), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, v).view(batch, -1, head_dim)
