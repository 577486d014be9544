"""The flex block masks of a step over the paged cache (``attention_flex.py`` runs them).

A ``BlockMask`` whose KV block is one cache block lists, per query block, the cache blocks
its sequences own; its ``mask_mod`` maps a physical slot back to its logical position through
``p2l`` to apply causality, the sequence's length and the sliding window. Decode rows get one
mask from their block tables on the device; prefill chunks are packed into one flat query,
each from a query block boundary, with the blocks every row of a query block sees in full
listed as full blocks. Block lists are ``num_blocks`` wide, and decode batches, packed prefill
lengths and chunk counts are padded to powers of two, so compiled kernels see few shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

from dualpath.model.attention import AttentionBatch, PrefillSlice, upload

Q_BLOCK_TOKENS = 128  # query rows per flex query block (the kernels' tile)


def decode_bucket(batch: int) -> int:
    """The padded batch size a decode of ``batch`` rows runs at: the next power of two."""
    return 1 << max(0, batch - 1).bit_length()


@dataclass
class DecodePlan:
    """The decode rows: ``rows`` of the step, padded to ``padded`` queries."""

    rows: torch.Tensor  # [B] int64
    padded: int
    block_mask: BlockMask


@dataclass
class PrefillPlan:
    """Prefill chunks over a cached prefix (or a window), packed into one flat query: each
    chunk from a query block boundary, so a query block never mixes chunks."""

    rows: torch.Tensor  # [Tr] int64: the chunks' rows of the step
    at: torch.Tensor  # [Tr] int64: where each lands in the packed query
    source: torch.Tensor  # [Tp] int64: the step row each packed row is read from
    block_mask: BlockMask


def decode_plan(batch: AttentionBatch, num_blocks: int, block_size: int) -> DecodePlan:
    """Device-only: the decode rows' block mask from their block tables and lengths."""
    d = batch.decode
    assert d is not None
    rows = d.token_idx.long()
    padded = decode_bucket(rows.shape[0])
    ctx, table = _pad_rows(d.ctx_lens.long(), padded), _pad_rows(d.block_table.long(), padded)
    lo = (ctx - d.window).clamp(min=0) if d.window is not None else torch.zeros_like(ctx)
    owned = (ctx + block_size - 1) // block_size  # blocks holding the context
    first = lo // block_size  # the first block the window reaches
    kv_num = (owned - first).clamp(min=0).to(torch.int32).view(padded, 1, 1)
    # the block list is num_blocks wide whatever the tables' width: one shape per batch size
    cols = torch.arange(num_blocks, device=table.device)
    shifted = (first[:, None] + cols[None, :]).clamp(max=table.shape[1] - 1)
    kv_idx = table.gather(1, shifted).to(torch.int32).view(padded, 1, 1, num_blocks)
    p2l = physical_to_logical(table, owned, num_blocks)

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                 kv_idx: torch.Tensor) -> torch.Tensor:
        logical = p2l[b, kv_idx // block_size]
        pos = logical * block_size + kv_idx % block_size
        return (logical >= 0) & (pos < ctx[b]) & (pos >= lo[b])

    mask = BlockMask.from_kv_blocks(kv_num, kv_idx, BLOCK_SIZE=(Q_BLOCK_TOKENS, block_size),
                                    mask_mod=mask_mod, seq_lengths=(1, num_blocks * block_size),
                                    compute_q_blocks=False)
    return DecodePlan(rows, padded, mask)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows`` (a padded row has an empty context)."""
    if t.shape[0] == rows:
        return t
    return torch.cat((t, t.new_zeros(rows - t.shape[0], *t.shape[1:])))


def physical_to_logical(tables: torch.Tensor, owned: torch.Tensor,
                        num_blocks: int) -> torch.Tensor:
    """``[B, num_blocks + 1]`` int32: the logical index of each cache block in sequence b's
    table (its first ``owned[b]`` entries), -1 for blocks it does not own (the last column
    takes the table's padding)."""
    rows, width = tables.shape
    cols = torch.arange(width, device=tables.device)
    target = torch.where(cols[None, :] < owned[:, None], tables, num_blocks)
    p2l = torch.full((rows, num_blocks + 1), -1, dtype=torch.int32, device=tables.device)
    return p2l.scatter_(1, target, cols.to(torch.int32).expand(rows, width).contiguous())


def prefill_plan(chunks: list[PrefillSlice], num_blocks: int, block_size: int,
                  device: torch.device) -> PrefillPlan:
    """The packed prefill: host index arithmetic on the slices' ints, one upload, then
    gathers of the block tables (``slot_ids`` every ``block_size``-th entry) on the device."""
    spans = _spans(chunks, block_size)
    packed = packed_length(spans)
    rows, at, source, docs, positions = _packed_rows(chunks, spans, packed)
    partial, full = prefill_blocks(spans, packed, block_size, chunks[0].window)
    col_doc = torch.cat([torch.full((s.blocks,), i, dtype=torch.long)
                         for i, s in enumerate(spans)])
    col_j = torch.cat([torch.arange(s.blocks) for s in spans])
    host = [rows, at, source, docs, positions, col_doc, col_j, partial[0],
            partial[1].reshape(-1), full[0], full[1].reshape(-1)]
    (rows, at, source, docs, positions, col_doc, col_j, p_num, p_idx, f_num,
     f_idx) = upload(host, device)
    tables = torch.cat([c.slot_ids[::block_size] // block_size for c in chunks])  # [L]
    p2l = torch.full((decode_bucket(len(chunks)), num_blocks + 1), -1, dtype=torch.int32,
                     device=device)
    p2l.view(-1).scatter_(0, col_doc * (num_blocks + 1) + tables, col_j.to(torch.int32))
    window = chunks[0].window

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                 kv_idx: torch.Tensor) -> torch.Tensor:
        q_pos = positions[q_idx]  # -1 on padding rows: they see nothing
        logical = p2l[docs[q_idx], kv_idx // block_size]
        k_pos = logical * block_size + kv_idx % block_size
        keep = (logical >= 0) & (k_pos <= q_pos)
        if window is not None:
            keep &= k_pos > q_pos - window
        return keep

    q_blocks = packed // Q_BLOCK_TOKENS
    mask = BlockMask.from_kv_blocks(
        p_num.to(torch.int32).view(1, 1, q_blocks),
        _physical(tables, p_idx, q_blocks, num_blocks),
        f_num.to(torch.int32).view(1, 1, q_blocks),
        _physical(tables, f_idx, q_blocks, num_blocks),
        BLOCK_SIZE=(Q_BLOCK_TOKENS, block_size), mask_mod=mask_mod,
        seq_lengths=(packed, num_blocks * block_size), compute_q_blocks=False)
    return PrefillPlan(rows, at, source, mask)


def _physical(tables: torch.Tensor, idx: torch.Tensor, q_blocks: int,
              num_blocks: int) -> torch.Tensor:
    """Block-list positions in the concatenated tables as cache blocks ``[1, 1, Q,
    num_blocks]`` int32 (one width whatever the step: compiled kernels see one shape)."""
    blocks = tables[idx].to(torch.int32).view(q_blocks, -1)
    return F.pad(blocks, (0, num_blocks - blocks.shape[1])).view(1, 1, q_blocks, num_blocks)


@dataclass(frozen=True)
class Span:
    """One packed prefill chunk: packed rows ``start..start + length`` (``start`` on a query
    block boundary) at positions ``pos0..``, its table's ``blocks`` in the concatenated
    tables from ``offset``."""

    start: int
    length: int
    pos0: int
    blocks: int
    offset: int


def _spans(chunks: list[PrefillSlice], block_size: int) -> list[Span]:
    spans, start, offset = [], 0, 0
    for c in chunks:
        blocks = -(-c.slot_ids.shape[0] // block_size)
        spans.append(Span(start, c.q_len, c.pos0, blocks, offset))
        start += -(-c.q_len // Q_BLOCK_TOKENS) * Q_BLOCK_TOKENS
        offset += blocks
    return spans


def packed_length(spans: list[Span]) -> int:
    """Rows of the packed query: every chunk from a query block boundary, the total padded
    to a power of two of query blocks (compiled kernels see a few lengths)."""
    last = spans[-1]
    used = -(-(last.start + last.length) // Q_BLOCK_TOKENS)
    return decode_bucket(used) * Q_BLOCK_TOKENS


def _packed_rows(chunks: list[PrefillSlice], spans: list[Span],
                 packed: int) -> tuple[torch.Tensor, ...]:
    """Host index tensors of the packed query: the step's ``rows`` and where each lands
    (``at``); for every packed row, the step row it is read from (``source``: padding reads
    the chunk's first row), its chunk (``docs``) and its position (``positions``, -1 on
    padding)."""
    rows = torch.cat([torch.arange(c.q_start, c.q_start + c.q_len) for c in chunks])
    at = torch.cat([torch.arange(s.start, s.start + s.length) for s in spans])
    source = torch.full((packed,), chunks[0].q_start, dtype=torch.long)
    docs = torch.zeros(packed, dtype=torch.long)
    positions = torch.full((packed,), -1, dtype=torch.long)
    for i, (c, s) in enumerate(zip(chunks, spans, strict=True)):
        end = s.start + -(-s.length // Q_BLOCK_TOKENS) * Q_BLOCK_TOKENS
        source[s.start : end] = c.q_start
        docs[s.start : end] = i
    source[at] = rows
    positions[at] = torch.cat([torch.arange(c.pos0, c.pos0 + c.q_len) for c in chunks])
    return rows, at, source, docs, positions


BlockList = tuple[torch.Tensor, torch.Tensor]  # per query block: count, then indices


def prefill_blocks(spans: list[Span], packed: int, block_size: int,
                   window: int | None) -> tuple[BlockList, BlockList]:
    """Which cache blocks each query block of the packed prefill visits, as positions in the
    concatenated block tables: ``(partial, full)``, each ``(count [Q], indices [Q, K])``.
    Every query block holds one chunk's rows (and padding, which sees nothing); a block is
    full when every row of the chunk in that query block sees all of its slots, partial when
    some row sees some of them (the mask decides per slot)."""
    q_blocks = packed // Q_BLOCK_TOKENS
    total = sum(s.blocks for s in spans)
    partial = torch.zeros(q_blocks, total, dtype=torch.bool)
    full = torch.zeros(q_blocks, total, dtype=torch.bool)
    for s in spans:
        first, last = s.start // Q_BLOCK_TOKENS, (s.start + s.length - 1) // Q_BLOCK_TOKENS
        qb = torch.arange(first, last + 1)
        r0 = qb * Q_BLOCK_TOKENS
        r1 = torch.clamp((qb + 1) * Q_BLOCK_TOKENS, max=s.start + s.length) - 1
        p_min, p_max = s.pos0 + r0 - s.start, s.pos0 + r1 - s.start
        j = torch.arange(s.blocks)
        lo = (p_min - window + 1).clamp(min=0) if window is not None else torch.zeros_like(p_min)
        seen = (j[None, :] >= (lo // block_size)[:, None]) & \
            (j[None, :] <= (p_max // block_size)[:, None])
        whole = seen & (((j + 1) * block_size - 1)[None, :] <= p_min[:, None])
        if window is not None:
            whole &= (j * block_size)[None, :] > (p_max - window)[:, None]
        cols = slice(s.offset, s.offset + s.blocks)
        full[first : last + 1, cols] = whole
        partial[first : last + 1, cols] = seen & ~whole
    return _ordered(partial), _ordered(full)


def _ordered(dense: torch.Tensor) -> BlockList:
    """A ``[Q, L]`` bool block matrix as per-row counts and the true columns first."""
    counts = dense.sum(1)
    order = torch.argsort((~dense).to(torch.int8), dim=1, stable=True)
    width = max(1, int(counts.max()) if counts.numel() else 1)
    return counts, order[:, :width].contiguous()
