"""The compiled GPU attention path and decode CUDA graphs on a real device (skipped without
CUDA): compiled flex attention over the paged cache against the reference ``paged_attention``
on the same GPU (Llama-3-8B's heads: 32 of 128, 8 KV heads), and an engine on CUDA whose
decode steps replay CUDA graphs giving the CPU's greedy tokens and those of graphs off."""

from __future__ import annotations

import pytest
import torch

from dualpath.config import EngineConfig
from dualpath.engine.llm_engine import LLMEngine
from dualpath.model import attention_flex, attention_graphs
from dualpath.model.attention import (
    AttentionBatch,
    DecodeSlice,
    PrefillSlice,
    paged_attention,
    upload,
)
from dualpath.model.attention_flex import FlexPlan
from dualpath.model.dummy import write_dummy_model
from dualpath.request import SamplingParams

pytestmark = pytest.mark.gpu


def _mixed_step(block: int, window: int | None, g: torch.Generator,
                num_blocks: int) -> AttentionBatch:
    """Decode rows of ragged contexts, a prefill from 0 and a chunk over a cached prefix, each
    sequence's blocks drawn at random from the cache."""
    seqs = [(300, 1), (0, 77), (45, 1), (129, 200), (1000, 1)]  # (pos0, new tokens)
    order = torch.randperm(num_blocks, generator=g).tolist()
    slots, prefills, rows, tables, ctx, row = [], [], [], [], [], 0
    for pos0, new in seqs:
        table, order = order[: -(-(pos0 + new) // block)], order[-(-(pos0 + new) // block):]
        pos = torch.arange(pos0 + new)
        ctx_slots = torch.tensor(table)[pos // block] * block + pos % block
        slots.append(ctx_slots[pos0:])
        if new == 1:
            rows.append(row)
            tables.append(table)
            ctx.append(pos0 + 1)
        else:
            prefills.append(PrefillSlice(row, new, ctx_slots, pos0, window))
        row += new
    decode = DecodeSlice.build(rows, tables, ctx, block, window)
    return AttentionBatch(torch.cat(slots), prefills, decode)


@pytest.mark.parametrize(("dtype", "block", "window"),
                         [(torch.bfloat16, 64, None), (torch.bfloat16, 64, 256),
                          (torch.float32, 16, None)])
def test_compiled_flex_matches_the_reference_on_cuda(dtype, block, window):
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, num_blocks = 32, 8, 128, 4096 // block
    cache = torch.randn(num_blocks, block, 2, kv_heads, dim, generator=g).to(dtype).cuda()
    batch = _mixed_step(block, window, g, num_blocks).to(torch.device("cuda"))
    rows = batch.slot_mapping.shape[0]
    q = torch.randn(rows, heads, dim, generator=g).to(dtype).cuda()
    new = cache.view(-1, 2, kv_heads, dim)[batch.slot_mapping]
    want = paged_attention(q, cache, batch, dim**-0.5)
    for _ in range(2):  # the second step replays the compiled kernels
        plan = FlexPlan.build(batch, num_blocks, block, cache.device, dtype)
        got = plan.attend(q, new[:, 0], new[:, 1], cache, dim**-0.5)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert not attention_flex._broken


def test_upload_lands_every_part_on_the_device():
    parts = [torch.arange(5), torch.tensor([7, -1]), torch.empty(0, dtype=torch.long)]
    moved = upload(parts, torch.device("cuda"))
    assert [m.device.type for m in moved] == ["cuda"] * 3
    assert [m.cpu().tolist() for m in moved] == [p.tolist() for p in parts]


@pytest.fixture(scope="module")
def llama3_heads_dir(tmp_path_factory):
    """Llama-3-8B's attention shape on 2 small layers (random weights)."""
    return write_dummy_model(tmp_path_factory.mktemp("llama3-heads"), "llama-3-8b", seed=5,
                             std=0.08, num_hidden_layers=2, hidden_size=1024, vocab_size=4096,
                             intermediate_size=2048, num_attention_heads=32,
                             num_key_value_heads=8, head_dim=128)


def test_decode_graphs_and_compiled_flex_give_the_cpu_tokens(llama3_heads_dir, monkeypatch):
    # fp32: the CPU's C kernels, CUDA with graphs off and on agree token for token (bf16 GEMMs
    # of 3 rows and of 4 padded ones may round differently); chunks of 128 tokens make the
    # long prompt prefill over its own cached chunks (compiled flex), the others run SDPA
    prompts = [list(range(3, 300)), list(range(7, 90)), list(range(11, 40))]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (24, 16, 8)]
    outs = {}
    for device, graphs in (("cpu", "1"), ("cuda", "0"), ("cuda", "1")):
        monkeypatch.setenv(attention_graphs.ENV_SWITCH, graphs)
        engine = LLMEngine(llama3_heads_dir, EngineConfig(
            dtype="float32", device=device, num_kv_blocks=64, max_num_batched_tokens=128))
        outs[device, graphs] = [o.output_ids for o in engine.generate(prompts, params)]
        if device == "cuda" and graphs == "1":
            assert engine.runner.graphs is not None and not engine.runner.graphs.failed
            assert set(engine.runner.graphs.replays) == {1, 2, 4}
    assert outs["cuda", "1"] == outs["cuda", "0"] == outs["cpu", "1"]
    assert not attention_flex._broken
