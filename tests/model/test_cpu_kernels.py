"""The C kernels (``model/cpu_kernels.c``) against the torch ops they replace, fp32 and bf16.

Elementwise kernels round where the torch reference rounds, so bf16 results must match it
bit for bit but for the last-bit effects of another summation order (RMSNorm) or exp; the
attention kernels accumulate in fp32 and must agree with the reference within its rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from random_models import paged_cache

from dualpath.model.attention import DecodeSlice, PrefillSlice, decode_reference, prefill_reference
from dualpath.model.kernels import kernel_status
from dualpath.model.layers import RMSNorm, RotaryEmbedding
from dualpath.model.spec import RopeSpec

KERNELS, WHY_NOT = kernel_status()  # on a CPU with AVX-512F, test_kernel_build fails instead
pytestmark = pytest.mark.skipif(KERNELS is None, reason=f"CPU kernels unavailable: {WHY_NOT}")
DTYPES = [torch.float32, torch.bfloat16]


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def _mostly_equal(got: torch.Tensor, want: torch.Tensor, max_share: float = 0.01) -> None:
    """bf16: equal but for rare last-bit differences (another summation order, another exp);
    fp32: within fp32 rounding."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        return
    differ = (got != want).float().mean().item()
    assert differ <= max_share, f"{differ:.2%} of the values differ"
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_the_residual_add_match_the_module(dtype):
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(7, 200, generator=g).to(dtype)
    x = wide[:, :96]  # rows with a stride, as a slice of a wider activation
    norm = RMSNorm(96, 1e-5)
    norm.weight.data = (torch.rand(96, generator=g) + 0.5).to(dtype)
    _mostly_equal(KERNELS.rms_norm(x, norm.weight, 1e-5), norm(x))
    delta = torch.randn(7, 96, generator=g).to(dtype)
    stream = x.clone()
    normed = KERNELS.add_rms_norm(stream, delta, norm.weight, 1e-5)
    assert torch.equal(stream, x + delta)  # the residual stream, updated in place
    _mostly_equal(normed, norm(x + delta))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_rotates_q_in_place_and_writes_k_and_v_to_their_slots(dtype):
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, tokens = 6, 2, 16, 5
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    rope = RotaryEmbedding(dim, RopeSpec())
    cos, sin = rope.cos_sin(torch.tensor([0, 3, 4, 9, 17]), dtype)
    cache = torch.zeros(4, 8, 2, kv_heads, dim, dtype=dtype)  # 4 blocks of 8 slots
    slots = torch.tensor([3, 31, 8, 0, 17])
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    want_q = RotaryEmbedding.apply(q.reshape(tokens, heads, dim), cos, sin)
    want_k = RotaryEmbedding.apply(k.reshape(tokens, kv_heads, dim), cos, sin)
    want_v = v.reshape(tokens, kv_heads, dim).clone()
    KERNELS.rope_kv(qkv, heads, kv_heads, dim, cos, sin, cache, slots)
    flat = cache.view(-1, 2, kv_heads, dim)
    _mostly_equal(qkv[:, : heads * dim].reshape(tokens, heads, dim), want_q, max_share=0.0)
    _mostly_equal(flat[slots, 0], want_k, max_share=0.0)  # bf16: bit for bit
    assert torch.equal(flat[slots, 1], want_v)
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots] = False
    assert not flat[untouched].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(dtype):
    g = torch.Generator().manual_seed(2)
    gate_up = (4 * torch.randn(9, 2 * 40, generator=g)).to(dtype)
    gate, up = gate_up.split(40, dim=-1)
    _mostly_equal(KERNELS.silu_mul(gate_up, 40), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 11])
