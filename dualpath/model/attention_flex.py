"""Attention over the paged cache on the GPU: torch's flex attention, and SDPA where it fits.

The reference path (``attention.py``) gathers every sequence's whole context out of the cache
on every layer and builds dense masks for chunked prefill; on a GPU that gather and the mask
cost more than the attention. This path reads the cache where it lies:

* **K/V** are the layer's cache seen as one long sequence of ``num_blocks * block_size``
  slots: ``[1, kv_heads, slots, head_dim]`` views of the K and V halves of
  ``[num_blocks, block_size, 2, kv_heads, head_dim]`` (no copy: a slot's K and V sit side by
  side, so the views step ``2 * kv_heads * head_dim`` values a slot).
* **Which slots a query sees** is a flex ``BlockMask`` whose KV block is one cache block: each
  query block visits only the cache blocks its sequences own (its block table), and the
  ``mask_mod`` maps a physical slot back to its logical position through ``p2l`` (block →
  logical block index in that sequence, -1 when not its block) to apply causality, the
  sequence's length and the sliding window.
* **Decode** rows run as a batch of ``B`` one-token queries (padded to a power of two);
  every block is listed as a partial block (flex decoding spreads a query's listed blocks
  over its KV splits only when there are no "full" blocks).
* **Prefill** chunks that continue a cached prefix (``pos0 > 0``) or slide a window run as one
  flat sequence of their packed queries, each chunk from a query block boundary (so a query
  block never lists two chunks' blocks, which may be the same shared prefix blocks); the
  cache blocks every row of a query block attends in full are listed as full blocks (no mask
  evaluation there).
* **Prefill from position 0** with the cache in the compute dtype runs plain causal SDPA on
  the new tokens' K/V as they leave the projection (the same values the cache now holds), no
  read-back; on CUDA in bf16 that is FlashAttention.
* **Static shapes**: compiled kernels see a few shapes, whatever the step: block lists are
  ``num_blocks`` wide, and decode batches, packed prefill lengths and chunk counts are padded
  to powers of two.

Everything a step needs (block masks, ``p2l``, the packed query rows) is built once per step,
on the first layer, from the step's ``AttentionBatch``: index arithmetic on the host where it
only needs the slices' integer fields, uploaded in one non-blocking copy, and gathers of the
block tables on the device; no layer reads anything back from the device, and the decode part
is device-only (it is captured into CUDA graphs, ``attention_graphs.py``).

Selection (``DUALPATH_ATTENTION``): ``auto`` (default) takes this path when the cache is on
CUDA; ``flex`` forces it on any device (on the CPU flex runs eagerly, materializing scores
over the whole cache: for tests); ``reference`` never takes it. A cache whose dtype differs
from the compute dtype, or (on CUDA) a block size that is not a multiple of 16, keeps the
reference path. On CUDA the flex calls are ``torch.compile``d; a compile that fails turns
this path off for the process, said once in the log, and the reference path computes.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from dualpath.model.attention import AttentionBatch, PrefillSlice, paged_attention, upload

log = logging.getLogger("dualpath.attention")

ENV_SWITCH = "DUALPATH_ATTENTION"
MODES = ("auto", "flex", "reference")
Q_BLOCK_TOKENS = 128  # query rows per flex query block (the kernels' tile)
NO_PLAN = "reference"  # AttentionBatch.flex once the step has chosen the reference path
_broken: list[str] = []  # why the compiled path was turned off in this process


class AttentionModeError(ValueError):
    """``DUALPATH_ATTENTION`` names no mode."""


def mode() -> str:
    """The attention path asked for: ``auto``, ``flex`` or ``reference``."""
    value = os.environ.get(ENV_SWITCH, "auto")
    if value not in MODES:
        raise AttentionModeError(f"{ENV_SWITCH}={value!r}: use one of {', '.join(MODES)}")
    return value


def forced() -> bool:
    """True when ``DUALPATH_ATTENTION=flex`` forces this path on every device (the C kernels
    then stand aside, ``LlamaForCausalLM.use_kernels``)."""
    return mode() == "flex"


def refusal(device: torch.device, kv_dtype: torch.dtype, dtype: torch.dtype,
            block_size: int) -> str | None:
    """Why a step on this cache keeps the reference path, or None when it takes flex."""
    asked = mode()
    if asked == "reference":
        return f"{ENV_SWITCH}=reference"
    if asked == "auto" and device.type != "cuda":
        return "the cache is not on CUDA"
    if kv_dtype != dtype:
        return f"the cache holds {kv_dtype}, the compute dtype is {dtype}"
    if device.type == "cuda" and block_size % 16:
        return f"block size {block_size} (the compiled kernels take multiples of 16)"
    if device.type == "cuda" and _broken:
        return f"the compiled path failed in this process: {_broken[0]}"
    return None


def plan_for(batch: AttentionBatch, kv_layer: torch.Tensor,
             dtype: torch.dtype) -> FlexPlan | None:
    """The step's plan on this cache (built on the first layer, kept on ``batch``), or None
    when the step takes the reference path."""
    plan = batch.flex
    if plan is None:
        block_size = kv_layer.shape[1]
        why = refusal(kv_layer.device, kv_layer.dtype, dtype, block_size)
        plan = NO_PLAN if why else FlexPlan.build(batch, kv_layer.shape[0], block_size,
                                                  kv_layer.device, dtype)
        batch.flex = plan
    return None if plan is NO_PLAN else plan


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
           batch: AttentionBatch, scale: float) -> torch.Tensor:
    """A layer's attention output ``[T, heads, head_dim]`` on the path this step takes: the
    plan's (flex and SDPA), else ``paged_attention``. ``k``/``v`` are the new tokens' K/V,
    already written to ``kv_layer``."""
    plan = plan_for(batch, kv_layer, q.dtype)
    if plan is not None:
        try:
            return plan.attend(q, k, v, kv_layer, scale)
        except compile_errors() as exc:
            if q.device.type != "cuda":
                raise
            compiled_failed(f"{type(exc).__name__}: {exc}")
            batch.flex = NO_PLAN
    return paged_attention(q, kv_layer, batch, scale)


def decode_bucket(batch: int) -> int:
    """The padded batch size a decode of ``batch`` rows runs at: the next power of two."""
    return 1 << max(0, batch - 1).bit_length()


# --- the step's plan --------------------------------------------------------------------------


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


@dataclass
class FlexPlan:
    """What every layer of one step runs: SDPA slices, the packed prefill, the decode batch."""

    dense: list[tuple[int, int]]  # (q_start, q_len) of prefills from position 0
    prefill: PrefillPlan | None
    decode: DecodePlan | None
    kernel_options: dict[str, int]

    @classmethod
    def build(cls, batch: AttentionBatch, num_blocks: int, block_size: int,
              device: torch.device, dtype: torch.dtype) -> FlexPlan:
        """The plan of ``batch`` over a cache of ``num_blocks`` blocks of ``block_size``."""
        dense = [(p.q_start, p.q_len) for p in batch.prefills if _runs_dense(p)]
        chunks = [p for p in batch.prefills if not _runs_dense(p)]
        prefill = _prefill_plan(chunks, num_blocks, block_size, device) if chunks else None
        decode = None
        if batch.decode is not None:
            decode = _decode_plan(batch, num_blocks, block_size)
        # the compiled kernels' KV tile must divide a cache block (64 by default)
        options = {"BLOCK_N": block_size} if block_size < 64 else {}
        return cls(dense, prefill, decode, options)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_layer: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention output ``[T, heads, head_dim]`` of the step's queries ``q`` (same
        shape); ``k``/``v`` ``[T, kv_heads, head_dim]`` are the new tokens' K/V, already
        written to ``kv_layer``."""
        out = torch.empty_like(q)
        for start, length in self.dense:
            rows = slice(start, start + length)
            out[rows] = causal_sdpa(q[rows], k[rows], v[rows], scale)
        if self.prefill is None and self.decode is None:
            return out
        cache_k, cache_v = cache_views(kv_layer)
        if self.prefill is not None:
            p = self.prefill
            qp = q.index_select(0, p.source).transpose(0, 1).unsqueeze(0)  # [1, H, Tp, D]
            o = run_flex("prefill", qp, cache_k, cache_v, p.block_mask, scale,
                         self.kernel_options)
            out.index_copy_(0, p.rows, o[0].transpose(0, 1).index_select(0, p.at))
        if self.decode is not None:
            d = self.decode
            qd = q.index_select(0, d.rows)
            if d.padded > qd.shape[0]:
                qd = torch.cat((qd, qd.new_zeros(d.padded - qd.shape[0], *qd.shape[1:])))
            o = run_flex("decode", qd.unsqueeze(2), cache_k, cache_v, d.block_mask, scale,
                         self.kernel_options)
            out.index_copy_(0, d.rows, o[: d.rows.shape[0], :, 0])
        return out


