"""The GPU attention path (``model/attention_flex.py``: flex attention over the paged cache, SDPA
for prefills from position 0) against the reference ``paged_attention``, run eagerly on the CPU.

Every case writes the step's K/V into a cache whose blocks are scattered (``paged_cache``), so a
block-table or position mistake reads another sequence's keys. The block masks are also checked
against the exact mask they summarize: a block left out must be masked for every query of its
query block, a block marked full must be visible to every one.
"""

from __future__ import annotations

import pytest
import torch
from random_models import paged_cache

from dualpath.model import flex_masks
from dualpath.model.attention import AttentionBatch, DecodeSlice, PrefillSlice, paged_attention
from dualpath.model.attention_flex import FlexPlan
from dualpath.model.flex_masks import Q_BLOCK_TOKENS

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
DTYPES = [torch.float32, torch.bfloat16]
BLOCK = 16


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def _slots(table: list[int], start: int, end: int) -> torch.Tensor:
    pos = torch.arange(start, end)
    return torch.tensor(table)[pos // BLOCK] * BLOCK + pos % BLOCK


def _step(seqs: list[tuple[int, int]], tables: list[list[int]],
          window: int | None) -> tuple[AttentionBatch, int]:
    """The batch of sequences ``(pos0, new tokens)`` in row order (one new token at
    ``pos0 > 0``: a decode row), and its row count."""
    slots, prefills, rows, dec_tables, dec_ctx = [], [], [], [], []
    row = 0
    for (pos0, new), table in zip(seqs, tables, strict=True):
        slots.append(_slots(table, pos0, pos0 + new))
        if new == 1 and pos0 > 0:
            rows.append(row)
            dec_tables.append(table)
            dec_ctx.append(pos0 + 1)
        else:
            prefills.append(PrefillSlice(row, new, _slots(table, 0, pos0 + new), pos0, window))
        row += new
    decode = DecodeSlice.build(rows, dec_tables, dec_ctx, BLOCK, window) if rows else None
    return AttentionBatch(torch.cat(slots), prefills, decode), row


def _compare(seqs: list[tuple[int, int]], dtype: torch.dtype, heads: int = 4,
             kv_heads: int = 2, window: int | None = None, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    dim = 16
    cache, tables = paged_cache(g, [p + n for p, n in seqs], BLOCK, kv_heads, dim, dtype)
    batch, rows = _step(seqs, tables, window)
    q = torch.randn(rows, heads, dim, generator=g).to(dtype)
    new = cache.view(-1, 2, kv_heads, dim)[batch.slot_mapping]  # the step's K/V, as written
    want = paged_attention(q, cache, batch, dim**-0.5)
    plan = FlexPlan.build(batch, cache.shape[0], BLOCK, cache.device, dtype)
    got = plan.attend(q, new[:, 0], new[:, 1], cache, dim**-0.5)
    _close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_from_position_zero_matches_the_reference(dtype):
    _compare([(0, 37), (0, 5)], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_prefill_over_a_cached_prefix_matches_the_reference(dtype):
    _compare([(40, 23), (16, 150)], dtype)  # a second chunk spans two query blocks


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_of_ragged_contexts_matches_the_reference(dtype):
    _compare([(4, 1), (47, 1), (16, 1), (90, 1), (31, 1)], dtype)  # 5 rows, padded to 8


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_prefill_chunk_and_decode_rows_match_the_reference(dtype):
    _compare([(9, 1), (0, 20), (33, 1), (21, 30), (60, 1)], dtype)


@pytest.mark.parametrize(("heads", "kv_heads"), [(2, 2), (8, 2), (8, 1)])
def test_grouped_and_plain_heads_match_the_reference(heads, kv_heads):
    _compare([(0, 19), (25, 9), (40, 1)], torch.float32, heads, kv_heads)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sliding_window_matches_the_reference(dtype):
    # a prefill from 0 longer than the window takes flex, not SDPA; decodes past the window
    _compare([(0, 45), (30, 20), (70, 1), (10, 1), (200, 1)], dtype, window=24)


def test_a_window_of_whole_blocks_and_long_chunks_match_the_reference():
    _compare([(100, 140), (33, 1)], torch.float32, window=2 * BLOCK, seed=3)


def test_prefills_from_zero_run_sdpa_and_the_rest_run_flex():
    g = torch.Generator().manual_seed(0)
    cache, tables = paged_cache(g, [20, 40, 9], BLOCK, 2, 16, torch.float32)
    batch, _ = _step([(0, 20), (30, 10), (8, 1)], tables, None)
    plan = FlexPlan.build(batch, cache.shape[0], BLOCK, cache.device, torch.float32)
    assert plan.dense == [(0, 20)]
    assert plan.prefill is not None and plan.prefill.rows.tolist() == list(range(20, 30))
    assert plan.decode is not None and plan.decode.padded == 1


def _exact_mask(block_mask, q_len: int, kv_len: int) -> torch.Tensor:
    b = torch.arange(block_mask.kv_num_blocks.shape[0])[:, None, None]
    q = torch.arange(q_len)[None, :, None]
    kv = torch.arange(kv_len)[None, None, :]
    return block_mask.mask_mod(b, torch.zeros_like(b), q, kv)  # [B, Q, KV]


def _listed(block_mask, full: bool) -> torch.Tensor:
    """``[B, QB, KVB]`` bool: the blocks the block mask lists (partial or full ones)."""
    num = block_mask.full_kv_num_blocks if full else block_mask.kv_num_blocks
    idx = block_mask.full_kv_indices if full else block_mask.kv_indices
    kv_blocks = block_mask.seq_lengths[1] // block_mask.BLOCK_SIZE[1]
    out = torch.zeros(num.shape[0], num.shape[2], kv_blocks, dtype=torch.bool)
    if num is None:
        return out
    for b in range(num.shape[0]):
        for i in range(num.shape[2]):
            out[b, i, idx[b, 0, i, : num[b, 0, i]].long()] = True
    return out


def _check_block_mask(block_mask, real_rows: torch.Tensor) -> None:
    """Every block some real query row sees is listed; a full block is seen whole by every
    real row of its query block (padding rows are don't-cares)."""
    q_len, kv_len = block_mask.seq_lengths
    q_blocks = -(-q_len // Q_BLOCK_TOKENS)
    exact = torch.zeros(block_mask.kv_num_blocks.shape[0], q_blocks * Q_BLOCK_TOKENS, kv_len,
                        dtype=torch.bool)
    exact[:, :q_len] = _exact_mask(block_mask, q_len, kv_len)
    batch = exact.shape[0]
    real = torch.zeros(q_blocks * Q_BLOCK_TOKENS, dtype=torch.bool)
    real[real_rows] = True
    blocks = exact.view(batch, q_blocks, Q_BLOCK_TOKENS, kv_len // BLOCK, BLOCK)
    seen = blocks.any(dim=(2, 4))
    whole = (exact | ~real[None, :, None]).view_as(blocks).all(dim=4).all(dim=2)
    partial = _listed(block_mask, False)
    full = _listed(block_mask, True) if block_mask.full_kv_num_blocks is not None else \
        torch.zeros_like(partial)
    assert not (seen & ~(partial | full)).any(), "a block some query sees is not listed"
    assert not (full & ~whole).any(), "a block marked full is masked for some query"
    assert not (partial & full).any()


def test_block_masks_list_every_visible_block_and_only_whole_ones_as_full():
    g = torch.Generator().manual_seed(5)
    for window in (None, 24, 2 * BLOCK):
        seqs = [(9, 1), (0, 150), (33, 1), (21, 130), (60, 1), (200, 1)]
        cache, tables = paged_cache(g, [p + n for p, n in seqs], BLOCK, 2, 16, torch.float32)
        batch, _ = _step(seqs, tables, window)
        plan = FlexPlan.build(batch, cache.shape[0], BLOCK, cache.device, torch.float32)
        kv_len = cache.shape[0] * BLOCK
        assert plan.decode.block_mask.seq_lengths == (1, kv_len)
        _check_block_mask(plan.decode.block_mask, torch.tensor([0]))
        _check_block_mask(plan.prefill.block_mask, plan.prefill.at)
        if window is None:  # (a window narrower than a query block leaves no block whole)
            assert plan.prefill.block_mask.full_kv_num_blocks.sum() > 0


def test_decode_batches_pad_to_powers_of_two():
    assert [flex_masks.decode_bucket(n) for n in (1, 2, 3, 5, 8, 9, 33)] == \
        [1, 2, 4, 8, 8, 16, 64]


def test_building_a_plan_reads_nothing_back_from_the_device():
    # on the meta device a read-back (.item(), int(t), .tolist()) raises: the plan of a mixed
    # step and the reference path's decode gather need only host-known ints
    g = torch.Generator().manual_seed(2)
    seqs = [(9, 1), (0, 20), (33, 1), (21, 30)]
    cache, tables = paged_cache(g, [p + n for p, n in seqs], BLOCK, 2, 16, torch.float32)
    batch, _ = _step(seqs, tables, 24)
    meta = batch.to(torch.device("meta"))
    plan = FlexPlan.build(meta, cache.shape[0], BLOCK, torch.device("meta"), torch.float32)
    assert plan.decode.block_mask.kv_indices.is_meta
    assert plan.prefill.block_mask.full_kv_indices.is_meta
    assert meta.decode.slot_ids().shape == (2, 34) and meta.decode.mask().shape == (2, 34)


def test_chunks_sharing_prefix_blocks_match_and_never_share_a_query_block():
    # two chunks over the same cached prefix blocks (prefix reuse) in one step: were their
    # rows in one query block, it would list the shared blocks twice and count them twice
    g = torch.Generator().manual_seed(4)
    seqs = [(2 * BLOCK, 20), (2 * BLOCK, 9), (5, 1)]
    cache, tables = paged_cache(g, [p + n for p, n in seqs], BLOCK, 2, 16, torch.float32)
    tables[1][:2] = tables[0][:2]
    batch, rows = _step(seqs, tables, None)
    q = torch.randn(rows, 4, 16, generator=g)
    new = cache.view(-1, 2, 2, 16)[batch.slot_mapping]
    plan = FlexPlan.build(batch, cache.shape[0], BLOCK, cache.device, torch.float32)
    assert plan.prefill.at.tolist() == [*range(20), *range(128, 137)]
    _close(plan.attend(q, new[:, 0], new[:, 1], cache, 0.25),
           paged_attention(q, cache, batch, 0.25), torch.float32)
    bm = plan.prefill.block_mask
    for i in range(bm.kv_num_blocks.shape[-1]):
        listed = torch.cat((bm.kv_indices[0, 0, i, : bm.kv_num_blocks[0, 0, i]],
                            bm.full_kv_indices[0, 0, i, : bm.full_kv_num_blocks[0, 0, i]]))
        assert listed.unique().numel() == listed.numel()


def test_steps_in_one_size_bucket_give_the_compiled_kernels_one_shape():
    # on CUDA every new shape compiles anew: block lists are num_blocks wide, and batches,
    # packed lengths and chunk counts are padded to powers of two
    g = torch.Generator().manual_seed(6)
    shapes = []
    steps = ([(40, 300), (20, 30), (9, 1), (30, 1), (10, 50), (12, 1)],
             [(70, 450), (5, 20), (130, 1), (8, 9), (3, 1), (30, 40), (5, 1)])
    for seqs in steps:  # 3 and 4 chunks in 5 and 7 query blocks, 3 decode rows: one bucket
        cache, tables = paged_cache(g, [600] * 7, BLOCK, 2, 16, torch.float32)
        batch, _ = _step(seqs, tables[: len(seqs)], 24)
        plan = FlexPlan.build(batch, cache.shape[0], BLOCK, cache.device, torch.float32)
        masks = (plan.prefill.block_mask, plan.decode.block_mask)
        shapes.append([(m.seq_lengths, *(t.shape for t in m.as_tuple()[2:6] if t is not None),
                        *(c.cell_contents.shape for c in m.mask_mod.__closure__
                          if isinstance(c.cell_contents, torch.Tensor))) for m in masks])
    assert shapes[0] == shapes[1]