def test_decode_attention_reads_the_paged_context_in_place(dtype, window):
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, block = 6, 2, 16, 8
    ctx_lens = [1, 8, 9, 30, 17]
    cache, tables = paged_cache(g, ctx_lens, block, kv_heads, dim, dtype)
    rows = torch.tensor([4, 0, 2, 1, 3])  # query rows in another order than the sequences
    qkv = torch.randn(5, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    part = DecodeSlice.build(rows.tolist(), tables, ctx_lens, block, window)
    want = decode_reference(qkv[rows, : heads * dim].reshape(5, heads, dim),
                            cache.view(-1, 2, kv_heads, dim), part, dim**-0.5)
    out = torch.full((5, heads * dim), float("nan"), dtype=dtype)
    KERNELS.decode_attn(qkv, part.token_idx, cache, part.block_table, part.ctx_lens, heads,
                        kv_heads, dim, window or 0, dim**-0.5, out)
    _close(out[rows].reshape(5, heads, dim), want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("start", "q_len", "window"),
                         [(0, 37, None), (0, 70, None), (21, 16, None), (0, 40, 13),
                          (30, 9, 7)])
def test_prefill_attention_is_causal_and_windowed_over_the_paged_context(dtype, start, q_len,
                                                                          window):
    g = torch.Generator().manual_seed(4)
    heads, kv_heads, dim, block = 4, 2, 32, 16
    ctx = start + q_len
    cache, (table,) = paged_cache(g, [ctx], block, kv_heads, dim, dtype)
    pos = torch.arange(ctx)
    slot_ids = torch.tensor(table)[pos // block] * block + pos % block
    qkv = torch.randn(q_len + 3, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    q_rows = qkv[3:, : heads * dim]  # a sequence's rows inside a larger batch
    part = PrefillSlice(3, q_len, slot_ids, start, window)
    want = prefill_reference(q_rows.reshape(q_len, heads, dim),
                             cache.view(-1, 2, kv_heads, dim), part, dim**-0.5)
    out = torch.full((q_len + 3, heads * dim), float("nan"), dtype=dtype)
    KERNELS.prefill_attn(q_rows, start, cache, slot_ids, heads, kv_heads, dim, window or 0,
                         dim**-0.5, out[3:])
    assert out[:3].isnan().all()  # other sequences' rows untouched
    _close(out[3:].reshape(q_len, heads, dim), want, dtype)


def test_kernels_refuse_what_they_are_not_written_for():
    shape = dict(heads=9, kv_heads=3, max_context=8192)
    assert KERNELS.supports(torch.bfloat16, head_dim=64, **shape)
    assert KERNELS.supports(torch.float32, head_dim=128, **shape)
    assert not KERNELS.supports(torch.float16, head_dim=64, **shape)  # torch ops then
    assert not KERNELS.supports(torch.float32, head_dim=24, **shape)  # whole vectors of 16
    assert not KERNELS.supports(torch.float32, head_dim=256, **shape)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engines_run_the_fast_path_unless_told_not_to(tiny_llama_dir, dtype):
    from dualpath.config import EngineConfig
    from dualpath.engine.llm_engine import LLMEngine

    fast = LLMEngine(tiny_llama_dir, EngineConfig(dtype=dtype, block_size=16, num_kv_blocks=32))
    assert fast.runner.model.kernels is KERNELS
    assert fast.runner.model.model.layers[0].mlp.gate_up_proj.packed is not None
    plain = LLMEngine(tiny_llama_dir, EngineConfig(dtype=dtype, block_size=16, num_kv_blocks=32,
                                                   cpu_kernels=False))
    assert plain.runner.model.kernels is None
    assert plain.runner.model.model.layers[0].mlp.gate_up_proj.packed is None


def test_fast_path_greedy_tokens_equal_the_torch_ops_in_mixed_steps(smollm2_dir):
    """Chunked prefills beside decodes, a cached prefix, six prompts: same 24 tokens each."""
    from dualpath.config import EngineConfig
    from dualpath.engine.llm_engine import LLMEngine
    from dualpath.request import SamplingParams

    g = torch.Generator().manual_seed(7)
    shared = torch.randint(0, 49000, (130,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 49000, (n,), generator=g).tolist()
               for n in (1, 17, 64, 90, 150, 260)]
    outs = {}
    for fast in (False, True):
        engine = LLMEngine(smollm2_dir, EngineConfig(dtype="float32", num_kv_blocks=96,
                                                     max_num_batched_tokens=96,
                                                     cpu_kernels=fast))
        engine.generate(prompts[:1], SamplingParams(max_tokens=1))  # caches `shared`
        outs[fast] = [o.output_ids for o in
                      engine.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))]
    assert outs[True] == outs[False]


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_rows_is_torch_argmax_ties_and_nan_included(dtype):
    from dualpath.model.kernels import argmax_rows

    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 1000, generator=g).to(dtype)
    x[1, 10] = x[1, 500] = x[1, 990] = 50.0  # ties: the first wins
    x[2] = float("-inf")
    x[3, 7] = x[3, 900] = float("nan")  # NaN is the largest, the first one
    x[4, 999] = 60.0  # the tail of a row
    assert argmax_rows(x) == x.argmax(-1).tolist() == [x[0].argmax().item(), 10, 0, 7, 999,
                                                       x[5].argmax().item()]
    assert argmax_rows(x[:, :37]) == x[:, :37].argmax(-1).tolist()  # strided rows, short rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("vocab", "k"), [(300, 64), (37, 23), (16 * 7, 96)])
def test_the_tied_head_layout_gives_linear_logits_and_the_embedding_rows(dtype, vocab, k):
    """Any vocabulary (panels of 16 rows, the last one short) and width (odd: bf16 pads the
    pairs), 1 to 19 rows (tiles of 8 and their tails)."""
    g = torch.Generator().manual_seed(6)
    weight = torch.randn(vocab, k, generator=g).to(dtype)
    packed = KERNELS.pack_head(weight)
    ids = torch.tensor([0, vocab - 1, vocab // 2, 3])
    assert torch.equal(KERNELS.embed_rows(packed, vocab, k, ids), weight[ids])
    for rows in (1, 8, 19):
        x = torch.randn(rows, k, generator=g).to(dtype)
        _mostly_equal(KERNELS.head_logits(packed, vocab, k, x), F.linear(x, weight))