def _runs_dense(part: PrefillSlice) -> bool:
    return part.pos0 == 0 and (part.window is None or part.q_len <= part.window)


def cache_views(kv_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a layer's cache ``[num_blocks, block_size, 2, kv_heads, head_dim]`` as
    ``[1, kv_heads, num_blocks * block_size, head_dim]`` views (slot s = block s // block_size,
    offset s % block_size)."""
    blocks, block_size, _, kv_heads, head_dim = kv_layer.shape
    k = kv_layer[:, :, 0].reshape(blocks * block_size, kv_heads, head_dim)
    v = kv_layer[:, :, 1].reshape(blocks * block_size, kv_heads, head_dim)
    return k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float) -> torch.Tensor:
    """One sequence's causal attention from position 0 over its own new K/V: ``q [L, H, D]``,
    ``k``/``v`` ``[L, KVH, D]``; the output ``[L, H, D]``."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0),
                                       k.transpose(0, 1).unsqueeze(0),
                                       v.transpose(0, 1).unsqueeze(0), is_causal=True,
                                       scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def _decode_plan(batch: AttentionBatch, num_blocks: int, block_size: int) -> DecodePlan:
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


def _prefill_plan(chunks: list[PrefillSlice], num_blocks: int, block_size: int,
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


# --- running flex -----------------------------------------------------------------------------


def run_flex(kind: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             block_mask: BlockMask, scale: float, options: dict[str, int]) -> torch.Tensor:
    """``flex_attention`` of ``q [B, H, L, D]`` over the cache views, compiled on CUDA
    (``kind`` names the compiled function, ``decode`` or ``prefill``)."""
    if q.device.type != "cuda":
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)
    return _compiled(kind)(q, k, v, block_mask, scale, options)


def compiled_failed(why: str) -> None:
    """Turn the compiled path off for this process (said once in the log)."""
    if not _broken:
        log.error("dualpath flex attention failed to compile, running the reference path: %s",
                  why)
        _broken.append(why)


def compile_errors() -> tuple[type[BaseException], ...]:
    """What a failed ``torch.compile`` of the flex calls raises (Dynamo's and Inductor's)."""
    errors: list[type[BaseException]] = [torch._dynamo.exc.TorchDynamoException]
    inductor = getattr(torch._inductor.exc, "InductorError", None)  # torch >= 2.7
    if inductor is not None:
        errors.append(inductor)
    return tuple(errors)


@functools.cache
def _compiled(kind: str) -> Callable[..., torch.Tensor]:
    # static shapes: one compiled entry per decode batch bucket (flex decoding needs a static
    # batch) and per packed prefill length bucket and chunk count; a recompile limit below
    # that would drop to eager flex, which scores the whole cache
    config = torch._dynamo.config
    for name, floor in (("recompile_limit", 64), ("accumulated_recompile_limit", 1024)):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), floor))
    fn = _decode_call if kind == "decode" else _prefill_call
    return torch.compile(fn, dynamic=False, fullgraph=True)


def _decode_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask,
                 scale: float, options: dict[str, int]) -> torch.Tensor:
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True,
                          kernel_options=options or None)


def _prefill_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask,
                  scale: float, options: dict[str, int]) -> torch.Tensor:
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True,
                          kernel_options=options or None)
